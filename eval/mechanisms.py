"""Ablation of the engine's switchable mechanisms: modeled tok/s of ``specfit`` with each switched off.

BENCHMARKS.md, "Engine mechanisms: what each pays". One process decodes the same prompts once per
variant, each variant with its own :class:`~specfit.engine.online.OnlineModel` learning across the
prompts (as ``specfit eval`` does per dataset); modeled tok/s are committed tokens over the cycles'
modeled ms (:func:`specfit.eval.modeled.modeled_cycle_ms`). Variants:

* ``full`` — the engine as it is; ``ar`` — plain AR decoding.
* ``always`` — the AR gate off (``policy="always"``: every cycle drafts).
* ``no-shadows`` — shadow cycles off (``shadows=False``: learning cycles draft for real).
* ``no-twin`` — the AR twin off (the gate prices AR against the engine's cache; shadows need the twin).
* ``no-explore`` — exploration bursts off (the gate never explores after AR steps).
* ``no-depth-cap`` — the warm-up's depth cap off.
* ``rate-mode`` — the long-run-rate objective on (``rate_mode=True``).
* ``no-bounds`` — the stop rule asked at every level (predict and solve) without its two bounds first.
* ``per-level-predict`` — the expert predictor called once per draft level instead of once per solve.

The last four and the twin are switched off by replacing one step of the decoder object (a benchmark's
counterfactual, not an option of the engine). ``--clock frozen`` (the default) makes every decision
independent of the machine's timing (host work costs 0 ms); ``measured`` prices the engine's measured
host CPU time and reports the ms the device hides (``tok/s hidden charged``: as if nothing were hidden).

Usage::

    python -m specfit.eval.mechanisms --cache-slots 16 --variants full,always,no-shadows
"""

from __future__ import annotations

import argparse
import sys

from specfit.core.io import dumps

VARIANTS = ("full", "ar", "always", "no-shadows", "no-twin", "no-explore", "no-depth-cap", "rate-mode", "no-bounds",
            "per-level-predict")


def _no_bounds_stop_rule(dec):
    """The decoder's stop rule without its bounds: every level is predicted and solved, and the rule asked."""
    def stop_rule(g, rule, p_f, rec):
        sunk = rule.host_ms + rec.levels * rule.level_ms
        if rule.rate is not None:
            return p_f <= rule.stop_ms * rule.rate / 1000.0, None
        dec._grow(g.tree, g.pending, g.predicted, rec)
        selection = dec._select(g.tree, g.cache, None, rec, g.cost, sunk)
        if rule.prune:
            rule.rate_lo = max(rule.rate_lo, 1000.0 * selection.expected_tokens
                               / (selection.predicted_ms - sunk + rule.max_sunk))
        return p_f <= rule.stop_ms * selection.throughput / 1000.0, selection
    return stop_rule


def _per_level_predict(dec):
    """The decoder's level step followed by the prediction of that level's kept nodes (no batching)."""
    add = dec._add_level

    def add_level(level, g, rule, rec):
        p_f = add(level, g, rule, rec)
        dec._grow(g.tree, g.pending, g.predicted, rec)
        return p_f
    return add_level


def run_variant(models, prompts, variant: str, tree, max_new_tokens: int, frozen: bool) -> dict:
    """Decode ``prompts`` (``(prompt, ids)`` pairs) with ``variant``; its modeled tok/s and counts.

    Returns
    -------
    dict
        ``variant``, ``tok_s`` (modeled), ``tok_s_hidden_charged`` (the hidden host ms charged too),
        ``host_ms``, ``hidden_ms``, ``predict_ms``, ``solve_ms``, ``levels``, ``tokens`` and ``decisions``
        (cycles per decision).
    """
    import torch

    from specfit.engine import SpecDecoder
    from specfit.engine.clock import FrozenClock, MeasuredClock
    from specfit.engine.online import OnlineModel
    from specfit.eval.modeled import modeled_cycle_ms

    method = "ar" if variant == "ar" else "specfit"
    online = None
    if method == "specfit":
        online = OnlineModel(tree.depth, "always" if variant == "always" else "gate")
        if variant == "no-explore":
            gate = online.policy
            gate.EXPLORE_FIRST = gate.EXPLORE_MAX = 10 ** 9
            gate.state.explore_after = 10 ** 9
        if variant == "no-depth-cap":
            online.policy.draft_depth = lambda depth: depth
    out = dict(variant=variant, tokens=0, modeled_ms=0.0, host_ms=0.0, hidden_ms=0.0, predict_ms=0.0, solve_ms=0.0,
               levels=0, decisions={})
    for _, ids in prompts:
        models.target.reset_cache(models.cache_slots, models.eviction)
        kw = dict(tree=tree, cost=models.cost, clock=FrozenClock() if frozen else MeasuredClock())
        if method == "specfit":
            kw.update(predictor=models.predictor, online=online, shadows=variant != "no-shadows",
                      rate_mode=variant == "rate-mode")
        dec = SpecDecoder(models.target, models.drafter if method == "specfit" else None, method, **kw)
        if variant == "no-twin":
            dec._sync_twin = lambda: None
        if variant == "no-bounds":
            dec._stop_rule = _no_bounds_stop_rule(dec)
        if variant == "per-level-predict":
            dec._add_level = _per_level_predict(dec)
        with torch.no_grad():
            gen = dec.generate(ids, max_new_tokens, eos_id=models.eos_token_id)
        for c in gen.cycles:
            out["modeled_ms"] += modeled_cycle_ms(c, models.cost)["total_ms"]
            out["host_ms"] += c.host_cpu_ms
            out["hidden_ms"] += c.hidden_host_ms
            out["predict_ms"] += c.predict_ms
            out["solve_ms"] += c.solve_ms
            out["levels"] += c.levels
            out["decisions"][c.decision] = out["decisions"].get(c.decision, 0) + 1
        out["tokens"] += len(gen.output_ids)
    out["tok_s"] = 1000.0 * out["tokens"] / out["modeled_ms"]
    out["tok_s_hidden_charged"] = 1000.0 * out["tokens"] / (out["modeled_ms"] + out["hidden_ms"])
    return out


def main(argv=None) -> int:
    """Command line: print one JSON line per variant."""
    from specfit.engine import TreeSettings
    from specfit.eval.run import EvalConfig, load_models, plan

    ap = argparse.ArgumentParser(prog="python -m specfit.eval.mechanisms", description=__doc__.split("\n")[0])
    ap.add_argument("--cache-slots", default="16", help="expert-cache slots per MoE layer, or 'all' (default 16)")
    ap.add_argument("--variants", default="full,always", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--clock", choices=["frozen", "measured"], default="frozen")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--draft", default="strong")
    ap.add_argument("--profile", default="qwen3-30b-a3b-h200")
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
    slots = a.cache_slots if a.cache_slots == "all" else int(a.cache_slots)
    config = EvalConfig(datasets=(a.dataset,), limit=a.limit, methods=("ar", "specfit"), max_new_tokens=a.max_new_tokens,
                        cache_slots=slots, draft=a.draft, profile=a.profile, out="runs/mechanisms")
    p = plan(config)
    models = load_models(p)
    tree = TreeSettings(config.total_tokens, config.depth, config.top_k)
    for v in variants:
        r = run_variant(models, p.prompts, v, tree, config.max_new_tokens, a.clock == "frozen")
        print(dumps({"slots": a.cache_slots, "clock": a.clock, **r}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
