"""How faithful is a target (and its EAGLE-3 head) to Qwen3-30B-A3B? Measured statistics beside public ones.

Per MoE layer, on held-out prompts (GSM8K test and the reserved CNN/DailyMail articles,
:func:`eval.predictors.prompt_texts`) prefilled on the target (:func:`eval.predictors.record`):

* **expert overlap at lag ℓ** (ℓ = 1, 2, 8): |E_t ∩ E_{t-ℓ}| / k, the share of token t's top-k
  experts that token t-ℓ also used; and **reuse within 8**: the share of token t's experts used by
  any of tokens t-8..t-1 (the statistic engine developers publish);
* **LRU and LFU hit rate** with 12.5 / 25 / 50 % of a layer's experts cached: one cache per layer
  fed the routing token by token, prompts back to back (hits / (k · tokens); LFU evicts the cached
  expert used least often so far, ties to the least recent);
* **experts covering 50 / 90 % of routing mass**: the fewest experts whose top-k selections add
  up to that share of all selections (the llama-imatrix count convention);
* **recall@k of the expert predictor** (``frequency``, the engine's default) built on training
  prompts and replayed on the held-out ones (:func:`eval.predictors.replay`, depth-1 nodes);

and, for the head, **τ and acceptance by depth** on GSM8K and CNN/DM with the default 32 / 6 / 4
tree, from an ``eagle3``-only :func:`eval.run.run_eval` (greedy): τ = mean committed tokens per
cycle, acceptance at depth d = share of cycles whose accepted path reaches depth d (vLLM's
``num_accepted_tokens_per_pos[d-1] / num_drafts``).

Each statistic is printed beside the public Qwen3-30B-A3B figure (:data:`PUBLIC`, with its address)
and a sentence on which way the difference biases SpecFit's comparisons. Where no public figure
was found the table says so.

Usage::

    python -m specfit.eval.realism                                   # the shipped proxy and default head
    python -m specfit.eval.realism --model DIR --draft DIR --device cuda   # a real checkpoint, unchanged

Writes ``--out`` (JSON, atomically) and prints a Markdown report.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from specfit.core.errors import SpecFitInputError, check_positive_int
from specfit.eval.machine import command_line

#: Overlap lags reported.
LAGS = (1, 2, 8)
#: Window of the "reuse within" statistic (tokens).
REUSE_WINDOW = 8
#: Cached share of a layer's experts for the LRU/LFU hit rates.
CACHE_FRACTIONS = (0.125, 0.25, 0.5)
#: Routing-mass shares for the coverage statistic.
COVERAGE = (0.5, 0.9)

#: Relative difference below which a measured statistic counts as matching the public figure.
CLOSE = 0.10

#: Public Qwen3-30B-A3B figures: statistic → (figure as published, conditions, address). ``None``:
#: searched for and not found (engine developers' traces, vLLM/SGLang issues, head cards).
PUBLIC = {
    "overlap_lag1": ("0.45", "share of selections repeated at the very next token; decode, 3 prompts × 512 tokens",
                     "https://github.com/kekzl/imp/pull/1359"),
    "overlap_lag2": None,
    "overlap_lag8": None,
    "reuse_within_8": ("0.80", "share of selections repeated within eight tokens; same trace",
                       "https://github.com/kekzl/imp/pull/1359"),
    "lru_0.125": ("0.366 at 24/128 slots (18.75 %)", "LRU, all 48 layers host-resident, 256 cold decode tokens "
                  "(the measured cache runs warm over all prompts)",
                  "https://github.com/kekzl/imp/pull/1374"),
    "lru_0.25": None,
    "lru_0.5": ("0.900–0.953 steady state at 40 %; 0.741 at 73/128 (57 %) cold",
                "LRU; steady state after ~64 decode tokens, 3 prompts (#1359); 256 cold decode tokens (#1374)",
                "https://github.com/kekzl/imp/pull/1374, https://github.com/kekzl/imp/pull/1359"),
    "lfu_0.125": None,
    "lfu_0.25": None,
    "lfu_0.5": None,
    "cover_0.5": None,
    "cover_0.9": ("65 (diverse prose/code/math, ~1k tokens); 58 (Python, ~8k tokens)",
                  "per-layer llama-imatrix expert counts, median over layers",
                  "https://mcp-tool-shop-org.github.io/gpu-container/handbook/derisk/"),
    "tau_gsm8k": ("2.10 (AngelSlim head, 2 draft tokens); 1.59 / 1.90 / 2.13 / 2.22 tokens/step for 1 / 2 / 4 / 8 "
                  "(mixed chat prompts)",
                  "vLLM, batch 1; the second on an H100 with vLLM 0.31, AngelSlim/Qwen3-a3B_eagle3",
                  "https://github.com/Tencent/AngelSlim/blob/main/docs/source/performance/speculative_decoding/benchmarks.md, "
                  "https://github.com/ManasVardhan/runara-takehome"),
    "tau_cnndm": None,
    "tau_tree": ("2.42 (6 steps, top-k 4, 12 draft tokens); 3.2 (8 / 8 / 60)",
                 "MT-Bench, SGLang, zhuyksir/EAGLE3-Qwen3-30B-A3B-DenseHead",
                 "https://github.com/sgl-project/SpecForge/issues/339"),
    "accept_depth1": ("0.59", "chain of 1 draft token (top-1 only; the measured tree offers 4 at depth 1), "
                      "mixed chat prompts, vLLM 0.31, AngelSlim head",
                      "https://github.com/ManasVardhan/runara-takehome"),
    "recall": None,
}

#: Which way a difference biases SpecFit's comparisons: statistic → (if proxy < public, if proxy > public).
BIAS = {
    "overlap": ("the proxy reuses fewer experts from token to token, so cache hits and the savings of "
                "reuse-aware selection are understated; every cached method transfers more than on the real model",
                "the proxy reuses more experts than the real model, so cached methods (and specfit's cache-aware "
                "selection) look better than they will"),
    "lru": ("a per-layer cache holds less of the proxy's working set: more transfers per token for all cached methods, "
            "and more room for specfit's expert-aware tree selection to win, so its gain over eagle3 is optimistic",
            "the cache is more effective on the proxy: fewer transfers, so the transfer-bound regime where specfit "
            "gains is reached later on the proxy and its gains are understated"),
    "lfu": ("as for LRU: more misses on the proxy, so the transfer share and specfit's room to gain are overstated",
            "as for LRU: fewer misses on the proxy, so specfit's gains are understated"),
    "cover": ("routing is more concentrated on the proxy: hot experts cover more of the mass, so static caching and "
              "frequency predictors look better than on the real model",
              "routing is flatter on the proxy: a frequency-based cache or predictor looks worse than on the real model"),
    "tau": ("the proxy head accepts fewer tokens per cycle, so speculation (eagle3, specfit) is understated against AR "
            "and the crossover to speculation moves to larger caches",
            "the proxy head accepts more tokens per cycle, so speculation is overstated against AR and the "
            "crossover between AR and speculation comes at smaller caches than on the real model"),
    "accept": ("deep draft nodes are worth less on the proxy, so specfit's choice of deeper nodes is undervalued",
               "deep draft nodes are worth more on the proxy, so larger trees (and their expert cost) look better"),
    "recall": ("the predictor misses more of the proxy's experts, so specfit's predicted expert cost is noisier than "
               "it would be on the real model",
               "the predictor is more accurate on the proxy, so specfit's expert-aware selection is optimistic"),
}


# -- routing statistics ---------------------------------------------------------------------------
def overlap_at_lag(routing: np.ndarray, offsets: np.ndarray, lag: int) -> np.ndarray:
    """Mean share of token t's top-k experts that token t-``lag`` (same prompt) also used, per layer.

    Parameters
    ----------
    routing : numpy.ndarray
        (N, L, k) expert ids, prompts concatenated.
    offsets : numpy.ndarray
        (P + 1,) prompt boundaries (:class:`models.traces.RoutingTrace`).
    lag : int
        Distance in tokens (>= 1).

    Returns
    -------
    numpy.ndarray
        (L,) float64 in [0, 1]; NaN for a layer when no prompt is longer than ``lag``.
    """
    num = np.zeros(routing.shape[1])
    den = 0
    for a, b in zip(offsets[:-1], offsets[1:]):
        if b - a <= lag:
            continue
        cur, prev = routing[a + lag:b], routing[a:b - lag]
        num += (cur[..., :, None] == prev[..., None, :]).any(-1).sum(axis=(0, 2))
        den += (b - a - lag) * routing.shape[2]
    return num / den if den else np.full(routing.shape[1], np.nan)


def reuse_within(routing: np.ndarray, offsets: np.ndarray, window: int) -> np.ndarray:
    """Share of token t's experts used by any of tokens t-``window``..t-1 of the same prompt, per layer.

    Tokens with fewer than ``window`` predecessors in their prompt look back as far as they can;
    the first token of each prompt is not scored. Returns (L,) float64.
    """
    num, den = np.zeros(routing.shape[1]), 0
    for a, b in zip(offsets[:-1], offsets[1:]):
        r = routing[a:b]
        seen = np.zeros(r.shape, dtype=bool)                            # (T, L, k)
        for lag in range(1, min(window, len(r) - 1) + 1):
            seen[lag:] |= (r[lag:, :, :, None] == r[:-lag, :, None, :]).any(-1)
        num += seen[1:].sum(axis=(0, 2))
        den += max(len(r) - 1, 0) * r.shape[2]
    return num / den if den else np.full(routing.shape[1], np.nan)


def cache_hit_rate(routing: np.ndarray, num_experts: int, slots: int, policy: str) -> np.ndarray:
    """Per-layer hit rate of an expert cache fed the routing token by token (prompts back to back).

    Parameters
    ----------
    routing : numpy.ndarray
        (N, L, k) expert ids.
    num_experts : int
        Experts per layer E.
    slots : int
        Cached experts per layer (1 <= slots <= E).
    policy : str
        ``"lru"`` (evict the least recently used) or ``"lfu"`` (evict the least often used so far,
        ties to the least recently used).

    Returns
    -------
    numpy.ndarray
        (L,) hits / (k · N).
    """
    if policy not in ("lru", "lfu"):
        raise SpecFitInputError("policy", f"must be 'lru' or 'lfu', got {policy!r}")
    n, L, k = routing.shape
    hits = np.zeros(L)
    for layer in range(L):
        cache: OrderedDict[int, None] = OrderedDict()                   # LRU order, oldest first
        uses = np.zeros(num_experts, dtype=np.int64)
        for t in range(n):
            needed = routing[t, layer].tolist()
            for e in needed:
                uses[e] += 1
                if e in cache:
                    hits[layer] += 1
                    cache.move_to_end(e)
                    continue
                if len(cache) >= slots:
                    protect = set(needed)
                    victims = [c for c in cache if c not in protect] or list(cache)
                    victim = victims[0] if policy == "lru" else min(victims, key=lambda c: uses[c])  # stable: LRU ties
                    del cache[victim]
                cache[e] = None
    return hits / (k * n)


def experts_covering(routing: np.ndarray, num_experts: int, share: float) -> np.ndarray:
    """Fewest experts whose top-k selections make up ``share`` of all selections, per layer (L,) int."""
    L = routing.shape[1]
    out = np.zeros(L, dtype=np.int64)
    for layer in range(L):
        counts = np.sort(np.bincount(routing[:, layer].ravel(), minlength=num_experts))[::-1]
        out[layer] = int(np.searchsorted(np.cumsum(counts) / counts.sum(), share - 1e-12) + 1)
    return out


def routing_statistics(trace) -> dict:
    """Every routing statistic of the module docstring for one :class:`models.traces.RoutingTrace`."""
    r, off, E = trace.routing, trace.offsets, trace.num_experts
    per_layer = {f"overlap_lag{lag}": overlap_at_lag(r, off, lag) for lag in LAGS}
    per_layer[f"reuse_within_{REUSE_WINDOW}"] = reuse_within(r, off, REUSE_WINDOW)
    for frac in CACHE_FRACTIONS:
        slots = max(1, round(frac * E))
        for policy in ("lru", "lfu"):
            per_layer[f"{policy}_{frac}"] = cache_hit_rate(r, E, slots, policy)
    for share in COVERAGE:
        per_layer[f"cover_{share}"] = experts_covering(r, E, share)
    return {k: np.asarray(v, dtype=float).tolist() for k, v in per_layer.items()}


# -- acceptance -----------------------------------------------------------------------------------
def acceptance(records: list[dict], depth: int) -> dict:
    """τ and acceptance by depth per dataset from ``eagle3`` result records (:func:`specfit.eval.records.ResultRecord.from_generation`).

    Returns
    -------
    dict
        ``{dataset: {"tau", "accept_by_depth" (list, depth entries), "cycles", "new_tokens"}}``.
    """
    out = {}
    for ds in dict.fromkeys(r["dataset"] for r in records):
        acc = np.array([a for r in records if r["dataset"] == ds for a in r["accept_lengths"]], dtype=float)
        out[ds] = {"tau": float(np.mean(acc + 1)) if acc.size else float("nan"),
                   "accept_by_depth": [float(np.mean(acc >= d)) if acc.size else float("nan") for d in range(1, depth + 1)],
                   "cycles": int(acc.size), "new_tokens": int(sum(r["new_tokens"] for r in records if r["dataset"] == ds))}
    return out


def measure_acceptance(model, draft, *, limit: int, max_new_tokens: int, device: str, depth: int = 6,
                       total_tokens: int = 32, top_k: int = 4) -> dict:
    """Run ``specfit eval`` with the ``eagle3`` method only on GSM8K and CNN/DM and summarise it (:func:`acceptance`)."""
    from specfit.eval.run import EvalConfig, read_results, run_eval

    with tempfile.TemporaryDirectory() as tmp:
        run_eval(EvalConfig(datasets=("gsm8k", "cnndm"), limit=limit, methods=("eagle3",), max_new_tokens=max_new_tokens,
                            model=None if model is None else str(model), draft=None if draft is None else str(draft),
                            total_tokens=total_tokens, depth=depth, top_k=top_k, device=device, out=tmp), progress=False)
        return acceptance(read_results(Path(tmp) / "results.jsonl"), depth)


# -- the report -----------------------------------------------------------------------------------
def run(model=None, draft=None, *, n_train: int = 40, n_eval: int = 20, max_tokens: int = 256, tau_prompts: int = 30,
        max_new_tokens: int = 64, device: str = "cpu", data_dir=None) -> dict:
    """Measure every statistic for a target (default: the shipped proxy) and head (default: ``specfit eval``'s).

    Parameters
    ----------
    model, draft : str or pathlib.Path, optional
        Target checkpoint and EAGLE-3 head directories (``draft`` may also be ``lite`` or ``strong``).
    n_train, n_eval : int
        Prompts recorded to build the predictor / to measure routing on (held out).
    max_tokens : int
        Tokens per recorded prompt.
    tau_prompts, max_new_tokens : int
        Prompts per dataset and new tokens per prompt of the acceptance run.
    device : str
        Torch device.

    Returns
    -------
    dict
        ``routing`` (per-layer lists), ``recall_per_layer``, ``acceptance`` (per dataset), the
        settings, and ``rows`` (the comparison table, :func:`comparison_rows`).
    """
    from specfit.eval.predictors import encode, prompt_texts, record, replay
    from specfit.models.eagle3 import Eagle3Config, check_target
    from specfit.models.proxy import TARGET_DIR, head_dir
    from specfit.models.predictors import get_predictor
    from specfit.models.qwen3_moe import OffloadedQwen3Moe

    for name, v in (("n_train", n_train), ("n_eval", n_eval), ("max_tokens", max_tokens), ("tau_prompts", tau_prompts),
                    ("max_new_tokens", max_new_tokens)):
        check_positive_int(name, v)
    target_dir, draft_dir = Path(model or TARGET_DIR).resolve(), head_dir(draft).resolve()
    for flag, d in (("--model", target_dir), ("--draft", draft_dir)):
        if not (d / "config.json").is_file():
            raise SpecFitInputError(flag, f"no config.json in {d}")
    cfg = json.loads((target_dir / "config.json").read_text())
    aux = check_target(Eagle3Config.from_dict(json.loads((draft_dir / "config.json").read_text())), cfg)
    target = OffloadedQwen3Moe.from_pretrained(target_dir, device=device, cache_slots="all", max_len=max_tokens + 8,
                                               aux_layers=aux)
    train_txt, eval_txt = prompt_texts(n_train, n_eval, data_dir)
    V = target.spec.vocab_size
    train = record(target, encode(train_txt, target_dir, V, max_tokens))
    held = record(target, encode(eval_txt, target_dir, V, max_tokens))
    del target
    recall, _ = replay(get_predictor("frequency", trace=train), held)
    report = {"model": str(target_dir), "draft": str(draft_dir), "device": device,
              "num_layers": held.num_layers, "num_experts": held.num_experts, "top_k": held.top_k,
              "held_out_prompts": held.num_prompts, "held_out_tokens": len(held), "build_prompts": train.num_prompts,
              "routing": routing_statistics(held), "recall_per_layer": recall.tolist(),
              "acceptance": measure_acceptance(target_dir, draft_dir, limit=tau_prompts, max_new_tokens=max_new_tokens,
                                               device=device),
              "settings": {"n_train": n_train, "n_eval": n_eval, "max_tokens": max_tokens, "tau_prompts": tau_prompts,
                           "max_new_tokens": max_new_tokens, "tree": "32/6/4"}}
    report["rows"] = comparison_rows(report)
    return report


def _public_number(stat: str) -> float | None:
    """The first number of a public figure (for the direction of the difference), or None."""
    import re

    entry = PUBLIC.get(stat)
    if entry is None:
        return None
    m = re.search(r"\d+(\.\d+)?", entry[0])
    return float(m.group()) if m else None


def comparison_rows(report: dict) -> list[dict]:
    """One row per statistic: measured (mean and range over layers), public figure, source, bias sentence."""
    rows = []
    routing, E = report["routing"], report["num_experts"]

    def add(stat, label, values, bias_key, fmt="{:.2f}"):
        v = np.asarray(values, dtype=float)
        measured = fmt.format(np.nanmean(v)) + (f" ({fmt.format(np.nanmin(v))}–{fmt.format(np.nanmax(v))} by layer)"
                                                if v.size > 1 else "")
        pub, num = PUBLIC.get(stat), _public_number(stat)
        if pub is None:
            bias = "no public Qwen3-30B-A3B figure found, so the direction is unknown"
        elif num is not None and abs(float(np.nanmean(v)) - num) <= CLOSE * num:
            bias = (f"within {CLOSE:.0%} of the public figure, so this statistic biases the comparisons little "
                    "(the conditions differ; see the conditions column)")
        else:
            bias = BIAS[bias_key][0 if float(np.nanmean(v)) < num else 1]
        rows.append({"statistic": label, "key": stat, "measured": measured,
                     "public": pub[0] if pub else "not found", "conditions": pub[1] if pub else "",
                     "source": pub[2] if pub else "", "bias": bias})

    for lag in LAGS:
        add(f"overlap_lag{lag}", f"expert overlap with token t-{lag} (share of top-k)", routing[f"overlap_lag{lag}"], "overlap")
    add(f"reuse_within_{REUSE_WINDOW}", f"experts reused within {REUSE_WINDOW} tokens", routing[f"reuse_within_{REUSE_WINDOW}"],
        "overlap")
    for frac in CACHE_FRACTIONS:
        for policy in ("lru", "lfu"):
            add(f"{policy}_{frac}", f"{policy.upper()} hit rate, {frac:.1%} of experts cached ({max(1, round(frac * E))}/{E})",
                routing[f"{policy}_{frac}"], policy)
    for share in COVERAGE:
        add(f"cover_{share}", f"experts covering {share:.0%} of routing mass (of {E})", routing[f"cover_{share}"], "cover",
            fmt="{:.0f}")
    add("recall", f"expert predictor recall@{report['top_k']} (frequency, depth-1 nodes)", report["recall_per_layer"],
        "recall")
    names = {"gsm8k": "tau_gsm8k", "cnndm": "tau_cnndm"}
    for ds, a in report["acceptance"].items():
        add(names.get(ds, f"tau_{ds}"), f"τ on {ds}, tree 32/6/4 (bonus included)", [a["tau"]], "tau")
        add("accept_depth1", f"acceptance at depth 1 on {ds}", [a["accept_by_depth"][0]], "accept")
    return rows


def markdown(report: dict) -> str:
    """The comparison table, the per-layer detail and acceptance by depth as Markdown."""
    lines = [f"Target {report['model']} ({report['num_layers']} MoE layers, {report['num_experts']} experts, "
             f"top-{report['top_k']}), head {report['draft']}; routing on {report['held_out_prompts']} held-out prompts "
             f"({report['held_out_tokens']} tokens, prefill), predictor built on {report['build_prompts']} training prompts.",
             "", "| statistic | measured | Qwen3-30B-A3B (public) | conditions | source | bias of the comparison |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['statistic']} | {r['measured']} | {r['public']} | {r['conditions']} | {r['source']} | {r['bias']} |")
    lines += ["", "Acceptance by depth (share of cycles whose accepted path reaches depth d), tree 32/6/4:", "",
              "| dataset | τ | d=1 | d=2 | d=3 | d=4 | d=5 | d=6 | cycles |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for ds, a in report["acceptance"].items():
        lines.append(f"| {ds} | {a['tau']:.2f} | " + " | ".join(f"{x:.2f}" for x in a["accept_by_depth"]) + f" | {a['cycles']} |")
    tree = PUBLIC["tau_tree"]
    lines += ["", f"Public τ with larger trees: {tree[0]} ({tree[1]}; {tree[2]}). Public routing figures are decode "
              "traces; the measured ones are prefill of the held-out prompts."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    from specfit.eval.predictors import write_json

    ap = argparse.ArgumentParser(prog="python -m specfit.eval.realism", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target checkpoint directory (default: the shipped proxy)")
    ap.add_argument("--draft", default=None, help="EAGLE-3 head directory, or lite / strong (default: specfit eval's)")
    ap.add_argument("--train-prompts", type=int, default=40, help="prompts the predictor is built from (default 40)")
    ap.add_argument("--eval-prompts", type=int, default=20, help="held-out prompts for routing statistics (default 20)")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per recorded prompt (default 256)")
    ap.add_argument("--tau-prompts", type=int, default=30, help="prompts per dataset for τ (default 30)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt for τ (default 64)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--out", type=Path, default=Path("runs/realism.json"),
                    help="JSON report (default runs/realism.json)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, args.threads))
    report = run(args.model, args.draft, n_train=args.train_prompts, n_eval=args.eval_prompts, max_tokens=args.max_tokens,
                 tau_prompts=args.tau_prompts, max_new_tokens=args.max_new_tokens, device=args.device)
    report["command"] = command_line("specfit.eval.realism", argv)
    write_json(args.out, report)
    print(markdown(report) + f"\nwritten: {args.out}")
    return 0


def _cli() -> int:
    """``main`` with bad input as one stderr line and exit status 2."""
    try:
        return main()
    except SpecFitInputError as e:
        print(f"python -m specfit.eval.realism: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_cli())
