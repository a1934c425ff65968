"""The shipped proxy models: a small trained Qwen3-MoE target and its EAGLE-3 draft head.

Both live in this package as standard Hugging Face model directories so that they travel as
package data and load without any download:

- ``target/``: ``Qwen3MoeForCausalLM`` (config.json, model.safetensors, tokenizer files, README.md)
- ``eagle3/``: the strong EAGLE-3 head in the public checkpoint layout (config.json,
  model.safetensors, README.md), see :mod:`models.eagle3`;
- ``eagle3-lite/``: a briefly trained head whose acceptance matches public Qwen3-30B-A3B heads
  (τ ≈ 2); ``specfit eval`` uses it unless ``--draft strong`` (or a directory) is given.

Training is reproduced with ``python -m specfit.models.proxy.train --all`` (see the model cards).
"""

from __future__ import annotations

from pathlib import Path

#: Directory of the shipped proxy target (a Hugging Face ``Qwen3MoeForCausalLM`` checkpoint).
TARGET_DIR = Path(__file__).resolve().parent / "target"
#: Directory of the shipped *strong* EAGLE-3 draft head for :data:`TARGET_DIR` (τ ≈ 4.9 on GSM8K).
EAGLE3_DIR = Path(__file__).resolve().parent / "eagle3"
#: Directory of the shipped *lite* head: realistic acceptance (τ ≈ 2 on GSM8K, as public Qwen3-30B-A3B heads).
EAGLE3_LITE_DIR = Path(__file__).resolve().parent / "eagle3-lite"
#: Shipped heads by name; ``specfit eval --draft strong`` selects the strong one.
SHIPPED_HEADS = {"lite": EAGLE3_LITE_DIR, "strong": EAGLE3_DIR}
#: The head ``specfit eval`` uses when no ``--draft`` is given: the realistic one.
DEFAULT_HEAD = "lite"


def paths() -> dict[str, Path]:
    """Return the shipped proxy model directories.

    Returns
    -------
    dict[str, pathlib.Path]
        ``{"target": TARGET_DIR, "eagle3": EAGLE3_DIR, "eagle3-lite": EAGLE3_LITE_DIR}``; the
        tokenizer files are in the target directory.
    """
    return {"target": TARGET_DIR, "eagle3": EAGLE3_DIR, "eagle3-lite": EAGLE3_LITE_DIR}


def head_dir(draft: str | Path | None = None) -> Path:
    """The directory of a head: a path as given, a shipped head by name, or the default head.

    Parameters
    ----------
    draft : str or pathlib.Path, optional
        ``None`` (the :data:`DEFAULT_HEAD`), a name of :data:`SHIPPED_HEADS` (``lite``, ``strong``)
        or a directory.
    """
    if draft is None:
        return SHIPPED_HEADS[DEFAULT_HEAD]
    return SHIPPED_HEADS.get(str(draft), Path(draft))
