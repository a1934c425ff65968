"""The ``specfit`` command: parse arguments, call the library, print. No logic of its own.

Every subcommand is a pair ``_add_<name>(subparsers)`` / ``_run_<name>(args) -> int``, registered in
``_COMMANDS``. Heavy imports (torch, transformers) happen inside ``_run_*`` so that ``specfit solve``
starts fast. Every error is one line on stderr: bad input (:class:`~specfit.core.errors.SpecFitInputError`,
argparse's own errors, unreadable or unwritable files) exits 2, Ctrl-C exits 130. An argument's
``dest`` is the library's field name, so an error on field ``cache_slots`` prints as ``--cache-slots``
(:func:`_flag_names`): the flag on the command line, the field name in the API.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

from specfit.core.errors import SpecFitInputError, check_positive_int
from specfit.core.io import FLOAT_DIGITS, dumps

#: What the top-level ``specfit --help`` says about the program.
DESCRIPTION = ("SpecFit: throughput-optimal speculative decoding for Mixture-of-Experts models whose experts are "
               "offloaded to host memory.")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``specfit <command>: error: <message>`` and exit 2, no usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_solve(sub) -> None:
    p = sub.add_parser("solve", help="select the verified subtree of one instance (SPECFIT.md §4)",
                       description="Read one instance JSON and print the selected subtree.")
    p.add_argument("instance", help="instance JSON file (SPECFIT.md §4)")
    from specfit.solvers import available_solvers

    p.add_argument("--solver", default="exact", help=f"solver: {', '.join(available_solvers())} (default exact)")
    p.add_argument("--max-nodes", type=int, default=None,
                   help="override the instance's max_nodes budget (an integer >= 1: the root is always verified)")
    p.add_argument("--rate", type=float, default=None,
                   help="rate mode: maximise A - rate*T with rate in tokens/s (default: ratio mode, max A/T)")
    p.add_argument("--time-limit", dest="time_limit_s", metavar="SECONDS", type=float, default=None,
                   help="time limit in seconds, for the solvers that take one (cpsat; exact on budgeted instances); "
                        "other solvers refuse it")
    p.add_argument("--json", action="store_true", help="print the selection as one JSON object")


def _run_solve(args) -> int:
    from specfit import load_instance, select

    sel = select(load_instance(args.instance), solver=args.solver, max_nodes=args.max_nodes, rate=args.rate,
                 time_limit_s=args.time_limit_s)
    if args.json:
        print(dumps(_selection_json(sel), digits=FLOAT_DIGITS))
    else:
        print(f"solver      {sel.solver} ({sel.status})")
        print(f"nodes       {list(sel.nodes)}")
        print(f"expected    {sel.expected_tokens:.4f} tokens/cycle")
        print(f"predicted   {sel.predicted_ms:.4f} ms/cycle")
        print(f"throughput  {sel.throughput:.3f} tokens/s")
        print(f"solve time  {sel.solve_ms:.3f} ms")
    return 0


def _selection_json(sel) -> dict:
    """What ``specfit solve --json`` prints: the selection JSON object (SPECFIT.md §4) with ``solve_ms``, a
    measured time, to the resolution of the timer that measured it (``time.perf_counter``: 1 ns on Linux,
    6 decimals of a ms); ``dumps(..., digits=FLOAT_DIGITS)`` then prints the computed floats (A, T,
    throughput, rate) without binary round-off, within 5e-15 of the solver's values."""
    import math
    import time

    out = sel.to_json()
    if isinstance(out.get("solve_ms"), float):
        resolution_ms = time.get_clock_info("perf_counter").resolution * 1e3
        out["solve_ms"] = round(out["solve_ms"], max(0, round(-math.log10(resolution_ms))))
    return out


#: --prefetch's help (generate and eval).
_PREFETCH_HELP = ("copy the root's predicted experts into the expert cache while the draft head runs, in drafted "
                  "cycles (timing only, never outputs; modeled: free while the copies fit the head forwards, the "
                  "rest charged)")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="decode one prompt with any method on the offloaded Qwen3-MoE runtime",
                       description="Greedy decoding of a Qwen3-MoE checkpoint whose experts stay in host memory "
                                   "behind a device expert cache: plain AR decoding, or speculative decoding with an "
                                   "EAGLE-3 head (--draft) and any method. Prints the text, the new token ids, τ, "
                                   "each cycle's decision and the expert-cache counters.")
    p.add_argument("--model", dest="target_dir", metavar="DIR", default=None,
                   help="Qwen3-MoE checkpoint directory (config.json + safetensors; default: the shipped proxy)")
    p.add_argument("--draft", dest="draft_dir", metavar="DIR", default=None,
                   help="EAGLE-3 head directory, or a shipped proxy head: lite or strong (default: none, AR only)")
    p.add_argument("--method", default=None,
                   help="ar, eagle3-vanilla, eagle3, eagle3-scan, specfit or oracle (default: specfit with --draft, "
                        "ar without)")
    p.add_argument("--profile", default=None,
                   help="hardware profile the selection prices cycles with, with --draft (default qwen3-30b-a3b-pcie4; "
                        "also qwen3-30b-a3b-h200)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer in --model)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated (e.g. 1,2,3)")
    p.add_argument("--max-new-tokens", type=int, required=True,
                   help="tokens to generate, >= 1; the prompt plus these must fit in the model's max_position_embeddings")
    p.add_argument("--cache-slots", default=None,
                   help="device expert-cache slots per MoE layer: an integer (0 = transfer every needed expert "
                        "each forward) or 'all' (default 0)")
    p.add_argument("--gpu-memory", dest="gpu_memory_bytes", default=None,
                   help="device memory budget, e.g. 20GiB; sets the slots instead")
    p.add_argument("--eviction", default="lru", choices=["lru", "lfu", "lookahead", "lookahead-lfu"], help="expert-cache eviction policy (lookahead: the draft tree's predicted demand, LRU ties)")
    p.add_argument("--device", default="cpu", help="compute device: cpu, cuda, cuda:1 (default cpu)")
    _add_dtype(p)
    _add_offload(p)
    p.add_argument("--prefetch", action="store_true", help=_PREFETCH_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object (every cycle's record included)")
    p.add_argument("--warm-start", default=None, metavar="PATH",
                   help="start from what the engine learned in a previous run: its folder (learned.json) or a "
                        "learned.json file; refused when the model, head, profile or settings differ")
    p.add_argument("--save-learned", default=None, metavar="FILE",
                   help="write what the engine learned (the warm start, with this run's generation) to the "
                        "learned.json FILE, atomically; a later --warm-start FILE starts from it (needs --draft)")


def _check_save_learned(path: str) -> None:
    """Refuse a ``--save-learned`` path that cannot become a file, before any weights are read."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise SpecFitInputError("save_learned", f"{p} is a folder; name a file (e.g. {p / 'learned.json'})")
    if not p.parent.is_dir():
        raise SpecFitInputError("save_learned", f"the folder {p.parent} does not exist")


def _add_dtype(p) -> None:
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="dtype of the target and the draft head (default: float32 on the CPU, bfloat16 on CUDA; in bfloat16 greedy "
                        "output can change where two tokens' logits tie within rounding)")


def _add_offload(p) -> None:
    p.add_argument("--offload", default="transfer", choices=["transfer", "host", "auto"],
                   help="uncached experts: 'transfer' copies them host-to-device into the expert cache (default); "
                        "'host' computes them on the CPU, the cache holding a static hot set from the routing trace; "
                        "'auto' starts from that hot set and, per layer, copies or host-computes each uncached "
                        "expert, whichever the host-regime profile says is faster")


#: What each cycle decision of :class:`specfit.engine.CycleRecord` means, for ``specfit generate``'s legend.
_DECISIONS = {
    "draft": "drafted a tree and verified the selected subtree in one target forward",
    "ar": "a plain AR step: one token, no draft",
    "shadow": "an AR step that drafted and selected a tree without verifying it, to learn whether drafting pays",
    "explore": "drafted to measure again whether drafting beats AR steps",
}


def _shown_text(text: str | None) -> str:
    """The generated text as ``specfit generate`` prints it above its counters: without the blank lines it
    starts with. The new tokens often begin with a line break (the proxy continues ``Question: 2 + 3 = ?``
    with ``\\nAnswer: ...``), which would print as an empty first line; ``output_ids`` and ``--json`` keep
    it. None (no tokenizer) or only blank lines: ``""``, nothing is printed."""
    if text is None:
        return ""
    return re.sub(r"\A(?:[ \t\r]*\n)+", "", text)


def _run_generate(args) -> int:
    from specfit import SpecFit

    prompt = args.prompt
    if args.prompt_ids is not None:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise SpecFitInputError("prompt_ids", f"must be comma-separated integers, got {args.prompt_ids!r}") from None
        if not prompt:
            raise SpecFitInputError("prompt_ids", "must contain at least one token")
    check_positive_int("max_new_tokens", args.max_new_tokens)  # before the weights are read
    if args.draft_dir is None and args.method not in (None, "ar"):
        from specfit.engine.decoder import METHODS

        if args.method not in METHODS:
            raise SpecFitInputError("method", f"unknown method {args.method!r}; known: {', '.join(sorted(METHODS))}")
        raise SpecFitInputError("method", f"{args.method!r} drafts: it needs a head, add --draft DIR (or lite, strong)")
    if args.draft_dir is None and args.profile is not None:
        raise SpecFitInputError("profile", "prices the selection of draft trees: it needs --draft")
    if args.save_learned is not None:
        from specfit.engine.decoder import METHODS

        if args.draft_dir is None:
            raise SpecFitInputError("save_learned", "AR decoding learns nothing to save: it needs --draft")
        if args.method in METHODS and not METHODS[args.method].calibrated:
            raise SpecFitInputError("save_learned", f"--method {args.method} learns nothing to save "
                                                    "(specfit and oracle do)")
        _check_save_learned(args.save_learned)
    target, load = args.target_dir, {}
    if target is None:
        from specfit.models.proxy import paths

        target = str(paths()["target"])
    if args.draft_dir is not None:
        from specfit.core.cost import DEFAULT_PROFILE
        from specfit.models.proxy import head_dir

        load = {"draft_dir": str(head_dir(args.draft_dir)), "profile": args.profile or DEFAULT_PROFILE}
    method = args.method or ("specfit" if args.draft_dir is not None else "ar")
    model = SpecFit.from_pretrained(target, cache_slots=args.cache_slots, gpu_memory_bytes=args.gpu_memory_bytes,
                                    eviction=args.eviction, device=args.device, dtype=args.dtype, offload=args.offload,
                                    **load)
    if args.warm_start is not None:
        from specfit.engine import learned

        model.load_learned(args.warm_start, expect=learned.key_to_json(model.online_key(method)))
    try:
        extra = {"prefetch": True} if args.prefetch else {}  # off: the API's default
        rep = model.generate(prompt, method=method, max_new_tokens=args.max_new_tokens, **extra).to_json()
    except SpecFitInputError as exc:  # the API's one ``prompt`` field is --prompt or --prompt-ids here
        if exc.field == "prompt" and args.prompt_ids is not None:
            raise SpecFitInputError("prompt_ids", exc.rule) from None
        raise
    if args.save_learned is not None:
        model.save_learned(args.save_learned)
    if args.json:
        print(dumps(rep))
        return 0
    text = _shown_text(rep["text"])
    if text:
        print(text)
    tot = rep["stats"]["total"]
    print(f"output_ids  {rep['output_ids']}")
    decisions = [c["decision"] for c in rep["cycles"]]
    counts = ", ".join(f"{decisions.count(d)} {d}" for d in dict.fromkeys(decisions))
    print(f"method      {rep['method']}: τ {rep['tau']:.2f} tokens per cycle over {len(decisions)} cycles ({counts})")
    print("cycles      " + " ".join(f"{c['decision']}:{c['committed']}" for c in rep["cycles"])
          + "  (decision:committed tokens)")
    for d in dict.fromkeys(decisions):
        print(f"  {d:<9} {_DECISIONS.get(d, '')}")
    if args.offload == "transfer":
        print(f"experts     {tot['hits']} hits, {tot['misses']} misses (hit rate {tot['hit_rate']:.3f}), "
              f"{tot['bytes_moved']} bytes moved in {tot['transfer_ms']:.2f} ms; slots/layer {rep['stats']['slots']}")
    else:  # the uncached experts were copied (auto) or computed on the host
        print(f"experts     {tot['hits']} hits, {tot['misses']} copied H2D ({tot['bytes_moved']} bytes in "
              f"{tot['transfer_ms']:.2f} ms), {tot['host_computed']} computed on the host ({tot['host_rows']} token rows); "
              f"hit rate {tot['hit_rate']:.3f} of all three; slots/layer {rep['stats']['slots']}")
    return 0


def _add_compare_solvers(sub) -> None:
    p = sub.add_parser("compare-solvers", help="compare solvers on generated or stored instances (gap, agreement, time)",
                       description="Run solvers on the same instances and report the optimality gap against exact, "
                                   "agreement, median and p99 solve time; writes markdown, JSON and PNG into --out.")
    p.add_argument("--preset", default="qwen3-30b-a3b", help="generator preset: qwen3-30b-a3b (default) or small")
    p.add_argument("--sizes", default="16,32,64,128", help="draft-tree sizes n, comma-separated (default 16,32,64,128)")
    p.add_argument("--count", type=int, default=50, help="instances per size (default 50)")
    p.add_argument("--layers", type=int, help="MoE layers (overrides the preset)")
    p.add_argument("--experts", type=int, help="experts per layer")
    p.add_argument("--top-k", type=int, help="experts per token per layer")
    p.add_argument("--skew", type=float, help="Zipf exponent of expert popularity (0 = uniform)")
    p.add_argument("--sharing", type=float, help="probability a node's expert slot repeats its parent's")
    p.add_argument("--cache-fraction", type=float, help="share of each layer's experts in the expert cache")
    p.add_argument("--cache-policy", choices=["popular", "random"], help="which experts the cache holds")
    p.add_argument("--branch", type=int, help="EAGLE top_k of the generated draft trees")
    p.add_argument("--profile", help="cost profile (default: the preset's)")
    p.add_argument("--host-profile", help="price the instances on this host-compute regime profile instead "
                   "(e.g. qwen3-30b-a3b-pcie4+host-ddr5-5600-2ch)")
    p.add_argument("--max-nodes", type=int,
                   help="max_nodes budget for every instance (an integer >= 1: the root is always verified)")
    p.add_argument("--max-new-experts-per-layer", type=int, help="expert budget for every generated instance")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    p.add_argument("--instances", help="read instance JSON files from this folder instead of generating")
    p.add_argument("--solvers", default="exact,cpsat,eagle,scan,greedy", help="solver names, comma-separated")
    p.add_argument("--rate", type=float, help="rate mode with long-run rate in tokens/s (default: ratio mode)")
    p.add_argument("--time-limit", dest="time_limit_s", metavar="SECONDS", type=float, default=30.0,
                   help="cpsat time limit per instance, s (default 30)")
    p.add_argument("--total-tokens", type=int, default=32, help="eagle's total_tokens (default 32)")
    p.add_argument("--out", default="runs/compare-solvers", help="output folder (default runs/compare-solvers)")
    p.add_argument("--all-cores", action="store_true", help="do not pin the process to one core while timing")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _run_compare_solvers(args) -> int:
    from specfit.eval.compare import compare_solvers, parse_sizes
    from specfit.eval.instances import get_preset, with_options

    names = [s.strip() for s in args.solvers.split(",") if s.strip()]
    spec = with_options(get_preset(args.preset), layers=args.layers, experts=args.experts, top_k=args.top_k,
                        skew=args.skew, sharing=args.sharing, cache_fraction=args.cache_fraction,
                        cache_policy=args.cache_policy, branch=args.branch, profile=args.profile,
                        host_profile=args.host_profile, max_new_experts_per_layer=args.max_new_experts_per_layer)
    options = {"cpsat": {"time_limit_s": args.time_limit_s}, "eagle": {"total_tokens": args.total_tokens}}
    text, paths = compare_solvers(solvers=names, out=args.out, instances_dir=args.instances, spec=spec,
                                  sizes=parse_sizes(args.sizes), count=args.count, seed=args.seed,
                                  max_nodes=args.max_nodes, rate=args.rate,
                                  options={k: v for k, v in options.items() if k in names},
                                  pin_one_core=not args.all_cores, progress=not args.no_progress)
    print(text, end="")
    print(f"wrote {paths['markdown']}, {paths['json']}, {paths['png']}")
    return 0


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="end-to-end evaluation: every method on GSM8K and CNN/DailyMail (the main job)",
                       description="Decode the same prompts with each method on an offloaded MoE target and report "
                                   "τ, wall-clock and modeled tokens/s, speedups, expert transfers, cache hit rate, "
                                   "solver share, equality with AR and task scores. Writes OUT/results.jsonl "
                                   "(resumable), OUT/summary.json, OUT/summary.md and PNG plots.")
    p.add_argument("--dataset", dest="datasets", metavar="DATASET[,...]", default="gsm8k,cnndm",
                   help="comma-separated: gsm8k, cnndm, spec-bench or PATH.jsonl with a 'prompt' per line "
                        "(default gsm8k,cnndm)")
    p.add_argument("--limit", type=int, default=10, help="prompts per dataset (default 10)")
    p.add_argument("--methods", default="ar,eagle3-vanilla,eagle3,specfit",
                   help="comma-separated methods (default ar,eagle3-vanilla,eagle3,specfit; also eagle3-scan, oracle, "
                        "ar+lookahead: AR whose steps draft a lookahead for --eviction lookahead)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="new tokens per prompt, >= 1 (default 64); the longest prompt plus these must fit in the "
                        "model's max_position_embeddings")
    p.add_argument("--cache-slots", default=32,
                   help="expert-cache slots per MoE layer: an integer in [0, experts] or 'all' (default 32); a "
                        "comma-separated list (16,32,64,96,all) runs a sweep into OUT/slots-<S> and writes "
                        "OUT/sweep.md and OUT/crossover.png")
    p.add_argument("--eviction", default="lru", choices=["lru", "lfu", "lookahead", "lookahead-lfu"], help="expert-cache eviction policy (default lru; lookahead: evict the least demand predicted by the draft tree, LRU ties)")
    p.add_argument("--admission", default="all", choices=["all", "accepted"],
                   help="expert-cache admission of a verify's experts: all (default; plain LRU/LFU) or accepted "
                        "(experts copied only for rejected draft nodes are evicted first)")
    p.add_argument("--profile", default="qwen3-30b-a3b-pcie4",
                   help="hardware profile for selection and modeled time (default qwen3-30b-a3b-pcie4; "
                        "also qwen3-30b-a3b-h200)")
    p.add_argument("--model", default=None, help="target checkpoint directory (default: the shipped proxy)")
    p.add_argument("--draft", default=None,
                   help="EAGLE-3 head directory, or a shipped proxy head: lite (default; τ ≈ 2 on GSM8K like public "
                        "Qwen3-30B-A3B heads) or strong (τ ≈ 4.8 on GSM8K with eagle3's 32-node tree)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 = sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus cut of the sampling verifier (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling verifier (default 0)")
    p.add_argument("--total-tokens", type=int, default=32, help="EAGLE tree: draft nodes verified (default 32)")
    p.add_argument("--depth", type=int, default=6, help="EAGLE tree: draft levels (default 6)")
    p.add_argument("--top-k", type=int, default=4, help="EAGLE tree: children per node (default 4)")
    p.add_argument("--predictor", default="frequency", choices=["frequency", "recency", "probe"],
                   help="expert predictor for eagle3-scan/specfit (default frequency)")
    p.add_argument("--predictor-trace", default=None,
                   help="routing trace (.npz) the predictor is built from (default: routing_trace.npz in --model)")
    p.add_argument("--device", default="cpu", help="compute device: cpu, cuda, cuda:1 (default cpu)")
    _add_dtype(p)
    _add_offload(p)
    p.add_argument("--host-profile", default="qwen3-30b-a3b-pcie4+host-ddr5-5600-2ch",
                   help="host-regime profile pricing --offload host/auto runs (modeled; default "
                        "qwen3-30b-a3b-pcie4+host-ddr5-5600-2ch)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the proxy is too small to gain from more; 0 = torch's default)")
    p.add_argument("--clock", choices=("counted", "measured"), default=None,
                   help="price the engine's host work (predictor, tree, solver, bookkeeping) from its counts with the "
                        "profile's host prices (counted: the same command, the same modeled figures on any machine) or "
                        "learn it from this machine's CPU time (measured); default counted on the CPU, measured on CUDA")
    p.add_argument("--out", default=None,
                   help="output folder; a rerun resumes (default: named from the settings, e.g. "
                        "runs/eval-lite-pcie4-32slots, a sweep runs/sweep-lite-pcie4; any other setting that tells "
                        "results apart, e.g. --eviction or --seed, adds -x and a CRC-32 of those off their defaults, "
                        "so such runs never share a folder, while --dataset, --methods and --limit are left out: a "
                        "run that adds them resumes there; config.json in the folder lists the settings)")
    p.add_argument("--warm-start", default=None, metavar="PATH",
                   help="start specfit/oracle from what a previous run learned: its folder (learned.json) or a "
                        "learned.json file (per dataset, or its only set); refused when the model, head, profile "
                        "or settings differ")
    p.add_argument("--prefetch", action="store_true", help=_PREFETCH_HELP)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _run_eval(args) -> int:
    from specfit import evaluate

    try:
        res = evaluate(datasets=args.datasets, limit=args.limit, methods=args.methods,
                       max_new_tokens=args.max_new_tokens, cache_slots=args.cache_slots, eviction=args.eviction,
                       admission=args.admission,
                       profile=args.profile, model=args.model, draft=args.draft, temperature=args.temperature,
                       top_p=args.top_p, seed=args.seed, total_tokens=args.total_tokens, depth=args.depth,
                       top_k=args.top_k, predictor=args.predictor, predictor_trace=args.predictor_trace,
                       device=args.device, dtype=args.dtype, threads=args.threads, offload=args.offload, host_profile=args.host_profile, out=args.out,
                       warm_start=args.warm_start, clock=args.clock, prefetch=args.prefetch,
                       progress=not args.no_progress)
    except KeyboardInterrupt:
        raise _Interrupted("interrupted; rerun the same command to resume") from None
    print(res["table"], end="")
    print(f"wrote {', '.join(str(p) for p in res['paths'].values())} "
          f"({res['ran']} new generations, {res['skipped']} resumed)")
    return 0


_COMMANDS = (    ("solve", _add_solve, _run_solve),
    ("compare-solvers", _add_compare_solvers, _run_compare_solvers),
    ("generate", _add_generate, _run_generate),
    ("eval", _add_eval, _run_eval),
)


class _Interrupted(Exception):
    """Ctrl-C, with what to tell the user."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``specfit`` command with all subcommands."""
    from specfit import __version__

    parser = _Parser(prog="specfit", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"specfit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for _, add, _ in _COMMANDS:
        add(sub)
    return parser


def _flag_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """``dest -> --flag`` of the subcommand that ran: the map from the library's field names to the
    command line. Flags left unset (None) are not in it, so that a field of an input file with the
    same name (``max_nodes`` in an instance JSON) keeps its file name."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: max(a.option_strings, key=len) for a in sub.choices[args.command]._actions
            if a.option_strings and getattr(args, a.dest, None) is not None}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``specfit`` and ``python -m specfit``. Returns the exit code.

    Every error is one stderr line ``specfit <command>: error: <field or flag>: <rule>``: exit 2 for
    bad input and unreadable or unwritable files (a file under ``--out`` is reported as ``--out``),
    130 for Ctrl-C. Third-party warnings (transformers, torch) are silenced: the one line is the
    only one. A closed pipe (``specfit solve ... | head -1``) ends quietly with 141 (128 + SIGPIPE,
    what a process killed by the signal reports), without a message.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    run = {name: fn for name, _, fn in _COMMANDS}[args.command]
    where = f"specfit {args.command}"
    _quiet_third_party()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rc = run(args)
            sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return rc
    except BrokenPipeError:
        _stdout_to_devnull()
        return 141
    except SpecFitInputError as exc:
        field = _flag_names(parser, args).get(exc.field, exc.field)
        print(f"{where}: error: {field}: {exc.rule}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file we could not read or write (permissions, disk full, ...)
        what = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc).splitlines()[0]
        out = getattr(args, "out", None)
        if out and exc.filename and _inside(exc.filename, out):
            what = f"--out: cannot write {exc.filename}: {exc.strerror}"
        print(f"{where}: error: {what}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, _Interrupted) as exc:
        print(f"{where}: {exc if isinstance(exc, _Interrupted) else 'interrupted'}", file=sys.stderr)
        return 130
    except Exception as exc:  # a defect, not the input's fault: still one line (SPECFIT_DEBUG=1 raises it)
        if os.environ.get("SPECFIT_DEBUG"):
            raise
        text = str(exc).splitlines()[0] if str(exc) else ""
        print(f"{where}: internal error: {type(exc).__name__}: {text} (please report it; SPECFIT_DEBUG=1 shows "
              "where)", file=sys.stderr)
        return 1


def _quiet_third_party() -> None:
    """Silence transformers' logger warnings (a prompt longer than the tokenizer's maximum, ...): the
    CLI's output is its own lines. Set before transformers is imported, and on it if it already is."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "transformers" in sys.modules:
        sys.modules["transformers"].logging.set_verbosity_error()


def _stdout_to_devnull() -> None:
    """After a closed pipe: point stdout at /dev/null so that the interpreter's last flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _inside(path, folder) -> bool:
    """True if ``path`` is ``folder`` or lies under it."""
    from pathlib import Path

    try:
        return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))
    except (TypeError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
