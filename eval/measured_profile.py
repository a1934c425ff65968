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

from specfit.core.io import dumps
from specfit.core.cost import REFERENCE_LAYERS, CostModel, get_profile
from specfit.core.errors import SpecFitInputError, check_positive_int

#: The fitted coefficients, in the order of the model's columns (module docstring).
TERMS = ("a_ms", "b_ms_per_layer", "c_ms_per_node", "p_ms_per_layer_node", "q_ms_per_expert")


#: Bounds on a benchmark's numbers (decoder layers; ms and experts of one forward): far above any real one.
MAX_LAYERS, MAX_VALUE = 1_000, 1e7


def _number(value, field: str, integer: bool = False) -> float:
    """``value`` as a number in [0, :data:`MAX_VALUE`] (an integer in [1, :data:`MAX_LAYERS`] when
    ``integer``), else SpecFitInputError on ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_VALUE:
        raise SpecFitInputError(field, f"must be a number in [0, {MAX_VALUE:g}], got {value!r}")
    if integer and (int(value) != value or not 1 <= value <= MAX_LAYERS):
        raise SpecFitInputError(field, f"must be an integer in [1, {MAX_LAYERS}], got {value!r}")
    return float(value)


def bench_rows(result: dict, source: str = "bench") -> list[tuple[int, int, float, float]]:
    """``(layers, nodes, experts moved, total ms)`` of each mode of one ``runtime_bench`` result.

    Raises
    ------
    SpecFitInputError
        Naming ``source`` and the field: a result without ``layers`` (an integer in [1, :data:`MAX_LAYERS`])
        or ``modes`` (an object), a mode other than ``ar_decode`` / ``verify_<n>`` (n >= 1), or one whose
        ``total_ms`` or ``experts_moved`` is not a number in [0, :data:`MAX_VALUE`].
    """
    if not isinstance(result, dict) or not isinstance(result.get("modes"), dict) or "layers" not in result:
        raise SpecFitInputError(source, "must be a runtime_bench result: an object with 'layers' and 'modes'")
    layers = int(_number(result["layers"], f"{source}: layers", integer=True))
    rows = []
    for mode, m in result["modes"].items():
        if mode == "ar_decode":
            n = 1
        elif mode.startswith("verify_") and mode[7:].isascii() and mode[7:].isdigit() and int(mode[7:]) >= 1:
            n = int(mode[7:])
        else:
            raise SpecFitInputError(f"{source}: modes", f"unknown mode {mode!r} (ar_decode or verify_<n>, n >= 1)")
        if not isinstance(m, dict):
            raise SpecFitInputError(f"{source}: modes.{mode}", "must be an object with total_ms and experts_moved")
        moved, total = (_number(m.get(key), f"{source}: modes.{mode}.{key}") for key in ("experts_moved", "total_ms"))
        rows.append((layers, n, moved, total))
    return rows


#: Fields of a runtime_bench result that must agree across the results of one fit.
SAME = ("dtype", "grouped_experts", "grouped_kernel", "expert_bytes")


def fit_profile(results: list[dict], *, name: str, reference_layers: int = REFERENCE_LAYERS,
                like: CostModel | None = None, sources: list[str] | None = None) -> tuple[CostModel, dict]:
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
    sources : list of str, optional
        A name per result (its file), used in error messages.

    Returns
    -------
    (CostModel, dict)
        The profile (ms), and the fit: the coefficients (:data:`TERMS`), ``rmse_ms``, ``rel_residual``
        (``||r|| / ||y||``), ``records`` and ``layer_counts``.

    Raises
    ------
    SpecFitInputError
        If fewer than two layer counts are given (field ``bench.layers``), no result transferred an
        expert (``bench.experts_moved``), the results differ in dtype, expert path or expert size
        (``bench.<key>``), a result is malformed (:func:`bench_rows`), or ``reference_layers`` is not a
        positive integer.

    References
    ----------
    Lawson & Hanson, *Solving Least Squares Problems* (1974), ch. 23 (NNLS), via ``scipy.optimize.nnls``.
    """
    from scipy.optimize import nnls

    check_positive_int("reference_layers", reference_layers)
    sources = list(sources) if sources is not None else [f"bench[{i}]" for i in range(len(results))]
    rows = np.asarray([r for res, src in zip(results, sources) for r in bench_rows(res, src)],
                      dtype=np.float64).reshape(-1, 4)
    layers = sorted({int(x) for x in rows[:, 0]})
    if len(layers) < 2:
        raise SpecFitInputError("bench.layers", f"need benchmarks at two or more layer counts, got {layers}")
    if not rows[:, 3].any():
        raise SpecFitInputError("bench.total_ms", "every measured forward took 0 ms: nothing to fit")
    if not rows[:, 2].any():
        raise SpecFitInputError("bench.experts_moved", "no benchmark transferred an expert: add runs with "
                                "--cache-slots 0, or per_expert_ms would be fitted to nothing")
    for key in SAME:
        seen = {dumps(res.get(key)) for res in results if key in res}
        if len(seen) > 1:
            raise SpecFitInputError(f"bench.{key}", f"differs between the results ({', '.join(sorted(seen))}): "
                                    "fit one runtime configuration at a time")
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
        results = []
        for f in args.bench:
            try:
                results.append(json.loads(Path(f).read_text()))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                raise SpecFitInputError(f, f"is not a runtime_bench --json result ({e})") from None
        like = get_profile(args.like) if args.like else None
        cost, fit = fit_profile(results, name=args.name, reference_layers=args.reference_layers, like=like,
                                sources=args.bench)
        out = {"profile": {"name": cost.name, **cost.to_json(), "reference_layers": cost.reference_layers,
                           "draft_level_ms": cost.draft_level_ms, "host_level_ms": cost.host_level_ms,
                           "draft_and_host_from": args.like},
               "fit": fit, "sources": args.bench}
        text = dumps(out, indent=1)
        if args.json:
            if not Path(args.json).parent.is_dir():
                raise SpecFitInputError("--json", f"{args.json}: its folder does not exist")
            tmp = Path(args.json + ".tmp")
            tmp.write_text(text + "\n")
            tmp.replace(args.json)
    except (OSError, ValueError) as e:  # SpecFitInputError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
