"""Greedy autoregressive generation and the report behind ``specfit generate``."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from specfit.models.qwen3_moe.model import OffloadedQwen3Moe
from specfit.core.errors import SpecFitInputError, check_context, check_positive_int
from specfit.models.qwen3_moe.config import read_spec

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
    max_new_tokens : int, >= 1
        Tokens to generate (fewer when an end-of-sequence id of ``config.json`` is emitted); the
        prompt plus these must fit in the model's context (``max_position_embeddings``).
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
        A missing model directory (field ``model_dir``), no prompt or both, ``prompt`` without a
        tokenizer, a bad ``max_new_tokens`` or one that runs past the model's context, or any
        loading/runtime input error.
    """
    if not Path(model_dir).is_dir():
        raise SpecFitInputError("model_dir", f"{model_dir} is not a folder" if Path(model_dir).exists()
                                else f"no such checkpoint folder: {model_dir}")
    if (prompt is None) == (prompt_ids is None):
        raise SpecFitInputError("prompt", "give exactly one of prompt and prompt_ids")
    check_positive_int("max_new_tokens", max_new_tokens)
    spec = read_spec(model_dir)  # a bad config.json is reported before the tokenizer is looked at
    tokenizer = load_tokenizer(model_dir)
    if prompt is not None:
        if tokenizer is None:
            raise SpecFitInputError("prompt", "the model directory has no tokenizer; give token ids instead")
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not prompt_ids:
            raise SpecFitInputError("prompt", "encodes to no tokens")
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise SpecFitInputError("prompt_ids", "must contain at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < spec.vocab_size]
    if bad:
        raise SpecFitInputError("prompt_ids", f"token ids must lie in [0, {spec.vocab_size}) (vocab_size), got {bad[0]}")
    check_context("max_new_tokens", len(prompt_ids), max_new_tokens, spec.max_position_embeddings)
    model = OffloadedQwen3Moe.from_pretrained(model_dir, device=device,
                                              max_len=len(prompt_ids) + max_new_tokens + 1, **model_kwargs)
    out = greedy_generate(model, prompt_ids, max_new_tokens, eos_token_id=model.spec.eos_token_id)
    return {"prompt_ids": prompt_ids, "output_ids": out,
            "text": None if tokenizer is None else tokenizer.decode(out, skip_special_tokens=True),
            "stats": model.cache.stats(), "memory": model.memory()}
