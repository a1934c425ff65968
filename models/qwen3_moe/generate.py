"""Greedy autoregressive generation and the tokenizer of a checkpoint directory."""

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
