"""True-future bounds of the expert cache on the runs of ``specfit eval``: what eviction that knows the future saves.

For an evaluation run folder (``specfit eval ... --out DIR``; a sweep folder's ``slots-<S>`` folders each),
replays the committed tokens of every prompt through the run's expert cache as AR decoding meets them, and
reports, beside what each method of the run measured, the misses (experts transferred host-to-device) per
committed token of these eviction policies on the same tokens and the same cache size:

* ``LRU`` — the run's ``ar`` under the run's cache (``ar`` sets no lookahead demand, so it evicts by LRU
  whatever the ``--eviction``): the replay equals the run's ``ar`` miss for miss (tests/eval/test_cache_bounds.py);
* ``true next h`` — the ``lookahead`` policy (:class:`specfit.models.experts.Lookahead`: least demand, ties by
  LRU) whose demand before forward t is the TRUE experts of the next h committed tokens, token t+j weighted
  ``decay ** j`` (:func:`specfit.eval.lookahead.demand_series`): a lookahead draft that always drafts the real
  next tokens, with the path probabilities of a chain accepted with probability ``decay`` per token;
* ``Belady`` — evict the resident expert whose next use is farthest (Belady 1966, "A study of replacement
  algorithms for a virtual-storage computer"): the fewest misses of any eviction without prefetch on these
  forwards, so a lower bound for ``ar+lookahead`` and for specfit's AR steps. Speculative methods verify draft
  nodes too (rejected ones included), so their misses are not bounded by it, only compared with it.

Each generation is replayed as the run decodes it (:meth:`specfit.engine.SpecDecoder.generate`): an empty cache,
a prefill of every prompt token but the last (no lookahead demand: the run clears it), whose copies are not
counted, then one forward per committed token (the root, then each committed token but the last), all counted.
The TRUE routing of those forwards is recomputed with the run's target: the same prefill and one ``decode`` per
token, on a cache of the run's size (so the forwards are the run's ``ar`` forwards, float for float). Every
method's output equals ``ar``'s (greedy, float32); the ``ar`` records give the committed tokens.

The modeled tok/s of a bound is ``ar``'s modeled time less the copies it saves, each priced at the profile's
``per_expert_ms`` of its layer (:meth:`specfit.core.cost.CostModel.per_expert_array`; the same cost model as
:mod:`specfit.eval.modeled`): what AR decoding with that eviction would run at, its lookahead free. Labelled
modeled.

Usage::

    python -m specfit.eval.cache_bounds RUN_DIR [RUN_DIR ...] [--horizons 2,8] [--decay 0.5] [--json OUT.json]
    python -m specfit.eval.cache_bounds RUN_DIR --refetch eagle3,specfit [--limit 3] [--max-new-tokens 32]

Prints a Markdown table per run (a sweep: one row per dataset × cache size): each method's measured figures, then
the bounds. ``--refetch`` instead decodes a few prompts under each run folder's settings and counts the copies of
experts the forward before evicted (:func:`next_forward_refetch`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from specfit.core.errors import SpecFitInputError
from specfit.eval.lookahead import demand_series, next_use
from specfit.eval.machine import run_main


def bound_label(horizon: int, decay: float) -> str:
    """A true-lookahead row's name."""
    return f"true next {horizon}" + ("" if decay == 1 else f", {decay:g}^j")


def replay(prefill: np.ndarray | None, decode: np.ndarray, num_experts: int, slots: int,
           demand: np.ndarray | None = None, counts: dict | None = None) -> np.ndarray:
    """Misses per MoE layer of the decode forwards of one generation through a real expert cache.

    Parameters
    ----------
    prefill : numpy.ndarray of int, shape (P, L, k), or None
        The prefill's routing (one forward; its copies are not counted). None: no prefill.
    decode : numpy.ndarray of int, shape (T, L, k)
        The routing of the T one-token forwards that follow, in order.
    num_experts : int
        E.
    slots : int
        Slots per layer, in [k, E].
    demand : numpy.ndarray of float, shape (T, L, E), optional
        Lookahead demand set before each decode forward (``lookahead`` policy); None: LRU.
    counts : dict, optional
        Adds to ``counts["refetched"]`` the misses of experts the forward just before evicted (what one
        forward's evictions cost the next: docs/SPECFIT.md §3, "What a verify leaves resident").

    Returns
    -------
    numpy.ndarray of int64, shape (L,)
        Misses (H2D copies) per layer over the decode forwards.
    """
    import torch

    from specfit.models.experts import DeviceExpertCache, HostExpertStore

    T, L, _ = decode.shape
    cache = DeviceExpertCache(HostExpertStore(L, num_experts, 1, 1, torch.float32), "cpu", slots=slots,
                              policy="lookahead")

    def forward(routing: np.ndarray) -> None:
        for layer in range(L):  # the runtime's ids: torch.unique of the forward's routing, sorted
            cache.run_rounds(layer, sorted(set(routing[:, layer].ravel().tolist())), lambda *a: None)

    if prefill is not None and len(prefill):
        forward(prefill)
    cache.reset_stats()
    before = cache.resident_mask()
    evicted = np.zeros_like(before)
    refetched = 0
    for t in range(T):
        if demand is not None:
            cache.set_lookahead(demand[t])
        used = np.zeros_like(before)
        used[np.arange(L)[:, None], decode[t]] = True
        refetched += int((used & ~before & evicted).sum())
        forward(decode[t:t + 1])
        after = cache.resident_mask()
        evicted, before = before & ~after, after
    if counts is not None:
        counts["refetched"] = counts.get("refetched", 0) + refetched
    return np.array([s["misses"] for s in cache.stats()["layers"]], dtype=np.int64)


def belady_demand(decode: np.ndarray, num_experts: int) -> np.ndarray:
    """(T, L, E) demand whose least-demand victim is Belady's: ``1 / (next use - t)`` of each expert after
    forward t, 0 for one never used again (ties between those: LRU; any is optimal)."""
    T = decode.shape[0]
    nu = next_use(decode, num_experts)
    dist = nu - np.arange(T)[:, None, None]
    return np.where(nu < T, 1.0 / np.maximum(dist, 1), 0.0)


def true_routing(model, prompt_ids: list[int], output_ids: list[int], forwards: int) -> tuple[np.ndarray | None, np.ndarray]:
    """The run's forwards of one generation on the target: (prefill routing (P-1, L, k) or None, decode routing
    (forwards, L, k)): from an empty cache of the model's size, the prefill of ``prompt_ids[:-1]``, then one
    ``decode`` each of the root ``prompt_ids[-1]`` and of ``output_ids[:forwards - 1]``."""
    import torch

    model.reset_cache(model.cache.slots)  # each generation starts with an empty cache, as in the run
    model.reset()
    pre = None
    with torch.no_grad():
        if len(prompt_ids) > 1:
            pre = model.prefill(torch.tensor(prompt_ids[:-1])).routing.numpy().copy()
        feed = [prompt_ids[-1], *output_ids[: forwards - 1]]
        dec = np.stack([model.decode(t).routing.numpy()[0] for t in feed])
    return pre, dec


def load_target(model_dir: str | Path, slots: int, max_len: int | None = None):
    """The run's target on the CPU in float32 (the runs' dtype there) with an LRU cache of ``slots``; KV room for
    ``max_len`` tokens (default: its ``max_position_embeddings``)."""
    from specfit.models.qwen3_moe import OffloadedQwen3Moe, read_spec

    max_len = max_len or read_spec(model_dir).max_position_embeddings
    return OffloadedQwen3Moe.from_pretrained(model_dir, cache_slots=slots, eviction="lru", max_len=max_len)


def _prompt_ids(run: Path, records, config: dict) -> dict:
    """(dataset, id) -> the prompt's token ids, as the run encoded them."""
    from specfit.eval.datasets import encode, load_prompts
    from specfit.models.qwen3_moe.generate import load_tokenizer

    tok = load_tokenizer(config["model"])
    out = {}
    for ds in dict.fromkeys(r.dataset for r in records):
        want = {r.id for r in records if r.dataset == ds}
        for p in load_prompts(ds):
            if p.id in want:
                out[ds, p.id] = encode(p, tok, config["max_article_tokens"])
        missing = want - {i for d, i in out if d == ds}
        if missing:
            raise SpecFitInputError("run", f"{run}: prompt {sorted(missing)[0]!r} of {ds!r} is not in the dataset")
    return out


def run_bounds(run: str | Path, horizons=(2, 8), decay: float = 0.5, model=None, routings: dict | None = None) -> dict:
    """Bounds of one run folder (module docstring).

    Parameters
    ----------
    run : path
        A ``specfit eval`` output folder holding ``config.json`` and ``results.jsonl`` with ``ar`` records.
    horizons : sequence of int
        True-lookahead horizons in tokens (>= 1).
    decay : float
        In (0, 1]: token t+j's weight ``decay ** j``.
    model : OffloadedQwen3Moe, optional
        The run's target (loaded from ``config.json``'s ``model`` when None); its cache is set to the run's size.
    routings : dict, optional
        Memo of :func:`true_routing` by (prompt ids, fed tokens), shared by the folders of a sweep (the
        same target decodes the same tokens at every size): each folder's ``lru_equals_ar`` checks that the
        memo's routing is that folder's ``ar`` routing, copy for copy.

    Returns
    -------
    dict
        ``{"slots": S, "datasets": {dataset: {"committed": int, "looked_up": int, "lru_equals_ar": bool,
        "prompts": int, "policies": {name: {"misses": int, "per_token": float, "hit_rate": float,
        "refetched": int, "modeled_tokens_per_s": float}}, "methods": {method: summary row dict}}}}``; per-token figures over
        all MoE layers (the summary's experts/token).

    Raises
    ------
    SpecFitInputError
        A folder without ``config.json``/``results.jsonl``, no ``ar`` record, a method whose output differs from
        ``ar``'s (field ``run``), bad ``horizons``/``decay``.
    """
    from specfit.core.cost import get_profile
    from specfit.core.readers import read_json
    from specfit.eval.records import read_results
    from specfit.eval.report import summarise

    run = Path(run)
    if not (run / "config.json").is_file() or not (run / "results.jsonl").is_file():
        raise SpecFitInputError("run", f"{run} holds no config.json and results.jsonl of a specfit eval run")
    if not horizons or min(horizons) < 1:
        raise SpecFitInputError("horizons", "must be positive integers")
    if not 0 < decay <= 1:
        raise SpecFitInputError("decay", f"must lie in (0, 1], got {decay}")
    config = read_json(run / "config.json")
    records = read_results(run / "results.jsonl")
    ar = {(r.dataset, r.id): r for r in records if r.method == "ar"}
    if not ar:
        raise SpecFitInputError("run", f"{run} has no 'ar' record: run it with --methods ar,...")
    for r in records:
        if (r.dataset, r.id) in ar and list(r.output_ids) != list(ar[r.dataset, r.id].output_ids):
            raise SpecFitInputError("run", f"{run}: {r.method}'s output of {r.dataset}/{r.id} differs from ar's")
    slots = config["cache_slots"]
    if isinstance(slots, str) or config.get("offload", "transfer") != "transfer":
        raise SpecFitInputError("run", f"{run}: bounds need a transfer cache of fewer slots than experts")
    max_len = max(r.prompt_tokens + r.cycles for r in ar.values()) + 2
    if model is None or model.max_len < max_len:
        model = load_target(config["model"], slots, max_len)
    model.reset_cache(slots, "lru")
    E, L = int(model.spec.num_experts), len(model.spec.moe_layers)
    per_expert = get_profile(config["profile"]).for_layers(L).per_expert_array(L)
    ids = _prompt_ids(run, list(ar.values()), config)
    names = ["LRU", *(bound_label(h, decay) for h in horizons), "Belady"]
    keys = set(ar)
    kept = [r for r in records if (r.dataset, r.id) in keys]  # a run still going: the prompts ar finished
    rows = {(row.dataset, row.method): row for row in summarise(kept, config["depth"], config["temperature"])}
    out = {"slots": slots, "datasets": {}}
    for ds in dict.fromkeys(d for d, _ in ar):
        misses = {n: np.zeros(L, dtype=np.int64) for n in names}
        refetch = {n: {} for n in names}
        committed = new = looked = 0
        ms = 0.0
        equal = True
        for (d, pid), rec in ar.items():
            if d != ds:
                continue
            if len(ids[d, pid]) != rec.prompt_tokens:
                raise SpecFitInputError("run", f"{run}: {d}/{pid} encodes to {len(ids[d, pid])} tokens, the run "
                                               f"to {rec.prompt_tokens}: another tokenizer or dataset file")
            key = (tuple(ids[d, pid]), tuple(rec.output_ids[: rec.cycles - 1]))
            if routings is None or key not in routings:
                got = true_routing(model, ids[d, pid], list(rec.output_ids), rec.cycles)
                if routings is None:
                    pre, dec = got
                else:
                    routings[key] = got
            if routings is not None:
                pre, dec = routings[key]
            demands = {"LRU": None, "Belady": belady_demand(dec, E)}
            for h in horizons:
                demands[bound_label(h, decay)] = demand_series(dec, h, E, decay)
            for n in names:
                m = replay(pre, dec, E, slots, demands[n], refetch[n])
                misses[n] += m
                if n == "LRU":
                    equal &= int(m.sum()) == rec.experts_transferred
            committed += rec.committed
            new += rec.new_tokens
            looked += rec.experts_looked_up
            ms += rec.modeled_ms
        policies = {}
        for n in names:
            saved_ms = float(per_expert @ (misses["LRU"] - misses[n]))
            policies[n] = {"misses": int(misses[n].sum()), "per_token": float(misses[n].sum()) / committed,
                           "hit_rate": 1.0 - float(misses[n].sum()) / looked if looked else 0.0,
                           "refetched": refetch[n].get("refetched", 0),
                           "modeled_tokens_per_s": 1000.0 * new / (ms - saved_ms)}
        out["datasets"][ds] = {
            "prompts": sum(1 for k in ar if k[0] == ds), "committed": committed, "looked_up": looked,
            "lru_equals_ar": bool(equal), "policies": policies,
            "methods": {m: rows[ds, m].to_json() for (d, m) in rows if d == ds}}
    return out


def next_forward_refetch(run: str | Path, methods=("eagle3", "specfit"), limit: int = 3,
                         max_new_tokens: int = 32) -> dict:
    """How much of each forward's copies the forward before caused by evicting (docs/SPECFIT.md §3, "What a
    verify leaves resident"): decodes the first ``limit`` prompts of each dataset of ``run`` with ``methods``
    under the run's settings (target, head, cache size, eviction, profile, counted clock) and counts, per target
    forward f after the prefill, the experts it routes to that were resident before forward f - 1 and evicted
    by it (``refetched``), against all experts it finds missing (``missing``: its copies) and those forward f - 1
    copied (the bound: refetched_f <= copies_{f-1}).

    Returns
    -------
    dict
        ``{dataset: {method: {"refetched": int, "missing": int, "committed": int}}}``.
    """
    import torch

    from specfit.core.cost import get_host_costs
    from specfit.core.readers import read_json
    from specfit.engine import TreeSettings
    from specfit.engine.clock import make_clock
    from specfit.eval.datasets import encode, load_prompts
    from specfit.models.qwen3_moe.generate import load_tokenizer
    from specfit.pipeline import SpecFit

    run = Path(run)
    c = read_json(run / "config.json")
    datasets = list(dict.fromkeys(r.dataset for r in _records(run)))
    models = SpecFit.from_pretrained(c["model"], c["draft"], cache_slots=c["cache_slots"], eviction=c["eviction"],
                                     admission=c["admission"], predictor=c["predictor"],
                                     predictor_trace=c["predictor_trace"], profile=c["profile"], max_len=2048)
    models.clock = make_clock("counted", get_host_costs(c["profile"]))
    target = models.target
    state = {}

    def watch(name):
        inner = getattr(target, name)

        def forward(*args, **kwargs):
            out = inner(*args, **kwargs)
            after = target.cache.resident_mask()
            if name == "prefill":
                state.update(before=after, evicted=np.zeros_like(after))
                return out
            L = after.shape[0]
            used = np.zeros_like(after)
            used[np.arange(L)[None, :, None], out.routing.numpy()] = True
            missing = used & ~state["before"]
            state["refetched"] += int((missing & state["evicted"]).sum())
            state["missing"] += int(missing.sum())
            state["evicted"], state["before"] = state["before"] & ~after, after
            return out
        setattr(target, name, forward)

    watch("prefill")
    watch("verify")
    tok = load_tokenizer(c["model"])
    tree = TreeSettings(c["total_tokens"], c["depth"], c["top_k"])
    out = {}
    with torch.no_grad():
        for ds in datasets:
            models.online.clear()
            prompts = [encode(p, tok, c["max_article_tokens"]) for p in load_prompts(ds, limit)]
            for m in methods:
                state.update(refetched=0, missing=0)
                committed = 0
                for ids in prompts:
                    gen = models.decoder(m, tree=tree).generate(ids, max_new_tokens, eos_id=models.eos_token_id)
                    committed += sum(cy.committed for cy in gen.cycles)
                out.setdefault(ds, {})[m] = {"refetched": state["refetched"], "missing": state["missing"],
                                             "committed": committed}
    return out


def _records(run: Path):
    from specfit.eval.records import read_results

    return read_results(run / "results.jsonl")

#: Methods in table order (those a run holds).
METHOD_ORDER = ("ar", "ar+lookahead", "eagle3", "eagle3-scan", "specfit", "oracle", "eagle3-vanilla")


def run_folders(path: str | Path) -> list[Path]:
    """The run folders of ``path``: its ``slots-<S>`` folders in size order (a sweep), else ``path`` itself."""
    path = Path(path)
    subs = sorted((d for d in path.glob("slots-*") if d.is_dir() and d.name[6:].isdigit()), key=lambda d: int(d.name[6:]))
    return subs or [path]


def markdown(results: list[dict]) -> str:
    """One row per dataset × cache size: each method's experts transferred per committed token, hit rate,
    modeled tok/s (× ar), then each bound's misses per token and hit rate (modeled tok/s)."""
    first = next(iter(results[0]["datasets"].values()))
    methods = [m for m in METHOD_ORDER if m in first["methods"]]
    bounds = [n for n in first["policies"] if n != "LRU"]
    lines = ["| dataset | slots | " + " | ".join(methods + bounds) + " |", "|---" * (2 + len(methods) + len(bounds)) + "|"]
    for ds in dict.fromkeys(d for r in results for d in r["datasets"]):
        for r in results:
            v = r["datasets"].get(ds)
            if v is None:
                continue
            ar = v["methods"].get("ar")
            cells = []
            for m in methods:
                row = v["methods"].get(m)
                if row is None:
                    cells.append("-")
                    continue
                ratio = f" ({row['modeled_tokens_per_s'] / ar['modeled_tokens_per_s']:.3f}×)" if ar and m != "ar" else ""
                cells.append(f"{row['experts_per_token']:.1f}, {row['cache_hit_rate']:.3f}, "
                             f"{row['modeled_tokens_per_s']:.1f}{ratio}")
            for n in bounds:
                p = v["policies"][n]
                cells.append(f"{p['per_token']:.1f}, {p['hit_rate']:.3f}, {p['modeled_tokens_per_s']:.1f}")
            lines.append(f"| {ds} | {r['slots']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    import time

    from specfit.core.io import atomic_write_text, dumps

    ap = argparse.ArgumentParser(prog="python -m specfit.eval.cache_bounds", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="specfit eval output folders (a sweep folder: each slots-<S>)")
    ap.add_argument("--horizons", default="2,8", help="true-lookahead horizons in tokens (default 2,8)")
    ap.add_argument("--decay", type=float, default=0.5, help="weight decay**j of token t+j (default 0.5)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    ap.add_argument("--refetch", default=None, metavar="METHODS",
                    help="instead: decode --limit prompts per dataset with these methods under each run's settings and "
                         "count the copies of experts the forward before evicted (next_forward_refetch)")
    ap.add_argument("--limit", type=int, default=3, help="prompts per dataset with --refetch (default 3)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt with --refetch (default 32)")
    args = ap.parse_args(argv)
    if args.refetch:
        for run in args.runs:
            for folder in run_folders(run):
                res = next_forward_refetch(folder, args.refetch.split(","), args.limit, args.max_new_tokens)
                for ds, by in res.items():
                    for m, v in by.items():
                        print(f"{folder} {ds} {m}: {v['refetched']} of {v['missing']} copies were of experts the "
                              f"forward before evicted ({v['refetched'] / max(v['missing'], 1):.1%}); "
                              f"{v['missing'] / max(v['committed'], 1):.2f} copies per committed token")
        return 0
    try:
        horizons = [int(h) for h in args.horizons.split(",")]
    except ValueError:
        raise SpecFitInputError("--horizons", "must be comma-separated integers") from None
    t0 = time.perf_counter()
    model, out, routings = None, {}, {}
    for run in args.runs:
        results = []
        for folder in run_folders(run):
            if not (folder / "config.json").is_file():
                raise SpecFitInputError("run", f"{folder} holds no config.json and results.jsonl of a specfit eval run")
            if model is None:
                from specfit.core.readers import read_json

                cfg = read_json(folder / "config.json")
                model = load_target(cfg["model"], cfg["cache_slots"])
            res = run_bounds(folder, horizons, args.decay, model, routings)
            results.append(res)
            bad = [d for d, v in res["datasets"].items() if not v["lru_equals_ar"]]
            if bad:
                print(f"warning: {folder}: the LRU replay differs from ar's copies on {', '.join(bad)}", file=sys.stderr)
        out[str(run)] = results
        print(f"{run}: experts per committed token (all MoE layers), hit rate, modeled tok/s (x ar); "
              f"bounds replayed on ar's committed tokens ({time.perf_counter() - t0:.0f} s)\n")
        print(markdown(results) + "\n")
    if args.json is not None:
        atomic_write_text(args.json, dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
