"""Benchmark of the offloaded Qwen3-MoE runtime: where the time of one forward goes.

For AR decode and for tree verifies of 8, 16, 32 and 64 nodes, reports per forward (medians; with every
expert resident also ``ar_decode_<decode_graph>`` and ``verify_<n>_<decode_graph>``, e.g. ``ar_decode_cuda-graph``:
the forwards as :mod:`specfit.models.qwen3_moe.decode_graph` runs them, whose experts are not timed on their own):
total ms, split into dense compute (attention, norms, routers, lm_head, bookkeeping = total minus
the two others), expert compute and H2D transfer; experts transferred, achieved transfer bandwidth
(GB/s, 1 GB = 1e9 bytes) and ms per transferred expert. It then fits the cycle-time cost model of
SPECFIT.md §3 (``specfit.core.cost.calibrate``, NNLS) to every measured forward.

On CUDA, times come from CUDA events (transfers and expert kernels) and a synchronised wall clock
(total); on the CPU from ``time.perf_counter`` and "H2D" is a host memcpy into the cache slots.

Usage::

    python -m specfit.eval.runtime_bench --synthetic tiny --device cpu
    python -m specfit.eval.runtime_bench --model /path/to/Qwen3-30B-A3B --device cuda --cache-slots 0
    python -m specfit.eval.runtime_bench --synthetic qwen3-30b-a3b --layers 4 --device cuda --json out.json
    python -m specfit.eval.runtime_bench --synthetic qwen3-30b-a3b --in-memory --cache-slots all --device cuda

``--synthetic`` writes a random-weight checkpoint (per-expert layout, one shard per layer) with the
named shape to a temporary directory first (``--in-memory``: builds it in memory instead,
:func:`synthetic_model`); ``qwen3-30b-a3b`` has the real dimensions of
Qwen3-30B-A3B (SPECFIT.md §5) and ``--layers`` decoder layers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from specfit.models.devices import resolve_device
from specfit.models.qwen3_moe import OffloadedQwen3Moe, read_spec
from specfit.models.qwen3_moe.checkpoint import dense_shapes
from specfit.core.io import dumps
from specfit.core.cost import calibrate, datasheet_profile, get_profile
from specfit.core.errors import SpecFitInputError
from specfit.eval.machine import command_line, machine, publish

#: Shapes for ``--synthetic``. ``qwen3-30b-a3b`` is the real model's config (SPECFIT.md §5).
SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4, num_hidden_layers=4),
    "small": dict(vocab_size=4096, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  moe_intermediate_size=192, num_experts=64, num_experts_per_tok=8, num_hidden_layers=4),
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          num_hidden_layers=48, rope_theta=1_000_000.0),
    # Qwen3-30B-A3B's decoder layers and experts with an 8,192-token vocabulary: the cost-model fit
    # (specfit.eval.cost_fit) measures the expert terms without the 151,936-row lm_head dominating a CPU forward
    "qwen3-30b-a3b-experts": dict(vocab_size=8192, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                                  head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                  num_hidden_layers=48, rope_theta=1_000_000.0),
}

TREE_SIZES = (8, 16, 32, 64)


def _synthetic_config(shape: str, num_layers: int | None) -> dict:
    """The ``config.json`` of a synthetic checkpoint of one of the :data:`SHAPES`."""
    cfg = dict(SHAPES[shape], architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", norm_topk_prob=True,
               rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=40960, hidden_act="silu",
               intermediate_size=4 * SHAPES[shape]["hidden_size"])
    cfg.setdefault("rope_theta", 10000.0)
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
    return cfg


def synthetic_model(shape: str, num_layers: int | None = None, device="cpu", dtype: torch.dtype = torch.bfloat16,
                    cache_slots: int | str = 0, max_len: int = 256, seed: int = 0) -> OffloadedQwen3Moe:
    """A random-weight runtime of one of the :data:`SHAPES` built in memory, without a checkpoint (timing
    only, not a model): Qwen3-30B-A3B's 48 layers hold ~58 GB of bfloat16 experts, too much to write to disk
    and read back inside a GPU check.

    Dense weights are drawn on ``device`` as in :func:`write_synthetic_checkpoint`. The host expert store
    holds ONE layer's experts (N(0, 0.02²), page-locked on CUDA) that every MoE layer's store entry shares,
    so host memory is one layer's experts (~1.2 GB at the real shape) while every copy moves a full expert;
    with ``cache_slots="all"`` every layer's slots are filled from it (~58 GB on the device at the real shape).

    Returns
    -------
    OffloadedQwen3Moe
        ``cache_slots`` slots per MoE layer, KV capacity ``max_len``.
    """
    from specfit.models.experts import HostExpertStore
    from specfit.models.qwen3_moe.config import read_spec

    device = resolve_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(dumps(_synthetic_config(shape, num_layers)))
        spec = read_spec(tmp)
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shp in dense_shapes(spec).items():
        if len(shp) == 1:
            t = torch.ones(shp, dtype=dtype, device=device)
        elif name.endswith("mlp.gate.weight"):
            t = torch.nn.functional.normalize(torch.randn(*shp, generator=gen, device=device), dim=-1) * 2.0
        else:
            t = torch.randn(*shp, generator=gen, device=device) * (1.0 if name == "model.embed_tokens.weight" else 0.02)
        weights[name] = t.to(dtype)
    E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    L = len(spec.moe_layers)
    store = HostExpertStore(1, E, H, I, dtype, pin_memory=device.type == "cuda")
    cpu_gen = torch.Generator().manual_seed(seed)
    for e in range(E):  # expert by expert: no float32 copy of the whole layer
        store.gate_up[0][e].copy_(torch.randn(2 * I, H, generator=cpu_gen) * 0.02)
        store.down[0][e].copy_(torch.randn(H, I, generator=cpu_gen) * 0.02)
    store.num_layers, store.gate_up, store.down = L, store.gate_up * L, store.down * L
    return OffloadedQwen3Moe(spec, weights, store, device, dtype, cache_slots=cache_slots, max_len=max_len)


def write_synthetic_checkpoint(out_dir: Path, shape: str, num_layers: int | None = None,
                               dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Write a random Qwen3-MoE checkpoint with one of the :data:`SHAPES` (timing only, not a model).

    Weights are N(0, 0.02²) except embeddings N(0, 1) and router rows of norm 2 (so that routing
    spreads over the experts). Experts are stored per expert, one safetensors shard per layer plus
    ``model.safetensors.index.json``.

    Returns
    -------
    Path
        ``out_dir``.
    """
    cfg = _synthetic_config(shape, num_layers)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(dumps(cfg, indent=1))
    spec = read_spec(out_dir)
    gen = torch.Generator().manual_seed(seed)

    def init(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:                                   # norm weights
            return torch.ones(shape, dtype=dtype)
        if name.endswith("mlp.gate.weight"):                  # router: rows of norm 2
            return (torch.nn.functional.normalize(torch.randn(*shape, generator=gen), dim=-1) * 2.0).to(dtype)
        std = 1.0 if name == "model.embed_tokens.weight" else 0.02
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    H, I = spec.hidden_size, spec.moe_intermediate_size
    shards: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in dense_shapes(spec).items():
        key = f"layer-{int(name.split('.')[2]):03d}" if name.startswith("model.layers.") else "embed"
        shards.setdefault(key, {})[name] = shape
    for i in spec.moe_layers:
        for e in range(spec.num_experts):
            p = f"model.layers.{i}.mlp.experts.{e}."
            shards[f"layer-{i:03d}"].update({p + "gate_proj.weight": (I, H), p + "up_proj.weight": (I, H),
                                             p + "down_proj.weight": (H, I)})
    weight_map = {}
    for key, shapes in shards.items():
        save_file({name: init(name, shape) for name, shape in shapes.items()}, out_dir / f"{key}.safetensors")
        weight_map.update({name: f"{key}.safetensors" for name in shapes})
    (out_dir / "model.safetensors.index.json").write_text(dumps({"metadata": {}, "weight_map": weight_map}))
    return out_dir


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_forward(model: OffloadedQwen3Moe, fn) -> dict:
    """Run ``fn()`` (one forward) and return its time split and transfer counters.

    Returns
    -------
    dict
        ``total_ms, h2d_ms, expert_ms, dense_ms`` (ms), ``experts_moved``, ``bytes_moved``,
        ``misses_per_layer`` (list).
    """
    before = model.cache.stats()
    e0 = model.expert_compute_ms
    _sync(model.device)
    t0 = time.perf_counter()
    fn()
    _sync(model.device)
    total = (time.perf_counter() - t0) * 1e3
    after = model.cache.stats()  # flushes the CUDA event timers
    h2d = after["total"]["transfer_ms"] - before["total"]["transfer_ms"]
    expert = model.expert_compute_ms - e0
    return {"total_ms": total, "h2d_ms": h2d, "expert_ms": expert, "dense_ms": total - h2d - expert,
            "experts_moved": after["total"]["misses"] - before["total"]["misses"],
            "bytes_moved": after["total"]["bytes_moved"] - before["total"]["bytes_moved"],
            "misses_per_layer": [a["misses"] - b["misses"] for a, b in zip(after["layers"], before["layers"])]}


def eagle_like_tree(n: int, rng: np.random.Generator, top_k: int = 4) -> list[int]:
    """Parents of an n-node tree grown breadth-first with up to ``top_k`` children per node."""
    parents, frontier, nxt = [-1], [0], []
    while len(parents) < n:
        for p in frontier:
            for _ in range(int(rng.integers(1, top_k + 1))):
                if len(parents) < n:
                    nxt.append(len(parents))
                    parents.append(p)
        frontier, nxt = nxt, []
    return parents


def summarize(rows: list[dict], expert_bytes: int) -> dict:
    """Medians of :func:`timed_forward` rows plus bandwidth (GB/s) and ms per transferred expert."""
    med = {k: statistics.median(r[k] for r in rows) for k in ("total_ms", "dense_ms", "expert_ms", "h2d_ms",
                                                               "experts_moved")}
    moved = sum(r["experts_moved"] for r in rows)
    h2d = sum(r["h2d_ms"] for r in rows)
    med["gb_per_s"] = moved * expert_bytes / (h2d * 1e6) if h2d > 0 else float("nan")
    med["ms_per_expert"] = h2d / moved if moved else float("nan")
    med["repeats"] = len(rows)
    return med


def run_bench(model: OffloadedQwen3Moe, *, prefix_len: int = 32, repeats: int = 5, seed: int = 0,
              static_verifies: bool = True) -> dict:
    """Measure AR decode and tree verifies of :data:`TREE_SIZES` nodes on ``model``.

    Each mode runs one warm-up forward and ``repeats`` measured ones after a prefill of
    ``prefix_len`` random tokens; verifies are not committed, so every one sees the same prefix. With every
    expert resident and :attr:`~OffloadedQwen3Moe.decode_graph` on, the AR step and (``static_verifies``) the
    verifies are timed as static forwards too.

    Returns
    -------
    dict
        ``{"modes": {name: summary}, "calibration": {...}, "memory": {...}}``.
    """
    rng = np.random.default_rng(seed)
    V, eb = model.spec.vocab_size, model.store.expert_bytes
    model.profile = True
    model.reset()
    model.prefill(torch.as_tensor(rng.integers(0, V, prefix_len)))
    modes, records = {}, []
    decode_rows = []
    for r in range(repeats + 1):
        row = timed_forward(model, lambda: model.decode(int(rng.integers(0, V))))
        if r:
            decode_rows.append(row)
    modes["ar_decode"] = summarize(decode_rows, eb)
    records += [(1, row) for row in decode_rows]
    static = model.decode_graph != "off" and model._full_cache()
    if static:  # the static forwards run only untimed per expert
        model.profile = False
        rows = [timed_forward(model, lambda: model.decode(int(rng.integers(0, V)))) for _ in range(repeats + 1)]
        modes[f"ar_decode_{model.decode_graph}"] = summarize(rows[1:], eb)
        model.profile = True
    for n in TREE_SIZES:
        rows = []
        for r in range(repeats + 1):
            parents = eagle_like_tree(n, rng)
            tokens = torch.as_tensor(rng.integers(0, V, n))
            row = timed_forward(model, lambda: model.verify(tokens, parents))
            if r:
                rows.append(row)
        modes[f"verify_{n}"] = summarize(rows, eb)
        records += [(n, row) for row in rows]
        if static and static_verifies and model.resident_grouped_mm:  # static verifies (n is a VERIFY_SIZES size)
            model.profile = False
            rows = [timed_forward(model, lambda: model.verify(tokens, parents)) for _ in range(repeats + 1)]
            modes[f"verify_{n}_{model.decode_graph}"] = summarize(rows[1:], eb)
            model.profile = True
    cal = calibrate([n for n, _ in records], [row["misses_per_layer"] for _, row in records],
                    [row["total_ms"] for _, row in records], name="measured")
    model.profile = False
    return {"modes": modes, "memory": model.memory(), "expert_bytes": eb, "cache_slots": model.cache.slots,
            "pinned": bool(model.store.gate_up[0].is_pinned()), "dtype": str(model.dtype),
            "grouped_experts": bool(model.grouped_experts and model.cache.grouped),
            "grouped_kernel": bool(model.grouped_experts and model.cache.grouped and model.grouped_kernel),
            "calibration": {"cost": cal.cost.to_json(), "rmse_ms": cal.rmse_ms, "rel_residual": cal.rel_residual,
                            "records": cal.num_records}}


def modeled_ar_step(profile: str, num_moe_layers: int) -> dict | None:
    """The profile's modeled AR step with every expert resident (SPECFIT.md §3: ``fixed_ms + per_node_ms`` + one
    read per routed expert in every MoE layer), when ``num_moe_layers`` is the profile's own layer count (its
    fixed term stands for the whole model, so a slice of it is not compared); else None."""
    cost = get_profile(profile)
    if num_moe_layers != (cost.reference_layers or 0):
        return None
    return {"profile": profile, "ms": cost.cycle_ms(1, np.zeros(num_moe_layers))}


def format_table(result: dict) -> str:
    """A Markdown table of the medians, with each mode's total as a multiple of AR decode (same process)."""
    ar = result["modes"]["ar_decode"]["total_ms"]
    lines = ["| mode | total ms | × AR decode | dense ms | expert ms | H2D ms | experts moved | GB/s | ms/expert |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in result["modes"].items():
        lines.append(f"| {name} | {m['total_ms']:.2f} | {m['total_ms'] / ar:.2f} | {m['dense_ms']:.2f} | "
                     f"{m['expert_ms']:.2f} | {m['h2d_ms']:.2f} | "
                     f"{m['experts_moved']:.0f} | {m['gb_per_s']:.2f} | {m['ms_per_expert']:.4f} |")
    for modeled in result.get("modeled_ar_steps") or []:
        if result.get("cache_slots") != result.get("num_experts"):
            break
        lines.append(f"\nprofile {modeled['profile']} models this AR step (every expert resident) at "
                     f"{modeled['ms']:.2f} ms: " + ", ".join(f"{name} {m['total_ms'] / modeled['ms']:.2f} x"
                                                            for name, m in result["modes"].items()
                                                            if name.startswith("ar_decode")))
    c = result["calibration"]
    how = ("one call per expert" if not result.get("grouped_experts") else
           "each round of a layer's experts together" + (", grouped kernel" if result.get("grouped_kernel") else ""))
    lines.append(f"\nexperts: {how}; {result.get('dtype')}, cache slots {result.get('cache_slots')}")
    lines.append(f"\nfitted cost model (NNLS over {c['records']} forwards, rel. residual {c['rel_residual']:.3f}): "
                 f"{dumps(c['cost'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Qwen3-MoE checkpoint directory")
    src.add_argument("--synthetic", choices=sorted(SHAPES), help="write and use a random checkpoint of this shape")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the synthetic checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache-slots", default="0", help="slots per layer or 'all' (default 0: transfer every expert)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefix-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--pageable", action="store_true", help="do not pin the host expert store (CUDA)")
    ap.add_argument("--per-expert", action="store_true",
                    help="call each expert on its own instead of running each round of a layer's experts together "
                         "(for comparison)")
    ap.add_argument("--in-memory", action="store_true",
                    help="with --synthetic: build the random model in memory (one layer's experts on the host, "
                         "shared by every layer) instead of writing a checkpoint")
    ap.add_argument("--decode-graph", choices=("off", "static", "compiled", "cuda-graph", "compiled-cuda-graph"),
                    default=None,
                    help="with every expert resident, also time the AR step as the static forward ('static'), through "
                         "torch.compile ('compiled'), as a CUDA graph ('cuda-graph', the default on CUDA; 'off' "
                         "elsewhere) or both: mode ar_decode_<this>")
    ap.add_argument("--no-static-verifies", action="store_true",
                    help="with --decode-graph on and every expert resident, time the AR step's static forward only")
    ap.add_argument("--profile", action="append", default=None,
                    help="with every expert resident at the profile's layer count (48), the AR steps as multiples of "
                         "its modeled step; repeatable (default: on CUDA the device's datasheet profile, e.g. "
                         "qwen3-30b-a3b-h100 on an H100, and qwen3-30b-a3b-h200)")
    ap.add_argument("--json", default=None, help="also write the full result to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    slots = int(args.cache_slots) if args.cache_slots.isdigit() else args.cache_slots
    device = resolve_device(args.device)
    profiles = args.profile or dict.fromkeys(
        ([datasheet_profile(torch.cuda.get_device_name(device))] if device.type == "cuda" else [])
        + ["qwen3-30b-a3b-h200"])
    for name in profiles:
        try:
            get_profile(name)
        except SpecFitInputError as exc:
            ap.error(str(exc))
    max_len = args.prefix_len + 2 * (args.repeats + 1) + 80
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if args.in_memory:
        if not args.synthetic:
            ap.error("--in-memory needs --synthetic")
        model = synthetic_model(args.synthetic, args.layers, device, dtype, cache_slots=slots, max_len=max_len)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = args.model or write_synthetic_checkpoint(Path(tmp) / args.synthetic, args.synthetic,
                                                                 args.layers, dtype=dtype)
            model = OffloadedQwen3Moe.from_pretrained(model_dir, device=device, cache_slots=slots,
                                                      pin_memory=False if args.pageable else None, max_len=max_len)
    model.grouped_experts = model.grouped_experts and not args.per_expert
    if args.decode_graph is not None:
        model.decode_graph = args.decode_graph
    result = run_bench(model, prefix_len=args.prefix_len, repeats=args.repeats,
                       static_verifies=not args.no_static_verifies)
    steps = [modeled_ar_step(p, len(model.spec.moe_layers)) for p in profiles]
    result.update(modeled_ar_steps=[s for s in steps if s is not None], num_experts=model.spec.num_experts)
    result.update(machine=machine(device=device), command=command_line("specfit.eval.runtime_bench", argv),
                  source=args.model or f"synthetic:{args.synthetic}" + (" (in memory)" if args.in_memory else ""),
                  layers=model.spec.num_layers)
    publish(result, format_table(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
