"""Greedy autoregressive generation and the report behind ``specfit generate``."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from specfit.models.qwen3_moe.model import OffloadedQwen3Moe
from specfit.core.errors import SpecFitInputError

#: Files whose presence means a checkpoint directory ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def greedy_generate(model: OffloadedQwen3Moe, prompt_ids, max_new_tokens: int,
                    eos_token_id: int | Sequence[int] | None = None) -> list[int]:
    """Greedy autoregressive decoding (argmax at every step) from a fresh KV prefix.

    Parameters
    ----------
    model : OffloadedQwen3Moe
        The target; its KV is reset first, its expert cache is kept.
    prompt_ids : sequence of int or LongTensor
        (T,) prompt token ids.
    max_new_tokens : int
        Upper bound on generated tokens.
    eos_token_id : int or sequence of int, optional
        Stop after emitting one of these ids (it is included in the output).

    Returns
    -------
    list of int
        The new token ids only.

    Raises
    ------
    SpecFitInputError
        If ``max_new_tokens`` is negative or the prompt is invalid.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise SpecFitInputError("max_new_tokens", f"must be a non-negative integer, got {max_new_tokens!r}")
    stop = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
    model.reset()
    out: list[int] = []
    if max_new_tokens == 0:
        return out
    logits = model.prefill(prompt_ids).logits[-1]
    while True:
        tok = int(torch.argmax(logits))
        out.append(tok)
        if len(out) >= max_new_tokens or tok in stop:
            return out
        logits = model.decode(tok).logits[-1]


def load_tokenizer(model_dir: str | Path):
    """The directory's tokenizer (transformers ``AutoTokenizer``), or None when it ships none."""
    if not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def generate_report(model_dir: str | Path, *, prompt: str | None = None, prompt_ids: Sequence[int] | None = None,
                    max_new_tokens: int, device: str = "cpu", **model_kwargs) -> dict:
    """Load a checkpoint, decode greedily and report tokens, expert-cache counters and memory.

    Parameters
    ----------
    model_dir : str or Path
        Qwen3-MoE checkpoint directory.
    prompt : str, optional
        Prompt text; needs a tokenizer in ``model_dir``. Exactly one of ``prompt``/``prompt_ids``.
    prompt_ids : sequence of int, optional
        Prompt token ids.
    max_new_tokens : int
        Tokens to generate (fewer when an end-of-sequence id of ``config.json`` is emitted).
    device : str
        Compute device.
    **model_kwargs
        Passed to :meth:`OffloadedQwen3Moe.from_pretrained` (``cache_slots``, ``gpu_memory``, ``eviction``).

    Returns
    -------
    dict
        ``{"output_ids": [int], "text": str | None, "prompt_ids": [int], "stats": cache stats
        (see :meth:`DeviceExpertCache.stats`), "memory": bytes (see :meth:`OffloadedQwen3Moe.memory`)}``.

    Raises
    ------
    SpecFitInputError
        No prompt or both, ``prompt`` without a tokenizer, or any loading/runtime input error.
    """
    if (prompt is None) == (prompt_ids is None):
        raise SpecFitInputError("--prompt", "give exactly one of --prompt and --prompt-ids")
    tokenizer = load_tokenizer(model_dir)
    if prompt is not None:
        if tokenizer is None:
            raise SpecFitInputError("--prompt", "the model directory has no tokenizer; use --prompt-ids")
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    prompt_ids = [int(t) for t in prompt_ids]
    model = OffloadedQwen3Moe.from_pretrained(model_dir, device=device,
                                              max_len=len(prompt_ids) + max_new_tokens + 1, **model_kwargs)
    out = greedy_generate(model, prompt_ids, max_new_tokens, eos_token_id=model.spec.eos_token_id)
    return {"prompt_ids": prompt_ids, "output_ids": out,
            "text": None if tokenizer is None else tokenizer.decode(out, skip_special_tokens=True),
            "stats": model.cache.stats(), "memory": model.memory()}
