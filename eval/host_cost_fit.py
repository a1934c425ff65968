"""Fit the engine's host prices (:class:`specfit.core.host_cost.HostCosts`) to this machine's measured host work.

The engine decodes prompts of the evaluation's datasets with each method on the measured clock
(:class:`specfit.engine.clock.MeasuredClock`), counting every piece of host work it charges
(:data:`specfit.core.host_cost.HOST_WORK`). Per cycle, the measured host CPU ms (``host_cpu_ms +
hidden_host_ms``: thread time of the predictor, tree, solver, bookkeeping and learning, hidden parts
included) is regressed on the cycle's counts by non-negative least squares (Lawson & Hanson, *Solving
Least Squares Problems* (1974), ch. 23, via ``scipy.optimize.nnls``), fitted on the first dataset and
checked on the second (held out): per method, the predicted host ms of all its cycles against the measured.

Usage::

    python -m specfit.eval.host_cost_fit --limit 4 --max-new-tokens 48 --json host_cost_fit.json

The fitted ``host_costs`` object goes into a profile file (``specfit eval --profile FILE``) or into
:data:`specfit.core.host_cost.HOST_COSTS`.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from specfit.core.host_cost import HOST_WORK
from specfit.engine.clock import MeasuredClock
from specfit.eval.machine import command_line, machine, publish

#: Methods whose host work is measured (every one that drafts, and AR's bookkeeping).
FIT_METHODS = ("ar", "eagle3", "eagle3-scan", "specfit")


class RecordingClock(MeasuredClock):
    """The measured clock, recording the counts charged per cycle: each cycle's first charge is its
    ``cycle`` (``SpecDecoder._cycle``), so ``segments[i]`` holds the counts from the i-th cycle's start to
    the next one's (a generation's final learning lands in its last cycle, as its host ms do)."""

    def __init__(self):
        self.segments: list[np.ndarray] = []

    def charge(self, kind: str, n: float = 1) -> None:
        """Count ``n`` of ``kind`` in the running cycle's segment."""
        if kind == "cycle" or not self.segments:
            self.segments.append(np.zeros(len(HOST_WORK)))
        self.segments[-1][HOST_WORK.index(kind)] += n


def measure(config) -> list[dict]:
    """Decode ``config``'s prompts with every method of ``config.methods`` on a :class:`RecordingClock`;
    per cycle ``{"dataset", "method", "counts": (len(HOST_WORK),), "host_ms"}`` (measured, ms)."""
    import torch

    from specfit.eval import run as eval_run

    p = eval_run.plan(config)
    models = eval_run.load_models(p)
    clock = models.clock = RecordingClock()
    torch.set_num_threads(max(config.threads, 1))
    rows, dataset = [], None
    tree = eval_run.TreeSettings(config.total_tokens, config.depth, config.top_k)
    with torch.no_grad():
        for m in p.methods:  # untimed warm-up
            models.decoder(m, tree=tree).generate(p.prompts[0][1][-eval_run.WARMUP_TOKENS:], 2)
        for pr, ids in p.prompts:
            if pr.dataset != dataset:
                models.online.clear()
                dataset = pr.dataset
            for m in p.methods:
                first = len(clock.segments)
                gen = models.decoder(m, tree=tree).generate(ids, config.max_new_tokens, eos_id=models.eos_token_id)
                segments = clock.segments[first:]
                if len(segments) != len(gen.cycles):
                    raise RuntimeError(f"{len(segments)} cycles charged, {len(gen.cycles)} recorded")
                rows += [{"dataset": pr.dataset, "method": m.name, "counts": c.tolist(),
                          "host_ms": rec.host_cpu_ms + rec.hidden_host_ms} for rec, c in zip(gen.cycles, segments)]
    return rows


def fit(rows: list[dict]) -> dict:
    """NNLS of the measured host ms on the counts, on the first dataset's cycles; per method and dataset
    the measured and predicted host ms of all its cycles, and the per-cycle relative residual.

    Returns ``{"host_costs": {kind: ms}, "train", "held_out": dataset, "per_method": [...],
    "rel_residual": {"train", "held_out"}}``."""
    from scipy.optimize import nnls

    sets = list(dict.fromkeys(r["dataset"] for r in rows))
    train = [r for r in rows if r["dataset"] == sets[0]]
    X = np.array([r["counts"] for r in train], dtype=float)
    y = np.array([r["host_ms"] for r in train])
    x, _ = nnls(X, y)

    def rel(rs):
        if not rs:
            return None
        A, b = np.array([r["counts"] for r in rs], dtype=float), np.array([r["host_ms"] for r in rs])
        return float(np.linalg.norm(A @ x - b) / np.linalg.norm(b))

    per = []
    for d in sets:
        for m in dict.fromkeys(r["method"] for r in rows):
            rs = [r for r in rows if r["dataset"] == d and r["method"] == m]
            if rs:
                meas = sum(r["host_ms"] for r in rs)
                pred = float(sum(np.dot(r["counts"], x) for r in rs))
                per.append({"dataset": d, "method": m, "cycles": len(rs), "measured_ms": meas, "predicted_ms": pred,
                            "ratio": pred / meas if meas else None})
    return {"host_costs": {k: round(float(v), 5) for k, v in zip(HOST_WORK, x)}, "train": sets[0],
            "held_out": sets[1] if len(sets) > 1 else None, "per_method": per,
            "rel_residual": {"train": rel(train), "held_out": rel([r for r in rows if r["dataset"] != sets[0]])}}


def main(argv=None) -> int:
    from specfit.eval.run import EvalConfig

    ap = argparse.ArgumentParser(prog="python -m specfit.eval.host_cost_fit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=4, help="prompts per dataset (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--cache-slots", default="32")
    ap.add_argument("--profile", default="qwen3-30b-a3b-pcie4")
    ap.add_argument("--json", default=None, help="write the result here")
    a = ap.parse_args(argv)
    slots = a.cache_slots if a.cache_slots == "all" else int(a.cache_slots)
    config = EvalConfig(datasets=("gsm8k", "cnndm"), limit=a.limit, methods=FIT_METHODS,
                        max_new_tokens=a.max_new_tokens,
                        cache_slots=slots, profile=a.profile, clock="measured", out="/tmp/specfit-host-cost-fit")
    rows = measure(config)
    res = {"machine": machine(), "command": command_line("specfit.eval.host_cost_fit", argv), **fit(rows),
           "cycles": len(rows)}
    lines = ["| dataset | method | cycles | measured host ms | predicted host ms | predicted / measured |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['dataset']} | {r['method']} | {r['cycles']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
              f"{r['ratio']:.3f} |" for r in res["per_method"]]
    lines += ["", "host_costs (ms per count): " + ", ".join(f"{k}={v}" for k, v in res["host_costs"].items()),
              f"per-cycle relative residual: train {res['rel_residual']['train']:.3f}, held out "
              f"{res['rel_residual']['held_out'] or float('nan'):.3f}"]
    publish(res, "\n".join(lines), a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
