"""A hardware profile measured on this runtime: fit from runtime benchmarks at two or more layer counts.

``eval/runtime_bench.py`` measures forwards of a checkpoint with L decoder layers (synthetic, at the real
Qwen3-30B-A3B shape); the profile describes the 48-layer target. With medians of AR decodes and tree
verifies of n nodes that transferred m experts (every layer together), at two or more layer counts and
with every expert resident and every expert transferred, non-negative least squares fits

    T(L, n, m) = a + b * L + c * n + p * L * n + q * m                         (ms)

(a: the embedding, lm_head and the forward's own overhead; b: one decoder layer's attention, norms,
router and launches; c: lm_head per node; p: one layer's work per node; q: one expert's H2D copy) and
extrapolates to the reference target's R layers (SPECFIT.md §3, T(S)):

    fixed_ms = a + b * R,    per_node_ms = c + p * R,    per_expert_ms = q.

The layer columns are separated only by benchmarks at two layer counts or more. A relative residual
well above a few percent means the runtime's cost is not of this form (BENCHMARKS.md, "First CUDA
run": one call per expert made a resident expert cost about as much as a copy). The draft level's and
the host's ms are not measured by the runtime benchmark; they are taken from a datasheet profile
(``--like``) and said so. The result is a measured-then-extrapolated profile: label figures priced with it
so.

Usage::

    python -m specfit.eval.measured_profile B2_all.json B2_0.json B4_all.json B4_0.json \\
        --name qwen3-30b-a3b-h200-measured --like qwen3-30b-a3b-h200 --json profile.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from specfit.core.cost import REFERENCE_LAYERS, CostModel, get_profile
from specfit.core.errors import SpecFitInputError, check_positive_int

#: The fitted coefficients, in the order of the model's columns (module docstring).
TERMS = ("a_ms", "b_ms_per_layer", "c_ms_per_node", "p_ms_per_layer_node", "q_ms_per_expert")


def bench_rows(result: dict) -> list[tuple[int, int, float, float]]:
    """``(layers, nodes, experts moved, total ms)`` of each mode of one ``runtime_bench`` result.

    Raises
    ------
    SpecFitInputError
        If the result lacks ``layers`` or ``modes``, or a mode is not ``ar_decode`` / ``verify_<n>``.
    """
    if not isinstance(result, dict) or "modes" not in result or "layers" not in result:
        raise SpecFitInputError("bench", "must be a runtime_bench result with 'layers' and 'modes'")
    rows = []
    for mode, m in result["modes"].items():
        if mode == "ar_decode":
            n = 1
        elif mode.startswith("verify_") and mode[7:].isdigit():
            n = int(mode[7:])
        else:
            raise SpecFitInputError("bench.modes", f"unknown mode {mode!r} (ar_decode or verify_<n>)")
        rows.append((int(result["layers"]), n, float(m["experts_moved"]), float(m["total_ms"])))
    return rows


def fit_profile(results: list[dict], *, name: str, reference_layers: int = REFERENCE_LAYERS,
                like: CostModel | None = None) -> tuple[CostModel, dict]:
    """Fit the per-layer model of the module docstring to runtime benchmarks and extrapolate it.

    Parameters
    ----------
    results : list of dict
        ``runtime_bench`` results (its ``--json`` output), at two or more layer counts.
    name : str
        The profile's name.
    reference_layers : int
        MoE layers of the target the profile describes (Qwen3-30B-A3B: 48).
    like : CostModel, optional
        A datasheet profile whose ``draft_level_ms``, ``host_level_ms`` and ``num_experts`` the
        measured one takes (the runtime benchmark measures neither the draft head nor the host's work).

    Returns
    -------
    (CostModel, dict)
        The profile (ms), and the fit: the coefficients (:data:`TERMS`), ``rmse_ms``, ``rel_residual``
        (``||r|| / ||y||``), ``records`` and ``layer_counts``.

    Raises
    ------
    SpecFitInputError
        If fewer than two layer counts are given (field ``bench.layers``), a result is malformed, or
        ``reference_layers`` is not a positive integer.

    References
    ----------
    Lawson & Hanson, *Solving Least Squares Problems* (1974), ch. 23 (NNLS), via ``scipy.optimize.nnls``.
    """
    from scipy.optimize import nnls

    check_positive_int("reference_layers", reference_layers)
    rows = np.asarray([r for res in results for r in bench_rows(res)], dtype=np.float64).reshape(-1, 4)
    layers = sorted({int(x) for x in rows[:, 0]})
    if len(layers) < 2:
        raise SpecFitInputError("bench.layers", f"need benchmarks at two or more layer counts, got {layers}")
    L, n, m, y = rows.T
    x, rnorm = nnls(np.stack([np.ones_like(L), L, n, L * n, m], axis=1), y)
    a, b, c, p, q = (float(v) for v in x)
    fixed, per_node = a + b * reference_layers, c + p * reference_layers
    extra = {} if like is None else dict(num_experts=like.num_experts, draft_level_ms=like.draft_level_ms,
                                         host_level_ms=like.host_level_ms)
    cost = CostModel(fixed, per_node, q, name=name, reference_layers=reference_layers, **extra)
    ynorm = float(np.linalg.norm(y))
    fit = dict(zip(TERMS, (a, b, c, p, q)), rmse_ms=float(rnorm / math.sqrt(len(y))),
               rel_residual=float(rnorm / ynorm) if ynorm else 0.0, records=len(y), layer_counts=layers)
    return cost, fit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="+", help="runtime_bench --json results, at two or more layer counts")
    ap.add_argument("--name", required=True, help="the profile's name, e.g. qwen3-30b-a3b-h200-measured")
    ap.add_argument("--reference-layers", type=int, default=REFERENCE_LAYERS)
    ap.add_argument("--like", default=None, help="datasheet profile for draft_level_ms and host_level_ms")
    ap.add_argument("--json", default=None, help="also write the profile and the fit to this file")
    args = ap.parse_args(argv)
    try:
        results = [json.loads(Path(f).read_text()) for f in args.bench]
        like = get_profile(args.like) if args.like else None
        cost, fit = fit_profile(results, name=args.name, reference_layers=args.reference_layers, like=like)
    except (OSError, ValueError) as e:  # SpecFitInputError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = {"profile": {"name": cost.name, **cost.to_json(), "reference_layers": cost.reference_layers,
                       "draft_level_ms": cost.draft_level_ms, "host_level_ms": cost.host_level_ms,
                       "draft_and_host_from": args.like},
           "fit": fit, "sources": args.bench}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
