"""Greedy autoregressive generation and the tokenizer of a checkpoint directory."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from specfit.models.qwen3_moe.model import OffloadedQwen3Moe
from specfit.core.errors import SpecFitInputError, check_positive_int

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
        (T,) or (1, T) prompt token ids; batch size 1 only.
    max_new_tokens : int, >= 1
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
        If ``max_new_tokens`` is not a positive integer, or the prompt is invalid (empty, a batch
        of more than one sequence, ids out of the vocabulary, longer than the KV capacity).
    """
    check_positive_int("max_new_tokens", max_new_tokens)
    stop = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
    model.reset()
    out: list[int] = []
    logits = model.prefill(prompt_ids).logits[-1]
    while True:
        tok = int(torch.argmax(logits))
        out.append(tok)
        if len(out) >= max_new_tokens or tok in stop:
            return out
        logits = model.decode(tok).logits[-1]


def load_tokenizer(model_dir: str | Path):
    """The directory's tokenizer (transformers ``AutoTokenizer``), or None when it ships none.

    Raises
    ------
    SpecFitInputError
        Naming the folder, if its tokenizer files cannot be loaded (truncated, not JSON, ...).
    """
    if not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # tokenizers/transformers raise many types for a corrupt file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SpecFitInputError(str(model_dir), f"its tokenizer files cannot be loaded ({type(exc).__name__}: {first})"
                                ) from None
