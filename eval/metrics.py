"""Metrics of the end-to-end evaluation, computed from result records (plain dicts and lists).

Conventions (Spec-Bench; PITFALLS.md "Measurement"):

* τ = committed tokens per cycle = accepted draft tokens + 1 bonus token, averaged over cycles
  (AR: 1). Tokens are counted as token ids, never by re-tokenising text.
* tokens/s = new token ids / seconds of the decode loop (prefill excluded), summed over prompts
  before dividing (a ratio of totals, so long generations weigh by their length).
* experts per token = experts copied host-to-device during decoding / committed tokens.
* cache hit rate = 1 - transferred / looked up, where a verify forward looks up, per MoE layer,
  the distinct experts its nodes route to (``true_experts``).

Task sanity: GSM8K final-answer accuracy (the number after ``####`` in the reference, the last
number in the output) and ROUGE-1/2/L F1 for summaries (``rouge-score``, Lin 2004).
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def tau(accept_lengths: Sequence[int]) -> float:
    """Mean committed tokens per cycle, τ = mean(accepted + 1).

    Parameters
    ----------
    accept_lengths : sequence of int
        Accepted draft tokens per cycle (the bonus token not included).

    Returns
    -------
    float
        τ >= 1; 0.0 for no cycles.
    """
    return sum(a + 1 for a in accept_lengths) / len(accept_lengths) if accept_lengths else 0.0


def tokens_per_s(new_tokens: int, ms: float) -> float:
    """``1000 * new_tokens / ms`` (tokens/s); 0.0 when ``ms`` is not positive."""
    return 1000.0 * new_tokens / ms if ms > 0 else 0.0


def experts_per_token(transferred: int, committed: int) -> float:
    """Experts transferred host-to-device per committed token; 0.0 when nothing was committed."""
    return transferred / committed if committed else 0.0


def cache_hit_rate(transferred: int, looked_up: int) -> float:
    """``1 - transferred / looked_up`` (distinct experts per layer and forward); 0.0 when none was looked up."""
    return 1.0 - transferred / looked_up if looked_up else 0.0


def acceptance_by_depth(accept_lengths: Iterable[int], depth: int) -> list[float]:
    """Fraction of cycles that accepted at least d draft tokens, for d = 1..depth.

    Parameters
    ----------
    accept_lengths : iterable of int
        Accepted draft tokens per cycle.
    depth : int
        Deepest tree position reported.

    Returns
    -------
    list of float, length ``depth``
        Non-increasing in d; all zeros for no cycles.
    """
    a = list(accept_lengths)
    return [sum(x >= d for x in a) / len(a) if a else 0.0 for d in range(1, depth + 1)]


def first_divergence(output: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token id where ``output`` and ``reference`` differ (a length difference
    counts at the shorter length); None when they are equal."""
    for i, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return i
    return None if len(output) == len(reference) else min(len(output), len(reference))


def _number(text: str) -> str | None:
    t = text.replace(",", "").rstrip(".")
    try:
        v = float(t)
    except ValueError:
        return None
    return str(int(v)) if v == int(v) else repr(v)


def gsm8k_reference_answer(answer: str) -> str | None:
    """The final answer of a GSM8K reference: the text after the last ``####``, commas removed.

    Returns the number normalised (``"1,000"`` → ``"1000"``, ``"3.50"`` → ``"3.5"``), or None.
    """
    if "####" not in answer:
        return None
    return _number(answer.rsplit("####", 1)[1].strip())


def gsm8k_output_answer(text: str) -> str | None:
    """The last number in a model output, normalised as :func:`gsm8k_reference_answer`; None if none.

    A ``####`` marker in the output is honoured first (the format the proxy was trained on)."""
    if "####" in text:
        tail = _NUMBER.findall(text.rsplit("####", 1)[1])
        if tail:
            return _number(tail[0])
    nums = _NUMBER.findall(text)
    return _number(nums[-1]) if nums else None


def gsm8k_correct(output_text: str, reference: str) -> bool:
    """Whether the output's final answer equals the reference's (both parsed as above)."""
    ref = gsm8k_reference_answer(reference)
    return ref is not None and gsm8k_output_answer(output_text) == ref


_PTB = [("-LRB- ", "("), (" -RRB-", ")"), ("-LRB-", "("), ("-RRB-", ")"), ("``", '"'), ("''", '"')]
_PTB_SPACE = re.compile(r" (?=[.,;:!?]|'s\b|n't\b)")


def detokenize_ptb(text: str) -> str:
    """Undo the PTB tokenisation of FRANK's highlights (see ``eval/data/cnn_dailymail/PROVENANCE.md``):
    brackets and quotes back to characters, no space before ``. , ; : ! ? 's n't``."""
    for a, b in _PTB:
        text = text.replace(a, b)
    return _PTB_SPACE.sub("", text)


def rouge(output_text: str, reference: str) -> dict[str, float]:
    """ROUGE-1, ROUGE-2 and ROUGE-L F1 (Lin 2004) of a summary against the reference highlights,
    with ``rouge-score``'s Porter stemmer; the reference is PTB-detokenised first.

    Returns
    -------
    dict
        ``{"rouge1": f, "rouge2": f, "rougeL": f}`` with f in [0, 1].
    """
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    scores = scorer.score(detokenize_ptb(reference), output_text)
    return {k: float(v.fmeasure) for k, v in scores.items()}


def task_score(task: str, output_text: str, reference: str | None) -> dict:
    """The task metric of one output: ``{"correct": bool}`` for ``gsm8k``, ROUGE F1 for ``cnndm``,
    ``{}`` otherwise or without a reference."""
    if reference is None:
        return {}
    if task == "gsm8k":
        return {"correct": gsm8k_correct(output_text, reference)}
    if task == "cnndm":
        return rouge(output_text, reference)
    return {}
