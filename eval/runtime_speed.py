"""Benchmark of the runtime's per-operation overhead on the CPU: dispatched ops and decode speed.

One process, one torch thread, on a Qwen3-MoE checkpoint (default: the shipped proxy, float32):

1. **Dispatched aten ops** of one eager forward (:class:`specfit.models.devices.OpCounter`), for an AR
   step and a 32-node verify, with every expert resident and with 0 slots (every expert transferred),
   in total, per decoder layer (total / L, the embedding and lm_head included) and without views.
2. **Greedy AR decoding speed**, every expert resident: the runtime's ``greedy_generate``, the public API's
   ``SpecFit.generate(method="ar")`` and transformers' ``generate`` on the same checkpoint, run interleaved
   (``--repeats`` rounds, each decodes ``--tokens`` tokens after the same prompt); ms per token (the wall
   time of one call, prefill included, over the new tokens, and the same in the thread's CPU time, which
   other processes' load inflates less), medians, and each runtime's speed as a multiple of transformers'.
   The token ids of all three are checked equal.
3. **Verify over AR step**: the median wall time of a 32-node verify forward (an EAGLE-like tree) over
   that of an AR step, interleaved, every expert resident; again with the verify on the host-routed rounds
   path (``resident_grouped_mm`` off: one product per used slot, what GPUs without the grouped kernel run);
   and where each one's CPU time goes (``torch.profiler``, self time per aten op, :func:`time_breakdown`);
   the least time reading the verify's experts can take here and its expert products' time
   (:func:`verify_parts`).
4. With ``--compile``: what ``torch.compile`` captures of the static AR step
   (:mod:`specfit.models.qwen3_moe.decode_graph`) and what its first call costs (:func:`compile_check`).

Usage::

    python -m specfit.eval.runtime_speed                    # the shipped proxy
    python -m specfit.eval.runtime_speed --model DIR --repeats 15 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from specfit.eval.machine import command_line, machine, publish
from specfit.eval.runtime_bench import eagle_like_tree
from specfit.models.devices import OpCounter
from specfit.models.qwen3_moe import OffloadedQwen3Moe, greedy_generate


def count_ops(model: OffloadedQwen3Moe, prompt: torch.Tensor, verify_nodes: int = 32, seed: int = 0) -> dict:
    """Ops dispatched by one AR step and one ``verify_nodes``-node verify after ``prompt`` (each after a
    warm-up forward of the same shape).

    Returns
    -------
    dict
        ``{"ar_step": {...}, "verify_N": {...}}``, each ``total``, ``views``, ``per_layer`` (total / L),
        ``per_layer_not_views`` and ``top`` (the ten most frequent ops).
    """
    rng = np.random.default_rng(seed)
    parents = eagle_like_tree(verify_nodes, rng)
    tokens = torch.as_tensor(rng.integers(0, model.spec.vocab_size, verify_nodes))
    L = model.spec.num_layers
    out = {}
    with torch.no_grad():
        model.reset()
        model.prefill(prompt)
        for name, fn in (("ar_step", lambda: model.decode(int(prompt[-1]))),
                         (f"verify_{verify_nodes}", lambda: model.verify(tokens, parents))):
            fn()  # warm-up (first-call paths, caches filled)
            with OpCounter() as c:
                fn()
            out[name] = {"total": c.total, "views": c.views, "per_layer": c.total / L,
                         "per_layer_not_views": (c.total - c.views) / L,
                         "top": dict(sorted(c.by_name.items(), key=lambda kv: -kv[1])[:10])}
    return out


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def decode_speed(model_dir: str, prompt: list[int], tokens: int, repeats: int, extra_runs: dict | None = None,
                 compiled: bool = False) -> dict:
    """ms per token of the three greedy decoders (see the module docstring), interleaved, medians.

    ``extra_runs`` maps further decoders' names to callables that return their ``tokens`` greedy token ids
    after ``prompt``; they run in the same rounds and are reported and compared like the three. ``compiled``:
    also the public API with its AR step through ``torch.compile`` (``decode_graph="compiled"``; the warm-up
    round compiles it).

    Returns
    -------
    dict
        ``ms_per_token`` (per decoder, wall), ``speed_vs_transformers`` (transformers' ms / the decoder's ms),
        ``cpu_ms_per_token`` and ``cpu_speed_vs_transformers`` (the same in thread CPU time), ``same_tokens``
        (bool), ``tokens``, ``repeats``.
    """
    from transformers import AutoModelForCausalLM

    from specfit.pipeline import SpecFit

    runtime = OffloadedQwen3Moe.from_pretrained(model_dir, device="cpu", dtype=torch.float32, cache_slots="all",
                                                max_len=len(prompt) + tokens + 8)
    sf = SpecFit.from_pretrained(model_dir, cache_slots="all", dtype=torch.float32, device="cpu",
                                 max_len=len(prompt) + tokens + 80)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    attn = torch.ones_like(ids)

    def run_runtime():
        with torch.no_grad():
            return greedy_generate(runtime, prompt, tokens)

    def run_public():
        out = sf.generate(prompt, method="ar", max_new_tokens=tokens)
        return list(out.output_ids)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=attn, max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    runs = {"runtime greedy_generate": run_runtime, "public SpecFit.generate(method='ar')": run_public,
            "transformers generate": run_hf, **(extra_runs or {})}
    if compiled:
        sf_compiled = SpecFit.from_pretrained(model_dir, cache_slots="all", dtype=torch.float32, device="cpu",
                                              max_len=len(prompt) + tokens + 80)
        sf_compiled.target.decode_graph = "compiled"
        runs["public SpecFit.generate(method='ar'), compiled AR step"] = (
            lambda: list(sf_compiled.generate(prompt, method="ar", max_new_tokens=tokens).output_ids))
    times = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    outputs = {}
    for name, fn in runs.items():  # warm-up
        outputs[name] = fn()
    for _ in range(repeats):
        for name, fn in runs.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.thread_time() - c0)
    ms = {name: _median_ms(t) / tokens for name, t in times.items()}
    cpu_ms = {name: _median_ms(t) / tokens for name, t in cpu.items()}
    ref, cpu_ref = ms["transformers generate"], cpu_ms["transformers generate"]
    same = all(o[:tokens] == outputs["transformers generate"][:tokens] for o in outputs.values())
    return {"ms_per_token": ms, "speed_vs_transformers": {name: ref / v for name, v in ms.items()},
            "cpu_ms_per_token": cpu_ms, "cpu_speed_vs_transformers": {name: cpu_ref / v for name, v in cpu_ms.items()},
            "same_tokens": same, "tokens": tokens, "repeats": repeats,
            "token_counts": {name: len(o) for name, o in outputs.items()}}


def verify_over_ar(model: OffloadedQwen3Moe, prompt: torch.Tensor, nodes: int = 32, repeats: int = 30,
                   seed: int = 0) -> dict:
    """Median wall ms of an AR step and of an ``nodes``-node verify (interleaved, the prefix rolled back
    after each AR step so that both see ``prompt``), and their ratio."""
    rng = np.random.default_rng(seed)
    parents = eagle_like_tree(nodes, rng)
    tokens = torch.as_tensor(rng.integers(0, model.spec.vocab_size, nodes))
    ar, ver = [], []
    with torch.no_grad():
        model.reset()
        model.prefill(prompt)
        P = model.kv_len
        for r in range(repeats + 2):
            t0 = time.perf_counter()
            model.decode(int(prompt[-1]))
            t1 = time.perf_counter()
            model.kv_len = P
            model.verify(tokens, parents)
            t2 = time.perf_counter()
            if r >= 2:
                ar.append(t1 - t0)
                ver.append(t2 - t1)
    a, v = _median_ms(ar), _median_ms(ver)
    return {"ar_step_ms": a, f"verify_{nodes}_ms": v, "ratio": v / a, "repeats": repeats}


def verify_parts(model: OffloadedQwen3Moe, prompt: torch.Tensor, nodes: int = 32, repeats: int = 9,
                 seed: int = 0) -> dict:
    """Two parts of an ``nodes``-node verify's wall time, every expert resident: the least time reading its
    experts' weights can take on this machine, and the time of its expert products alone.

    * Read floor: the bytes of the experts the verify routes to over the measured read bandwidth. Any
      product over an expert's weights does at least one multiply-add per weight element, so the bandwidth
      is measured with ``torch.sum`` over every layer's whole slot tensors (one pass over more bytes than
      the caches hold).
    * Expert products: the two ``grouped_mm`` products per MoE layer that the resident path runs
      (:attr:`OffloadedQwen3Moe.resident_grouped_mm`), replayed with the verify's routing (the same group
      ends) on random rows of the same shape.

    Medians of ``repeats``. The tree and tokens are :func:`verify_over_ar`'s (same ``seed``).

    Returns
    -------
    dict
        ``experts_per_layer`` (mean distinct experts the verify routes to per MoE layer; the AR step's:
        ``top_k``), ``max_rows`` (most token rows routed to one expert), ``expert_bytes`` (bytes of one expert's
        weights), ``read_gb_per_s`` (GB/s, 1 GB = 1e9 bytes), ``verify_read_ms`` and ``ar_read_ms`` (ms: the
        routed experts' bytes over that bandwidth), ``expert_products_ms`` (ms, every layer's products; None where
        the runtime's resident verify does not run ``grouped_mm``: :attr:`OffloadedQwen3Moe.resident_grouped_mm`).

    Raises
    ------
    ValueError
        If not every expert is resident (the slot tensors would not hold every expert in its own slot).
    """
    from specfit.models.qwen3_moe.model import grouped_mm_function

    cache, spec = model.cache, model.spec
    if cache.slots != spec.num_experts:
        raise ValueError(f"verify_parts needs every expert resident, got {cache.slots} slots")
    rng = np.random.default_rng(seed)
    parents = eagle_like_tree(nodes, rng)
    tokens = torch.as_tensor(rng.integers(0, spec.vocab_size, nodes))

    def median_ms(fn):
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return _median_ms(times[1:])

    with torch.no_grad():
        model.reset()
        model.prefill(prompt)
        routing = model.verify(tokens, parents).routing_device  # (n, L, k)
        L, k = routing.shape[1], routing.shape[2]
        per_layer = [torch.bincount(routing[:, l, :].reshape(-1), minlength=cache.slots) for l in range(L)]
        offs = [torch.cumsum(c, 0).to(torch.int32) for c in per_layer]
        weights = [t for pair in zip(cache.gate_up, cache.down) for t in pair]
        total = sum(t.numel() * t.element_size() for t in weights)
        read_ms = median_ms(lambda: [t.sum() for t in weights])
        products_ms = None  # where the resident verify does not run grouped_mm, a replay would time other code
        if model.resident_grouped_mm:
            grouped_mm = grouped_mm_function()
            x = torch.randn(nodes * k, spec.hidden_size, dtype=weights[0].dtype, device=weights[0].device)

            def products():
                for l in range(L):
                    gate, up = grouped_mm(x, cache.gate_up[l].transpose(1, 2), offs=offs[l]).chunk(2, dim=-1)
                    grouped_mm(torch.nn.functional.silu(gate) * up, cache.down[l].transpose(1, 2), offs=offs[l])
            products_ms = median_ms(products)
    used = float(np.mean([int((c > 0).sum()) for c in per_layer]))
    gb_per_s = total / read_ms / 1e6
    expert_bytes = total / (L * cache.slots)
    return {"nodes": nodes, "experts_per_layer": used, "top_k": int(k), "max_rows": int(max(c.max() for c in per_layer)),
            "expert_bytes": int(expert_bytes), "read_gb_per_s": gb_per_s,
            "verify_read_ms": used * L * expert_bytes / gb_per_s / 1e6, "ar_read_ms": k * L * expert_bytes / gb_per_s / 1e6,
            "expert_products_ms": products_ms}


def time_breakdown(model: OffloadedQwen3Moe, prompt: torch.Tensor, nodes: int = 32, repeats: int = 10,
                   seed: int = 0, top: int = 8) -> dict:
    """Where an AR step's and an ``nodes``-node verify's CPU time goes: ``torch.profiler``'s self CPU time per aten
    op over ``repeats`` forwards of each (after a warm-up), as shares of the total, the ``top`` largest.

    Returns
    -------
    dict
        ``{"ar_step": {op: share, ...}, "verify_N": {...}}``, shares in [0, 1] of the profiled self CPU time
        (the profiler's own cost included, so read shares, not times).
    """
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(seed)
    parents = eagle_like_tree(nodes, rng)
    tokens = torch.as_tensor(rng.integers(0, model.spec.vocab_size, nodes))
    out = {}
    with torch.no_grad():
        model.reset()
        model.prefill(prompt)
        P = model.kv_len

        def ar():
            model.decode(int(prompt[-1]))
            model.kv_len = P

        for name, fn in (("ar_step", ar), (f"verify_{nodes}", lambda: model.verify(tokens, parents))):
            fn()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(repeats):
                    fn()
            rows = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
            total = sum(t for _, t in rows) or 1.0
            out[name] = {k: t / total for k, t in sorted(rows, key=lambda kv: -kv[1])[:top]}
    return out


def compile_check(model: OffloadedQwen3Moe, prompt: torch.Tensor, repeats: int = 9) -> dict:
    """What ``torch.compile`` (inductor, ``dynamic=False``) makes of the static AR step
    (:class:`~specfit.models.qwen3_moe.decode_graph.StaticForward` of one row), every expert resident: the graphs and graph
    breaks ``torch._dynamo.explain`` finds, the first compiled call's wall time (the compile), whether the
    compiled logits equal the eager step's bitwise, and the median wall ms of the eager step, the static forward
    and the compiled one (interleaved, the same token and position each time).

    Returns
    -------
    dict
        ``graphs``, ``graph_breaks``, ``break_reasons`` (first line of each, distinct), ``first_call_s``,
        ``bitwise``, ``max_abs_diff``, ``eager_ms``, ``static_ms``, ``compiled_ms``.
    """
    import torch._dynamo as dynamo

    from specfit.models.qwen3_moe.decode_graph import StaticForward

    with torch.no_grad():
        model.reset()
        model.prefill(prompt)
        P = model.kv_len
        ids = torch.tensor([int(prompt[-1])], device=model.device)
        cos, sin = model._cos[P:P + 1], model._sin_signed[P:P + 1]
        mode, model.decode_graph = model.decode_graph, "off"

        def eager():
            model.kv_len = P
            return model._forward(ids, cos, sin, None).logits

        ref = eager()
        graph = StaticForward(model, 1, capture=False)
        graph._inputs[:, 0] = ids
        graph._inputs[:, 1:4] = P  # position, KV row, prefix length
        ex = dynamo.explain(graph.forward)()
        reasons = list(dict.fromkeys(str(b.reason).strip().splitlines()[0] for b in ex.break_reasons))
        dynamo.reset()
        compiled = torch.compile(graph.forward, dynamic=False)
        t0 = time.perf_counter()
        out = compiled()[0]
        first = time.perf_counter() - t0
        times = {"eager": [], "static": [], "compiled": []}
        for _ in range(repeats):
            for name, fn in (("eager", eager), ("static", graph.forward), ("compiled", compiled)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        dynamo.reset()
        model.decode_graph = mode
    return {"graphs": ex.graph_count, "graph_breaks": ex.graph_break_count, "break_reasons": reasons,
            "first_call_s": first, "bitwise": bool(torch.equal(out, ref)),
            "max_abs_diff": float((out - ref).abs().max()),
            **{f"{name}_ms": _median_ms(t) for name, t in times.items()}}


def format_table(result: dict) -> str:
    """Markdown tables of the three measurements."""
    lines = ["| forward | experts | ops | ops / layer | not views / layer |", "|---|---|---:|---:|---:|"]
    for slots, modes in result["ops"].items():
        for mode, c in modes.items():
            lines.append(f"| {mode} | {slots} | {c['total']} | {c['per_layer']:.0f} | {c['per_layer_not_views']:.0f} |")
    d = result["decode"]
    if d["tokens"]:  # --skip-decode: no decoding run
        lines += ["", f"greedy AR decoding, every expert resident, {d['tokens']} tokens, median of {d['repeats']} "
                  f"(token ids equal: {d['same_tokens']})", "",
                  "| decoder | ms / token | tok/s | × transformers | CPU ms / token | × transformers (CPU) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, ms in d["ms_per_token"].items():
            lines.append(f"| {name} | {ms:.3f} | {1e3 / ms:.0f} | {d['speed_vs_transformers'][name]:.2f} | "
                         f"{d['cpu_ms_per_token'][name]:.3f} | {d['cpu_speed_vs_transformers'][name]:.2f} |")
    v = result["verify"]
    key = next(k for k in v if k.startswith("verify_"))
    lines += ["", f"AR step {v['ar_step_ms']:.3f} ms, {key.split('_')[1]}-node verify {v[key]:.3f} ms: "
              f"verify / AR step = {v['ratio']:.2f} (median of {v['repeats']})"]
    for mode, shares in result.get("breakdown", {}).items():
        lines.append(f"{mode} self CPU time: " + ", ".join(f"{k.removeprefix('aten::')} {100 * x:.0f}%"
                                                        for k, x in shares.items()))
    c = result.get("compile")
    if c:
        lines.append(f"torch.compile of the static AR step: {c['graphs']} graphs, {c['graph_breaks']} breaks "
                     f"({'; '.join(c['break_reasons'])}); first call {c['first_call_s']:.1f} s; compiled "
                     f"{c['compiled_ms']:.3f} ms, static {c['static_ms']:.3f} ms, eager step {c['eager_ms']:.3f} ms; "
                     f"logits bitwise the eager step's {c['bitwise']} (max |diff| {c['max_abs_diff']:.2g})")
    f = result.get("verify_parts")
    if f:
        lines.append(f"the {f['nodes']}-node verify routes to {f['experts_per_layer']:.1f} distinct experts per layer (the AR "
                     f"step {f['top_k']}; the busiest expert gets {f['max_rows']} of its token rows), weights "
                     f"{f['expert_bytes'] / 1e3:.0f} KB per expert. Read floor: "
                     f"reading them once at {f['read_gb_per_s']:.1f} GB/s (torch.sum over every slot) takes "
                     f"{f['verify_read_ms']:.3f} ms = {f['verify_read_ms'] / v['ar_step_ms']:.2f} × the AR step "
                     f"({f['ar_read_ms']:.3f} ms for its own). " + (
                         "Its expert products are not replayed: this torch's grouped_mm does not run them"
                         if f["expert_products_ms"] is None else
                         f"Its expert products alone (grouped_mm replayed on its routing): "
                         f"{f['expert_products_ms']:.3f} ms; the rest of the verify {v[key] - f['expert_products_ms']:.3f} "
                         f"ms = {(v[key] - f['expert_products_ms']) / v['ar_step_ms']:.2f} × the AR step"))
    g = v.get("rounds_path")
    if g:
        lines.append(f"the same with the verify on the host-routed rounds path (resident_grouped_mm off): "
                     f"verify {g[key]:.3f} ms, AR step {g['ar_step_ms']:.3f} ms, ratio {g['ratio']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Qwen3-MoE checkpoint directory (default: the shipped proxy)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per generate call")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=9, help="interleaved rounds of the decode-speed comparison")
    ap.add_argument("--verify-repeats", type=int, default=30)
    ap.add_argument("--skip-decode", action="store_true", help="ops and verify / AR only (no transformers run)")
    ap.add_argument("--compile", action="store_true",
                    help="also torch.compile the static AR step (minutes on a CPU) and report what it captures")
    ap.add_argument("--compiled-decode", action="store_true",
                    help="also decode with the public API's AR step through torch.compile (decode_graph='compiled')")
    ap.add_argument("--json", default=None, help="also write the full result to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.model is None:
        from specfit.models.proxy import paths

        args.model = str(paths()["target"])
    rng = np.random.default_rng(0)
    spec_vocab = OffloadedQwen3Moe.from_pretrained(args.model, cache_slots=0, max_len=8).spec.vocab_size
    prompt = rng.integers(1, spec_vocab, args.prompt_len).tolist()
    prompt_t = torch.as_tensor(prompt)
    ops = {}
    for slots in ("all", 0):
        model = OffloadedQwen3Moe.from_pretrained(args.model, device="cpu", dtype=torch.float32, cache_slots=slots,
                                                  max_len=args.prompt_len + 80)
        ops["every expert resident" if slots == "all" else "0 slots"] = count_ops(model, prompt_t)
        if slots == "all":
            verify = verify_over_ar(model, prompt_t, repeats=args.verify_repeats)
            parts = verify_parts(model, prompt_t)
            breakdown = time_breakdown(model, prompt_t)
            compiled = compile_check(model, prompt_t) if args.compile else None
            # for comparison: the host-routed rounds path (one host read of the routing per layer, one
            # product per used slot), what a resident verify runs where grouped_mm is not used
            model.resident_grouped_mm = False
            ops["every expert resident, rounds path"] = {
                k: v for k, v in count_ops(model, prompt_t).items() if k.startswith("verify")}
            verify["rounds_path"] = verify_over_ar(model, prompt_t, repeats=max(3, args.verify_repeats // 3))
            model.resident_grouped_mm = True
        del model
    result = {"ops": ops, "verify": verify, "verify_parts": parts, "breakdown": breakdown, "compile": compiled,
              "model": args.model}
    if not args.skip_decode:
        result["decode"] = decode_speed(args.model, prompt, args.tokens, args.repeats, compiled=args.compiled_decode)
    else:
        result["decode"] = {"ms_per_token": {}, "speed_vs_transformers": {}, "cpu_ms_per_token": {},
                            "cpu_speed_vs_transformers": {}, "same_tokens": None, "tokens": 0, "repeats": 0}
    result.update(machine=machine(device="cpu"), command=command_line("specfit.eval.runtime_speed", argv))
    publish(result, format_table(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
