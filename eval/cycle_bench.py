"""Host cost of one SpecFit cycle's selection: building the draft tree and instances level by level
and solving them, through the engine's own code (``SpecDecoder._draft_and_select``).

The drafter and the expert predictor are stubs that replay a generated instance
(:mod:`specfit.eval.instances`, EAGLE-like trees with predicted experts, qwen3-30b-a3b preset: 48
layers, 128 experts, top-8, a quarter cached) one level at a time, so the time measured is what the
engine spends on the tree, the coverage accounting, the instances, the stop rule and the solver —
the work a change of the core data model can make faster or slower. No model runs.

Usage (medians over instances, per tree size; JSON on stdout)::

    python -m specfit.eval.cycle_bench --sizes 32,64,128 --count 100 --method specfit

``--evict-mb M`` reads an M MiB buffer before each level (as the head forward between two levels does
on a CPU, or a CPU forward of the target between two cycles) and before each timed call, and reports
the host ms without those reads (the cycle's wall time less its ``draft_ms``): the host work as it runs
in a decoding loop, on caches another job has just filled, rather than warm from the previous call.

The script only uses names that exist since commit 8ecf879, so the same file can time an older
checkout: ``PYTHONPATH=<a tree laid out as the installed package> python eval/cycle_bench.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

from specfit.core.io import dumps
from specfit.engine import CycleRecord, SpecDecoder, TreeSettings
from specfit.eval.instances import generate_instances, get_preset


class _ReplayDrafter:
    """Yields the levels of a fixed tree (nodes numbered level by level); tokens are node ids. With an
    ``evict`` buffer it reads the whole buffer before yielding each level."""

    def __init__(self, parents: np.ndarray, path_prob: np.ndarray, depth: np.ndarray, evict=None):
        self.evict = evict
        self.levels = []
        for d in range(1, int(depth.max()) + 1):
            ids = np.flatnonzero(depth == d)
            self.levels.append(SimpleNamespace(parents=torch.from_numpy(parents[ids]), tokens=torch.from_numpy(ids),
                                               path_prob=torch.from_numpy(path_prob[ids]), hidden=None))

    def draft_levels(self, root, top_k, max_depth):
        for level in self.levels[:max_depth]:
            if self.evict is not None:
                self.evict.sum()
            yield level


class _ReplayPredictor:
    """Predicts the generated experts of each node (its token is its id)."""

    def __init__(self, experts: np.ndarray):
        self.experts = experts

    def predict(self, tokens, hidden):
        return self.experts[np.asarray(tokens)]


def _level_order(inst) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The instance's tree renumbered level by level (as a drafter emits it)."""
    par, pp = inst.tree.parents, inst.tree.path_prob
    depth = np.zeros(inst.n, dtype=np.int64)
    for v in range(1, inst.n):
        depth[v] = depth[par[v]] + 1
    order = np.argsort(depth, kind="stable")
    new_of = np.empty(inst.n, dtype=np.int64)
    new_of[order] = np.arange(inst.n)
    parents = np.where(par[order] >= 0, new_of[np.maximum(par[order], 0)], -1)
    return parents, pp[order], depth[order], inst.tree.experts[order]


def _machine() -> dict:
    try:
        from specfit.eval.machine import machine
    except ImportError:  # an older checkout
        return {"platform": platform.platform(), "python": platform.python_version(), "numpy": np.__version__}
    return machine()


def bench(sizes, count: int, method: str, repeat: int, seed: int = 0, evict_mb: float = 0.0) -> dict:
    """Median wall-clock ms of ``_draft_and_select`` per cycle, per tree size (see the module docstring),
    and a digest of the selected node sets (equal digests: the same selections). With ``evict_mb`` > 0,
    an ``evict_mb`` MiB buffer is read before each timed call and each level, and the ms exclude the
    levels' reads (the record's ``draft_ms``)."""
    evict = np.ones(int(evict_mb * 2**20) // 8) if evict_mb > 0 else None
    spec = get_preset("qwen3-30b-a3b")
    from specfit.core.cost import get_profile

    cost = get_profile(spec.profile)
    target = SimpleNamespace(spec=SimpleNamespace(num_experts=spec.experts, top_k=spec.top_k))
    out = {}
    for n in sizes:
        times, digest = [], hashlib.sha256()
        for _, _, inst in generate_instances(spec, [n], count, seed):
            parents, pp, depth, experts = _level_order(inst)
            drafter = _ReplayDrafter(parents, pp, depth, evict)
            dec = SpecDecoder(target, drafter, method, tree=TreeSettings(32, int(depth.max()), 4), cost=cost,
                              predictor=_ReplayPredictor(experts))
            _, selection, _ = dec._draft_and_select(0, inst.cache, CycleRecord())  # warm
            digest.update(repr(list(selection.nodes)).encode())
            best = []
            for _ in range(repeat):
                if evict is not None:
                    evict.sum()
                rec = CycleRecord()
                t0 = time.perf_counter()
                dec._draft_and_select(0, inst.cache, rec)
                best.append((time.perf_counter() - t0) * 1e3 - (rec.draft_ms if evict is not None else 0.0))
            times.append(min(best))
        out[n] = {"median_ms": statistics.median(times), "p90_ms": float(np.percentile(times, 90)),
                  "instances": len(times), "selections_sha256": digest.hexdigest()[:16]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="32,64,128")
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per instance (the fastest is kept)")
    ap.add_argument("--method", default="specfit")
    ap.add_argument("--label", default="")
    ap.add_argument("--evict-mb", type=float, default=0.0,
                    help="MiB read before each level and each timed call (0: none; caches stay warm)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {"label": args.label, "method": args.method, "count": args.count, "repeat": args.repeat,
              "evict_mb": args.evict_mb, "sizes": bench(sizes, args.count, args.method, args.repeat,
                                                        evict_mb=args.evict_mb), "machine": _machine()}
    sys.stdout.write(dumps(result))
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
