"""Benchmark of host (CPU) expert compute: the CPU half of the host-compute offload regime.

In the host-compute regime (llama.cpp ``--n-cpu-moe``, KTransformers, Fiddler arXiv 2402.07033) an
expert that is not in the device expert cache is computed on the CPU from host memory instead of
being copied over PCIe. This benchmark times one Qwen3-30B-A3B-shaped SwiGLU expert (hidden 2048,
intermediate 768; SPECFIT.md §5) on the host for 1, 2, 4, 8 and 16 tokens, in bf16 and fp32, and
the host memory bandwidth (one large copy), then fits the host cost model

    host_ms(k experts, r rows) = fixed_ms + per_expert_ms * k + per_row_ms * r

(``r`` = (token, expert) pairs computed, ``k`` = distinct experts; :func:`specfit.core.cost.calibrate`,
NNLS, with rows in the place of nodes and experts in the place of misses). Each timed batch runs
``k`` different experts so that their weights are read from DRAM, not from the CPU caches.

Usage::

    python -m specfit.eval.host_bench --threads 1 --json host_bench.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from specfit.core.cost import calibrate
from specfit.eval.machine import command_line, machine, publish

#: Qwen3-30B-A3B expert shape (hidden, expert intermediate); SPECFIT.md §5.
HIDDEN, INTERMEDIATE = 2048, 768
#: Tokens per expert timed.
TOKENS = (1, 2, 4, 8, 16)
#: Distinct experts per timed batch (their weights exceed the CPU caches).
BATCHES = (8, 32)


def make_experts(k: int, dtype: torch.dtype, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` random experts in the store layout of :class:`specfit.models.experts.HostExpertStore`:
    gate_up (k, 2I, H) and down (k, H, I)."""
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(k, 2 * intermediate, hidden, generator=g) * 0.02).to(dtype)
    dn = (torch.randn(k, hidden, intermediate, generator=g) * 0.02).to(dtype)
    return gu, dn


def run_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of every expert on the same rows x (n, H); the runtime's expert formula
    (Shazeer 2020, eq. 6): ``down @ (silu(gate @ x) * (up @ x))``. Returns the sum, (n, H)."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        out += F.linear(F.silu(gate) * up, down[e])
    return out


def time_ms(fn, repeats: int) -> float:
    """Median wall-clock ms of ``fn()`` over ``repeats`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Host memory bandwidth of one large copy ``dst.copy_(src)`` (median of ``repeats``).

    Returns
    -------
    dict
        ``bytes``, ``ms``, ``copy_gb_per_s`` (bytes copied / s) and ``read_write_gb_per_s``
        (bytes read + written / s; 1 GB = 1e9 bytes).
    """
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeats)
    return {"bytes": nbytes, "ms": ms, "copy_gb_per_s": nbytes / (ms * 1e6),
            "read_write_gb_per_s": 2 * nbytes / (ms * 1e6)}


def bench_dtype(dtype: torch.dtype, repeats: int, tokens=TOKENS, batches=BATCHES,
                hidden: int = HIDDEN, intermediate: int = INTERMEDIATE) -> dict:
    """Time batches of ``k`` experts on ``n`` tokens and fit the host cost model.

    Returns
    -------
    dict
        ``rows``: [{experts, tokens, ms, ms_per_expert}], ``fit``: {fixed_ms, per_expert_ms,
        per_row_ms, rel_residual}, ``expert_bytes``.
    """
    gu, dn = make_experts(max(batches), dtype, hidden, intermediate)
    rows = []
    for k in batches:
        for n in tokens:
            x = torch.randn(n, hidden).to(dtype)
            ms = time_ms(lambda: run_experts(x, gu[:k], dn[:k]), repeats)
            rows.append({"experts": k, "tokens": n, "ms": ms, "ms_per_expert": ms / k})
    cal = calibrate([r["experts"] * r["tokens"] for r in rows], [[r["experts"]] for r in rows],
                    [r["ms"] for r in rows], name=f"host-{dtype}")
    fit = {"fixed_ms": cal.cost.fixed_ms, "per_expert_ms": cal.cost.per_expert_ms,
           "per_row_ms": cal.cost.per_node_ms, "rel_residual": cal.rel_residual}
    return {"dtype": str(dtype).removeprefix("torch."), "expert_bytes": 3 * hidden * intermediate * dtype.itemsize,
            "rows": rows, "fit": fit}


def format_table(result: dict) -> str:
    """Markdown: ms per expert by dtype and tokens (largest batch), the fits and the bandwidth."""
    lines = ["| dtype | tokens | ms / expert (median) | × 1 token |", "|---|---:|---:|---:|"]
    for d in result["dtypes"]:
        k = max(r["experts"] for r in d["rows"])
        rows = [r for r in d["rows"] if r["experts"] == k]
        base = rows[0]["ms_per_expert"]
        lines += [f"| {d['dtype']} | {r['tokens']} | {r['ms_per_expert']:.3f} | {r['ms_per_expert'] / base:.2f} |"
                  for r in rows]
    lines.append("")
    for d in result["dtypes"]:
        f = d["fit"]
        eff = d["expert_bytes"] / (f["per_expert_ms"] * 1e6) if f["per_expert_ms"] > 0 else float("nan")
        lines.append(f"fit {d['dtype']}: per_expert_ms {f['per_expert_ms']:.4f} (= {eff:.1f} GB/s of weights), "
                     f"per_row_ms {f['per_row_ms']:.4f}, fixed_ms {f['fixed_ms']:.4f}, "
                     f"rel. residual {f['rel_residual']:.3f}")
    b = result["bandwidth"]
    lines.append(f"copy of {b['bytes'] / 1e9:.2f} GB: {b['ms']:.1f} ms = {b['copy_gb_per_s']:.2f} GB/s copied "
                 f"({b['read_write_gb_per_s']:.2f} GB/s read + written)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per point (median; default 5)")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated torch dtypes")
    ap.add_argument("--json", default=None, help="also write the full result to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",")]
    with torch.no_grad():
        result = {"dtypes": [bench_dtype(dt, args.repeats) for dt in dtypes], "bandwidth": copy_bandwidth()}
    result.update(machine=machine(), command=command_line("specfit.eval.host_bench", argv))
    publish(result, format_table(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
