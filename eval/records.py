"""The evaluation's records, one schema each, and the one place they are written to and read from JSON.

* :class:`ResultRecord` — one line of ``results.jsonl``: one prompt decoded by one method, built from
  the engine's :class:`~specfit.engine.Generation` (its :class:`~specfit.engine.CycleRecord` s) by
  :meth:`ResultRecord.from_generation`;
* :class:`SummaryRow` — one row of ``summary.json`` / ``summary.md``: one dataset × method
  (:func:`specfit.eval.report.summarise`).

Both are dataclasses; ``to_json`` / ``from_json`` are their JSON form. They also read like the JSON
objects they stand for (``record["method"]``), for scripts written against ``results.jsonl``.
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from specfit.core.errors import SpecFitInputError
from specfit.core.io import dumps
from specfit.eval.metrics import task_score
from specfit.eval.modeled import MODELED_PARTS, modeled_cycle_ms


class _JsonRecord:
    """Shared JSON form of the record dataclasses: every field, in order, by name."""

    def to_json(self) -> dict:
        """The record as a JSON object (field name → value)."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict, where: str = "record"):
        """Build from a JSON object written by :meth:`to_json`.

        Raises
        ------
        SpecFitInputError
            Field ``<where>.<key>`` if a required key is missing; unknown keys are ignored (a newer
            writer may add some).
        """
        if not isinstance(obj, dict):
            raise SpecFitInputError(where, "must be a JSON object")
        kwargs = {}
        for f in fields(cls):
            if f.name in obj:
                kwargs[f.name] = obj[f.name]
            elif f.default is MISSING and f.default_factory is MISSING:
                raise SpecFitInputError(f"{where}.{f.name}", "is required")
        return cls(**kwargs)

    def __getitem__(self, key: str):
        """Read a field by its JSON key (``record["method"]``)."""
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)


@dataclass
class ResultRecord(_JsonRecord):
    """One generation: a prompt decoded by a method (one line of ``results.jsonl``).

    Attributes
    ----------
    id, dataset, method, task : str
        Prompt id, dataset, method name (SPECFIT.md §6), task (``gsm8k``, ``summarisation``, ``none``).
    prompt_tokens : int
    output_ids : list of int
        New tokens only.
    text : str
        ``output_ids`` decoded.
    new_tokens, committed, cycles : int
        ``len(output_ids)``; tokens committed over all cycles (τ · cycles); decoding cycles.
    accept_lengths, nodes_verified, levels : list of int
        Per cycle: accepted draft tokens, nodes verified (root included), draft levels.
    wall_s, prefill_s : float
        Seconds of the decode loop and of the prefill on this machine.
    modeled_ms : float
        Modeled time of all cycles on the profile (labelled modeled, :mod:`specfit.eval.modeled`).
    modeled : dict
        Its parts in ms: ``compute_ms``, ``transfer_ms``, ``draft_ms``, ``host_ms``.
    experts_transferred, experts_looked_up : int
        Experts copied host-to-device; distinct experts per layer and forward, summed.
    experts_predicted_new : int or None
        Uncached experts the selector expected (0 without a predictor; None in old files).
    expected_tokens, expected_tokens_raw : list of float or None
        Per cycle: A(S) predicted at selection (calibrated acceptance for calibrated methods) and A(S)
        from the draft's raw path probabilities; compare with ``accept_lengths`` + 1 (None in old files).
    decisions : list of str or None
        Per cycle: ``"draft"``, ``"explore"``, ``"shadow"`` (an AR step that drafted a tree in its shadow) or ``"ar"`` (None in old files).
    experts_host_computed : int
        Experts computed on the host instead (``offload="host"``/``"auto"``; 0 in the transfer mode).
    experts_prefetched, experts_prefetch_used : int
        Experts copied host-to-device by the engine's prefetch (``--prefetch``; not in
        ``experts_transferred``), and those of them the cycle's verify used (0 without prefetch).
    measured_ms : dict
        Measured totals in ms: ``draft``, ``predict`` (the expert predictor's calls), ``tree`` (tree
        building, calibration and pruning per level; absent in old files), ``solve``, ``verify``,
        ``transfer``, ``accept``, ``hidden_host`` (host ms overlapped with a draft level or the verify and
        left out of the modeled time, as the run's clock gave them: priced from counts with the counted
        clock, :mod:`specfit.eval.modeled`; absent in old files),
        ``host_thread`` (this machine's CPU ms of the engine's thread outside the forwards,
        ``CycleRecord.host_thread_ms``: the measured counterpart of ``modeled["host_ms"]`` and
        ``hidden_host``, whichever clock priced them; absent in old files).
    score : dict
        Task metric of ``text`` (accuracy or ROUGE F1), ``{}`` without a reference.
    """

    id: str
    dataset: str
    method: str
    task: str
    prompt_tokens: int
    output_ids: list
    text: str
    new_tokens: int
    committed: int
    cycles: int
    accept_lengths: list
    nodes_verified: list
    levels: list
    wall_s: float
    prefill_s: float
    modeled_ms: float
    modeled: dict
    experts_transferred: int
    experts_looked_up: int
    measured_ms: dict
    score: dict
    experts_predicted_new: int | None = None
    expected_tokens: list | None = None
    expected_tokens_raw: list | None = None
    decisions: list | None = None
    experts_host_computed: int = 0
    experts_prefetched: int = 0
    experts_prefetch_used: int = 0

    @property
    def key(self) -> tuple[str, str, str]:
        """``(id, dataset, method)``: what a resumed run skips."""
        return self.id, self.dataset, self.method

    @classmethod
    def from_generation(cls, prompt, method: str, prompt_ids: list[int], gen, text: str, cost) -> "ResultRecord":
        """The record of one generation.

        Parameters
        ----------
        prompt : specfit.eval.datasets.Prompt
        method : str
        prompt_ids : list of int
        gen : specfit.engine.Generation
        text : str
            ``gen.output_ids`` decoded (for the task metric and for reading).
        cost : CostModel
            The hardware profile scaled to the model's layers (with its ``draft_level_ms``).
        """
        cycles = gen.cycles
        parts = [modeled_cycle_ms(c, cost) for c in cycles]
        measured = {k: sum(getattr(c, f"{k}_ms") for c in cycles)
                    for k in ("draft", "predict", "tree", "solve", "verify", "transfer", "accept", "hidden_host",
                              "host_thread")}
        return cls(
            id=prompt.id, dataset=prompt.dataset, method=method, task=prompt.task,
            prompt_tokens=len(prompt_ids), output_ids=list(gen.output_ids), text=text,
            new_tokens=len(gen.output_ids), committed=sum(c.committed for c in cycles), cycles=len(cycles),
            accept_lengths=[c.accepted for c in cycles], nodes_verified=[c.nodes_verified for c in cycles],
            levels=[c.levels for c in cycles], wall_s=gen.wall_s, prefill_s=gen.prefill_s,
            modeled_ms=sum(p["total_ms"] for p in parts),
            modeled={k: sum(p[k] for p in parts) for k in MODELED_PARTS},
            experts_transferred=int(sum(sum(c.transferred) for c in cycles)),
            experts_looked_up=int(sum(sum(c.true_experts) for c in cycles)),
            experts_predicted_new=int(sum(sum(c.predicted_new) for c in cycles)),
            expected_tokens=[c.expected_tokens for c in cycles],
            expected_tokens_raw=[c.expected_tokens_raw for c in cycles], decisions=[c.decision for c in cycles],
            experts_host_computed=int(sum(sum(c.host.get("computed", [])) for c in cycles)),
            experts_prefetched=int(sum(sum(c.prefetch.get("experts", [])) for c in cycles)),
            experts_prefetch_used=int(sum(sum(c.prefetch.get("used", [])) for c in cycles)),
            measured_ms=measured, score=task_score(prompt.task, text, prompt.reference))


@dataclass
class SummaryRow(_JsonRecord):
    """One dataset × method of an evaluation (a row of ``summary.json`` and ``summary.md``).

    Attributes
    ----------
    dataset, method : str
    prompts, new_tokens : int
    tau : float
        Mean committed tokens per cycle (τ, bonus token included).
    tokens_per_s, tokens_per_s_median : float
        Wall clock on this machine, decode only: pooled, and the median over prompts.
    modeled_tokens_per_s : float
        Modeled on the profile.
    speedup_vs_ar, speedup_vs_eagle3 : float or None
        Modeled tokens/s over that method's (None without it in the run).
    speedup_vs_ar_wall : float or None
    experts_per_token, cache_hit_rate, mean_nodes_verified : float
    predicted_vs_transferred : float or None
        Predicted uncached experts over those transferred (methods with an expert predictor).
    solve_share, solve_share_wall : float
        Solver ms over modeled / wall ms.
    predict_share, solve_predict_share : float or None
        Expert-predictor ms (its calls; tree building and calibration are ``measured_ms["tree"]`` of
        each record), and solver + predictor ms, over modeled ms; None when a record predates that
        split (no ``measured_ms["tree"]``: its ``predict`` held every level's host work).
    modeled_share : dict
        Compute, transfer, draft and host parts of the modeled time.
    equal_to_ar : bool or None
        Greedy outputs equal AR's (None when not compared: AR itself, or sampling).
    first_divergence : dict
        {prompt id: first differing token index}.
    acceptance_by_depth : list of float
    task : dict
        Accuracy or ROUGE F1.
    task_metric : str
        The same as text.
    predicted_tau, predicted_tau_raw : float or None
        Mean A(S) per cycle predicted at selection (calibrated) and from the raw path probabilities;
        compare with ``tau`` (None for old records).
    ar_share : float or None
        Fraction of cycles in which the AR gate skipped drafting (None for old records).
    host_share : float
        Host part of the modeled time (expert predictor, solver, the engine's bookkeeping: priced from
        their counts or measured, as the run's clock says, :mod:`specfit.eval.modeled`) over the modeled
        time; the target is <= 2%.
    prefetched_per_token, prefetch_used_share : float or None
        With ``--prefetch``: experts prefetched per committed token (also counted in ``experts_per_token``,
        every host-to-device copy) and the share of them the verify used (None without prefetch).
    host_ms_per_token, host_thread_ms_per_token : float or None
        Per committed token, hidden parts included: the host ms the run's clock priced (``modeled["host_ms"]
        + measured_ms["hidden_host"]``: counted or measured) and this machine's measured CPU ms of the same
        host work (``measured_ms["host_thread"]``; None for records written without it).
    """

    dataset: str
    method: str
    prompts: int
    new_tokens: int
    tau: float
    tokens_per_s: float
    tokens_per_s_median: float
    modeled_tokens_per_s: float
    experts_per_token: float
    cache_hit_rate: float
    mean_nodes_verified: float
    predicted_vs_transferred: float | None
    solve_share: float
    solve_share_wall: float
    modeled_share: dict
    equal_to_ar: bool | None
    first_divergence: dict
    acceptance_by_depth: list
    task: dict
    task_metric: str
    speedup_vs_ar: float | None = None
    speedup_vs_eagle3: float | None = None
    speedup_vs_ar_wall: float | None = None
    predicted_tau: float | None = None
    predicted_tau_raw: float | None = None
    ar_share: float | None = None
    host_share: float = 0.0
    predict_share: float | None = 0.0
    solve_predict_share: float | None = 0.0
    host_ms_per_token: float | None = None
    host_thread_ms_per_token: float | None = None
    prefetched_per_token: float | None = None
    prefetch_used_share: float | None = None


# -- results.jsonl --------------------------------------------------------------------------------
def read_results(path: str | Path, repair: bool = False) -> list[ResultRecord]:
    """Complete records of a ``results.jsonl``; a torn last line (no newline) is ignored.

    Parameters
    ----------
    path : path
    repair : bool
        Truncate the file after its last complete line (before appending to it).

    Returns
    -------
    list of ResultRecord

    Raises
    ------
    SpecFitInputError
        If a complete line is not a JSON object or lacks a field (field ``results.jsonl``).
    """
    path = Path(path)
    if not path.is_file():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if repair and end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    out = []
    for i, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if not isinstance(rec, dict):
            raise SpecFitInputError("results.jsonl", f"{path} line {i} is not a JSON object; move the file away")
        out.append(ResultRecord.from_json(rec, where=f"results.jsonl line {i}"))
    return out


def append_result(f, record: ResultRecord) -> None:
    """Append one record as one line to the open file ``f``, flushed and fsync'ed."""
    f.write(dumps(record.to_json(), separators=(",", ":")) + "\n")
    f.flush()
    os.fsync(f.fileno())
