"""The shipped proxy models: a small trained Qwen3-MoE target and its EAGLE-3 draft head.

Both live in this package as standard Hugging Face model directories so that they travel as
package data and load without any download:

- ``target/``: ``Qwen3MoeForCausalLM`` (config.json, model.safetensors, tokenizer files, README.md)
- ``eagle3/``: an EAGLE-3 head in the public checkpoint layout (config.json, model.safetensors,
  README.md), see :mod:`models.eagle3`.

Training is reproduced with ``python -m specfit.models.proxy.train --all`` (see the model cards).
"""

from __future__ import annotations

from pathlib import Path

#: Directory of the shipped proxy target (a Hugging Face ``Qwen3MoeForCausalLM`` checkpoint).
TARGET_DIR = Path(__file__).resolve().parent / "target"
#: Directory of the shipped EAGLE-3 draft head for :data:`TARGET_DIR`.
EAGLE3_DIR = Path(__file__).resolve().parent / "eagle3"


def paths() -> dict[str, Path]:
    """Return the shipped proxy model directories.

    Returns
    -------
    dict[str, pathlib.Path]
        ``{"target": TARGET_DIR, "eagle3": EAGLE3_DIR}``; the tokenizer files are in the target
        directory.
    """
    return {"target": TARGET_DIR, "eagle3": EAGLE3_DIR}
