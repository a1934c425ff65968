"""The cycle-time model against the runtime: measure verifies, fit the model by NNLS, write a profile.

One command measures the offloaded Qwen3-MoE runtime's forwards on the machine it runs on and writes a
hardware profile for ``specfit eval --profile FILE``::

    python -m specfit.eval.cost_fit --synthetic qwen3-30b-a3b-experts --layers 1,2 --device cuda \\
        --name my-gpu --like qwen3-30b-a3b-h200 --json my-gpu.json

It runs tree verifies of 1-64 nodes (:data:`SIZES`) at several expert-cache sizes (none, part, all), each
forward ``--repeats`` times from the same state (the cache rebuilt and warmed the same way before each
repeat), in rounds: one warm-up round, then each round runs every configuration once, so first-call costs
and a drift of the machine's load fall on every configuration alike rather than on the ones measured last.
It records per forward the nodes ``n``, the decoder layers ``L``, the experts read ``u = sum_l |U_l|``
(hits + misses of the expert cache: every expert the forward routes to) and the experts copied
``m = sum_l misses_l``. It fits, by non-negative least squares on the medians (``--weighting relative``, the
default: each row divided by its measured ms, so the fit minimises relative error and a 1-node forward counts
as much as a 64-node one; ``absolute``: plain least squares in ms, which the largest forwards dominate),

    new form:    T = a + b L + (c + p L) n + read_ms u + per_expert_ms m
    three-term:  T = a + b L + (c + p L) n + per_expert_ms m              (a resident expert costs nothing)

(the ``L`` columns only with two or more layer counts) and reports both forms side by side: the relative
residual ``||r|| / ||y||``, the RMS of the per-configuration relative errors, the noise floor (the same
ratio for each single forward against the median of its identical repeats; also per configuration) and the
error on held-out tree sizes (:data:`HELD_OUT`, not fitted).
The profile extrapolates the per-layer terms to the target's R layers: ``fixed_ms = a + b R``, ``per_node_ms = c + p R``; with one layer
count ``fixed_ms`` and ``per_node_ms`` are the measured L-layer forward's, and the profile says so. Its
``memory_gb_per_s`` and ``link_gb_per_s`` are the effective bandwidths ``expert_bytes / ms``.

On a CPU the "copy" is a host memcpy into the cache slots and the "read" the expert matmuls reading the
weights from DRAM; the fit checks the model's form, the constants describe this machine only.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from specfit.core.cost import REFERENCE_LAYERS, CostModel, datasheet_profile, get_profile
from specfit.core.errors import SpecFitInputError, check_positive_int
from specfit.core.io import dumps

#: Tree sizes fitted (nodes, root included) and held out (measured, predicted, not fitted).
SIZES = (1, 2, 4, 8, 16, 32, 64)
HELD_OUT = (3, 12, 24)


def _columns(rows: np.ndarray, reads: bool, layer_terms: bool) -> np.ndarray:
    """Design matrix of the model (module docstring) for rows ``(L, n, u, m, ms)``."""
    L, n, u, m = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
    cols = [np.ones_like(n)] + ([L] if layer_terms else []) + [n] + ([L * n] if layer_terms else [])
    cols += ([u] if reads else []) + [m]
    return np.stack(cols, axis=1)


#: Row weightings of the NNLS fit (module docstring).
WEIGHTINGS = ("relative", "absolute")


def fit_forms(rows, held_out_rows=None, noise_rows=None, weighting: str = "absolute") -> dict:
    """Fit the new form and the three-term form (module docstring) to measured forwards.

    Parameters
    ----------
    rows : array-like, shape (R, 5)
        ``(L, n, u, m, ms)`` per measured configuration (the median of its repeats): decoder layers,
        nodes, experts read, experts copied, ms.
    held_out_rows : array-like, shape (H, 5), optional
        Configurations not fitted; each form predicts them.
    noise_rows : array-like, shape (K, 2), optional
        ``(single forward ms, median of its identical repeats ms)``: the noise floor.
    weighting : {"relative", "absolute"}
        ``"relative"``: NNLS of the rows divided by their ms (minimises ``sum ((pred - y) / y)^2``);
        ``"absolute"``: NNLS in ms (minimises ``||pred - y||``).

    Returns
    -------
    dict
        Per form (``"new"``, ``"three_term"``): ``coef`` (name -> ms), ``rel_residual`` (``||r|| / ||y||``
        in ms, whichever the weighting), ``rms_rel_err`` (RMS of ``r / y`` over the fitted rows),
        ``max_rel_err``, ``rmse_ms`` and, with held-out rows, ``held_out_max_rel_err`` and
        ``held_out_rel_err`` (per row, signed: ``(pred - y) / y``); ``noise_floor``
        (``||single - median|| / ||single||``) with noise rows; ``weighting``, ``records``, ``layer_counts``.

    Raises
    ------
    SpecFitInputError
        If ``rows`` is not (R, 5) of numbers >= 0, finite, with ms > 0 (field ``rows``), has fewer rows
        than the new form has unknowns, or ``weighting`` is not one of :data:`WEIGHTINGS` (field ``weighting``).

    References
    ----------
    Lawson & Hanson, *Solving Least Squares Problems* (1974), ch. 23 (NNLS), via ``scipy.optimize.nnls``;
    the relative weighting is that NNLS on each row (and its ms) scaled by ``1 / y``: weighted least squares.
    """
    from scipy.optimize import nnls

    if weighting not in WEIGHTINGS:
        raise SpecFitInputError("weighting", f"must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")
    r = np.asarray(rows, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] != 5 or not np.all(np.isfinite(r)) or np.any(r < 0) or np.any(r[:, 4] <= 0):
        raise SpecFitInputError("rows", "must be (R, 5) rows of finite numbers >= 0, ms > 0: (L, n, u, m, ms)")
    layer_terms = len(set(r[:, 0].tolist())) > 1
    y = r[:, 4]
    w = 1.0 / y if weighting == "relative" else np.ones_like(y)
    out = {"weighting": weighting, "records": int(r.shape[0]), "layer_counts": sorted({int(x) for x in r[:, 0]})}
    for form, reads in (("new", True), ("three_term", False)):
        a = _columns(r, reads, layer_terms)
        if a.shape[0] < a.shape[1]:
            raise SpecFitInputError("rows", f"need at least {a.shape[1]} measured configurations, got {a.shape[0]}")
        x, _ = nnls(a * w[:, None], y * w)
        names = ["a_ms"] + (["b_ms_per_layer"] if layer_terms else []) + ["c_ms_per_node"]
        names += (["p_ms_per_layer_node"] if layer_terms else []) + (["read_ms"] if reads else []) + ["per_expert_ms"]
        resid = a @ x - y
        rel = resid / y
        res = {"coef": dict(zip(names, (float(v) for v in x))),
               "rel_residual": float(np.linalg.norm(resid) / np.linalg.norm(y)),
               "rms_rel_err": float(np.sqrt(np.mean(rel ** 2))), "max_rel_err": float(np.abs(rel).max()),
               "rmse_ms": float(np.linalg.norm(resid) / math.sqrt(r.shape[0]))}
        if held_out_rows is not None and len(held_out_rows):
            h = np.asarray(held_out_rows, dtype=np.float64)
            pred = _columns(h, reads, layer_terms) @ x
            err = (pred - h[:, 4]) / np.maximum(h[:, 4], 1e-12)
            res.update(held_out_rel_err=err.tolist(), held_out_max_rel_err=float(np.abs(err).max()),
                       held_out_pred_ms=pred.tolist())
        out[form] = res
    if noise_rows is not None and len(noise_rows):
        nz = np.asarray(noise_rows, dtype=np.float64)
        out["noise_floor"] = float(np.linalg.norm(nz[:, 0] - nz[:, 1]) / np.linalg.norm(nz[:, 0]))
    return out


def profile_from_fit(fit: dict, *, name: str, expert_bytes: int, reference_layers: int = REFERENCE_LAYERS,
                     like: CostModel | None = None) -> CostModel:
    """The new form's fit as a :class:`CostModel` for the target's ``reference_layers`` (module docstring).

    Raises
    ------
    SpecFitInputError
        If the fit has no new form, or a fitted term gives a cycle of no time.
    """
    c = fit["new"]["coef"]
    R = check_positive_int("reference_layers", reference_layers)
    fixed = c["a_ms"] + c.get("b_ms_per_layer", 0.0) * R
    per_node = c["c_ms_per_node"] + c.get("p_ms_per_layer_node", 0.0) * R
    read, copy = c["read_ms"], c["per_expert_ms"]
    extra = {} if like is None else dict(num_experts=like.num_experts, draft_level_ms=like.draft_level_ms,
                                         host_level_ms=like.host_level_ms, experts_per_token=like.experts_per_token)
    return CostModel(fixed, per_node, copy, name=name, read_ms=read, reference_layers=R, expert_bytes=expert_bytes,
                     memory_gb_per_s=expert_bytes / (read * 1e6) if read > 0 else None,
                     link_gb_per_s=expert_bytes / (copy * 1e6) if copy > 0 else None, **extra)


def profile_json(cost: CostModel, **about) -> dict:
    """The profile file ``specfit eval --profile FILE`` reads (:func:`specfit.core.cost.load_profile`)."""
    out = {"name": cost.name, **cost.to_json(), "read_ms": cost.read_ms, "reference_layers": cost.reference_layers,
           "num_experts": cost.num_experts, "experts_per_token": cost.experts_per_token, "draft_level_ms": cost.draft_level_ms, "host_level_ms": cost.host_level_ms,
           "expert_bytes": cost.expert_bytes, "memory_gb_per_s": cost.memory_gb_per_s,
           "link_gb_per_s": cost.link_gb_per_s}
    out = {k: v for k, v in out.items() if v is not None}
    if about:
        out["about"] = about
    return out


def _forward(model, tokens, parents) -> tuple[float, int, int]:
    """One timed verify: ``(ms, experts read, experts copied)``, the counts from the expert cache's counters.

    On CUDA the ms are wall-clock between two device synchronisations; on the CPU they are the CPU time of
    this thread (``time.thread_time``; torch runs its CPU operators in the calling thread with one thread),
    which other processes' load does not stretch, unlike the wall clock (memory-bandwidth contention still
    does)."""
    import torch

    cuda = model.device.type == "cuda"
    clock = time.perf_counter if cuda else time.thread_time
    before = model.cache.stats()["layers"]
    if cuda:
        torch.cuda.synchronize(model.device)
    t0 = clock()
    model.verify(tokens, parents)
    if cuda:
        torch.cuda.synchronize(model.device)
    ms = (clock() - t0) * 1e3
    after = model.cache.stats()["layers"]
    reads = sum((a["hits"] + a["misses"]) - (b["hits"] + b["misses"]) for a, b in zip(after, before))
    copies = sum(a["misses"] - b["misses"] for a, b in zip(after, before))
    return ms, int(reads), int(copies)


def measure(model, *, sizes=SIZES + HELD_OUT, slots=(0, "part", "all"), repeats: int = 3, seed: int = 0,
            prefix_len: int = 16, warmup: int = 1, log=None) -> list[dict]:
    """Measure verifies of EAGLE-like trees of each size at each cache size, ``repeats`` identical forwards each.

    The forwards run in rounds: ``warmup`` rounds (not recorded; first-call costs such as buffers the
    runtime allocates per tree size), then ``repeats`` rounds, each one forward of every (cache size, tree
    size) configuration in that order, so a drift of the machine's load spreads over every configuration.
    Before each forward the KV prefix is rebuilt (``prefix_len`` tokens) and the cache brought to its
    state: ``0`` and ``"part"`` (half the experts of a layer) rebuilt empty, ``"part"`` then warmed by one
    verify of a fixed other tree; ``"all"`` loaded once per round. Returns one dict per configuration:
    ``L``, ``n``, ``slots``, ``u`` and ``m`` (experts read and copied, summed over layers; the same in
    every repeat, else the configuration is dropped), ``ms`` (each repeat, in round order), ``median_ms``
    and ``spread`` (RMS of ``ms / median_ms - 1``: this configuration's own noise).

    Raises
    ------
    SpecFitInputError
        If ``repeats`` < 1 or ``warmup`` < 0.
    """
    import torch

    from specfit.eval.runtime_bench import eagle_like_tree

    check_positive_int("repeats", repeats)
    if int(warmup) != warmup or warmup < 0:
        raise SpecFitInputError("warmup", f"must be an integer >= 0, got {warmup!r}")
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    rng = np.random.default_rng(seed)
    V, E = model.spec.vocab_size, model.spec.num_experts
    L = len(model.spec.moe_layers)
    prefix = torch.as_tensor(rng.integers(0, V, prefix_len))
    warm_tokens, warm_parents = torch.as_tensor(rng.integers(0, V, 16)), eagle_like_tree(16, rng)
    trees = {n: (torch.as_tensor(rng.integers(0, V, n)), eagle_like_tree(n, rng)) for n in sizes}
    runs: dict[tuple, list] = {(s, n): [] for s in slots for n in sizes}
    for rnd in range(warmup + repeats):
        log(f"cost_fit: L={L} round {rnd + 1}/{warmup + repeats}" + (" (warm-up)" if rnd < warmup else ""))
        for s in slots:
            k = E // 2 if s == "part" else s
            if s == "all":
                model.reset_cache("all")
            for n in sizes:
                if s != "all":
                    model.reset_cache(k)
                model.reset()
                model.prefill(prefix)
                if s == "part":
                    model.verify(warm_tokens, warm_parents)
                run = _forward(model, *trees[n])
                if rnd >= warmup:
                    runs[(s, n)].append(run)
    out = []
    for (s, n), rs in runs.items():
        if len({(u, m) for _, u, m in rs}) != 1:
            continue
        ms = [t for t, _, _ in rs]
        med = statistics.median(ms)
        out.append({"L": L, "n": n, "slots": s, "u": rs[0][1], "m": rs[0][2], "ms": ms, "median_ms": med,
                    "spread": math.sqrt(statistics.fmean((t / med - 1) ** 2 for t in ms)) if med > 0 else 0.0})
    return out


#: Rows (tokens) at which :func:`dense_rows_ms` times the dense matmuls.
DENSE_ROWS = (1, 2, 3, 4, 8, 16, 32, 64)


def dense_rows_ms(spec, device, dtype, *, rows=DENSE_ROWS, repeats: int = 5, seed: int = 0) -> dict:
    """Time the forward's dense matmuls (``F.linear``) at each token count: how the per-node cost grows.

    The model form prices every node alike (``per_node_ms``); a backend whose few-row matmuls cost one pass
    over the weights per row (a CPU BLAS below its blocked kernel) makes the first nodes dearer than the
    rest, which no per-node constant follows. This measures it on random weights of the model's shapes:
    one decoder layer's ``qkv`` (``(Hq + 2 Hkv) d x H``) and ``o_proj`` (``H x Hq d``), and the
    ``lm_head`` (``V x H``), each timed like :func:`_forward` (thread CPU time on the CPU, synchronised
    wall time on CUDA), median of ``repeats`` after one unrecorded call.

    Returns
    -------
    dict
        ``{"layer_qkv_o_proj": {rows: ms}, "lm_head": {rows: ms}}`` (rows as str keys, for JSON).
    """
    import torch
    import torch.nn.functional as F

    check_positive_int("repeats", repeats)
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.thread_time
    g = torch.Generator().manual_seed(seed)
    H, d = spec.hidden_size, spec.head_dim
    mk = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(device=device, dtype=dtype)
    qkv, o_proj, head = mk((spec.num_heads + 2 * spec.num_kv_heads) * d, H), mk(H, spec.num_heads * d), mk(spec.vocab_size, H)

    def timed(f) -> float:
        f()
        ts = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = clock()
            f()
            if cuda:
                torch.cuda.synchronize(device)
            ts.append((clock() - t0) * 1e3)
        return statistics.median(ts)

    out = {"layer_qkv_o_proj": {}, "lm_head": {}}
    with torch.inference_mode():
        for n in rows:
            x, a = mk(n, H), mk(n, spec.num_heads * d)
            out["layer_qkv_o_proj"][str(n)] = timed(lambda: (F.linear(x, qkv), F.linear(a, o_proj)))
            out["lm_head"][str(n)] = timed(lambda: F.linear(x, head))
    return out


def _rows(records: list[dict], sizes) -> list[tuple]:
    return [(r["L"], r["n"], r["u"], r["m"], r["median_ms"]) for r in records if r["n"] in sizes]


def format_report(fit: dict, records: list[dict], dense: dict | None = None) -> str:
    """Markdown: both forms' residuals and held-out errors, the noise floor, measured vs modeled ms and,
    with ``dense`` (:func:`dense_rows_ms`), the dense matmuls' ms by rows."""
    new, old = fit["new"], fit["three_term"]
    lines = ["| form | rel. residual ||r||/||y|| | RMS rel. error | held-out max rel. error | held out within 10% "
             "| coefficients (ms) |", "|---|---:|---:|---:|---:|---|"]
    for label, f in (("new: + read_ms per expert read", new), ("three-term (resident expert free)", old)):
        coef = ", ".join(f"{k} {v:.4g}" for k, v in f["coef"].items())
        ho = f.get("held_out_rel_err", [])
        lines.append(f"| {label} | {f['rel_residual']:.3f} | {f['rms_rel_err']:.3f} | "
                     f"{f.get('held_out_max_rel_err', float('nan')):.3f} | {sum(abs(e) <= 0.10 for e in ho)} of {len(ho)} | {coef} |")
    one = all(len(r.get("ms", ())) < 2 for r in records)  # --repeats 1: no repeats to measure noise from
    floor = "n/a (one forward per configuration)" if one else f"{fit.get('noise_floor', float('nan')):.3f}"
    lines.append(f"\nnoise floor (single forwards against the median of their identical repeats): "
                 f"{floor}; {fit['records']} fitted configurations, "
                 f"layer counts {fit['layer_counts']}, {fit.get('weighting', 'absolute')} weighting")
    lines += ["", "| L | n | slots | experts read | copied | measured ms (median) | spread | new form ms | three-term ms "
              "| held out |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    layer_terms = len(fit["layer_counts"]) > 1
    for r in records:
        row = np.array([[r["L"], r["n"], r["u"], r["m"], r["median_ms"]]], dtype=np.float64)
        pn = float((_columns(row, True, layer_terms) @ np.array(list(new["coef"].values())))[0])
        po = float((_columns(row, False, layer_terms) @ np.array(list(old["coef"].values())))[0])
        spread = "" if "spread" not in r else "n/a" if one else f"{r['spread']:.3f}"
        lines.append(f"| {r['L']} | {r['n']} | {r['slots']} | {r['u']} | {r['m']} | {r['median_ms']:.1f} | {spread} | "
                     f"{pn:.1f} | {po:.1f} | {'yes' if r['n'] in HELD_OUT else ''} |")
    if dense:
        lines.append("\ndense matmuls by rows (ms, one layer's qkv + o_proj | lm_head): " + ", ".join(
            f"{k}: {v:.2f} | {dense['lm_head'][k]:.2f}" for k, v in dense["layer_qkv_o_proj"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Qwen3-MoE checkpoint directory (one layer count: its own)")
    src.add_argument("--synthetic", help="write and use a random checkpoint of this runtime_bench shape")
    ap.add_argument("--layers", default="1", help="decoder layer counts of the synthetic checkpoint, e.g. 1,2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3, help="recorded rounds: forwards of each configuration")
    ap.add_argument("--warmup", type=int, default=1, help="unrecorded rounds before them")
    ap.add_argument("--weighting", choices=WEIGHTINGS, default="relative",
                    help="NNLS rows divided by their ms (relative, the default) or in ms (absolute)")
    ap.add_argument("--in-memory", action="store_true",
                    help="with --synthetic: build the random model in memory (runtime_bench.synthetic_model: every layer "
                         "shares one layer's host experts) instead of writing and loading a checkpoint")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--name", default="measured", help="the profile's name")
    ap.add_argument("--like", default=None, help="datasheet profile for draft_level_ms, host_level_ms, num_experts "
                                                  "(specfit eval needs draft_level_ms); 'auto': the device's own "
                                                  "(e.g. qwen3-30b-a3b-h100 on an H100; else qwen3-30b-a3b-h200)")
    ap.add_argument("--reference-layers", type=int, default=REFERENCE_LAYERS)
    ap.add_argument("--json", default=None, help="write the profile (for specfit eval --profile) to this file")
    ap.add_argument("--report", default=None, help="also write the measurements and the fit to this JSON file")
    args = ap.parse_args(argv)
    try:
        import torch

        from specfit.eval.machine import command_line, machine
        from specfit.eval.runtime_bench import synthetic_model, write_synthetic_checkpoint
        from specfit.models.devices import resolve_device
        from specfit.models.qwen3_moe import OffloadedQwen3Moe

        check_positive_int("--repeats", args.repeats)  # before the checkpoint is written and loaded
        if args.warmup < 0:
            raise SpecFitInputError("--warmup", f"must be >= 0, got {args.warmup}")
        torch.set_num_threads(args.threads)
        device = resolve_device(args.device)
        layer_counts = [check_positive_int("--layers", int(x)) for x in str(args.layers).split(",")] if args.synthetic else [None]
        like_name = (datasheet_profile(torch.cuda.get_device_name(device) if device.type == "cuda" else "")
                     if args.like == "auto" else args.like)
        like = get_profile(like_name) if like_name else None
        records, expert_bytes, dense, t0 = [], None, None, time.perf_counter()
        if args.in_memory and not args.synthetic:
            raise SpecFitInputError("--in-memory", "needs --synthetic (a checkpoint is loaded as it is)")
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        for L in layer_counts:
            if args.in_memory:
                model = synthetic_model(args.synthetic, L, device, dtype, cache_slots=0, max_len=256)
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    model_dir = args.model or write_synthetic_checkpoint(Path(tmp) / "ckpt", args.synthetic, L, dtype=dtype)
                    model = OffloadedQwen3Moe.from_pretrained(model_dir, device=device, cache_slots=0, max_len=256)
            # eager forwards at every cache size: with a full cache the static forwards (CUDA graphs on CUDA) would
            # be captured inside timed forwards, and would be other code than the 0 and "part" rows' forwards
            model.decode_graph = "off"
            expert_bytes = model.store.expert_bytes
            records += measure(model, repeats=args.repeats, warmup=args.warmup)
            if dense is None:
                dense = dense_rows_ms(model.spec, device, model.dtype)
            del model
        fit = fit_forms(_rows(records, SIZES), _rows(records, HELD_OUT),
                        [(t, r["median_ms"]) for r in records for t in r["ms"]], weighting=args.weighting)
        cost = profile_from_fit(fit, name=args.name, expert_bytes=expert_bytes, reference_layers=args.reference_layers,
                                like=like)
        about = {"source": "specfit.eval.cost_fit", "command": command_line("specfit.eval.cost_fit", argv),
                 "machine": machine(device=device), "layer_counts": fit["layer_counts"],
                 "fixed_and_per_node": ("extrapolated to reference_layers" if len(fit["layer_counts"]) > 1 else
                                        f"the measured {fit['layer_counts'][0]}-layer forward's (one layer count)"),
                 "weighting": args.weighting, "draft_and_host_from": args.like, "measured_s": round(time.perf_counter() - t0, 1)}
        prof = profile_json(cost, **about)
        print(dumps(about["machine"]))
        print(format_report(fit, records, dense))
        print(dumps(prof, indent=1))
        from specfit.core.io import atomic_write_text

        if args.json:
            atomic_write_text(Path(args.json), dumps(prof, indent=1) + "\n")
        if args.report:
            atomic_write_text(Path(args.report), dumps({"fit": fit, "records": records, "dense_rows_ms": dense, "profile": prof},
                                                               indent=1) + "\n")
    except (OSError, ValueError) as e:  # SpecFitInputError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
