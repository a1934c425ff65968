"""Ablation of the engine's switchable mechanisms: modeled tok/s of ``specfit`` with each switched off.

BENCHMARKS.md, "Engine mechanisms: what each pays". One process decodes the same prompts once per
variant, each variant with its own :class:`~specfit.engine.online.OnlineModel` learning across the
prompts (as ``specfit eval`` does per dataset); modeled tok/s are committed tokens over the cycles'
modeled ms (:func:`specfit.eval.modeled.modeled_cycle_ms`). Variants:

* ``full`` — the engine as it is; ``ar`` — plain AR decoding.
* ``always`` — the AR gate off (``policy="always"``: every cycle drafts).
* ``no-shadows`` — shadow cycles off (``shadows=False``: learning cycles draft for real).
* ``no-twin`` — the AR twin off (``twin=False``: the gate prices AR against the engine's cache; shadows need
  the twin).
* ``no-explore`` — exploration bursts off (:class:`NoExploreGate`: the gate never explores after AR steps).
* ``no-depth-cap`` — the warm-up's depth cap off (:class:`NoDepthCapGate`).
* ``rate-mode`` — the long-run-rate objective on (``rate_mode=True``).
* ``no-bounds`` — the stop rule asked at every level (predict and solve) without its two bounds first
  (``stop_bounds=False``).
* ``per-level-predict`` — the expert predictor called once per draft level instead of once per solve
  (``batch_predict=False``).

Each is a :class:`~specfit.engine.SpecDecoder` argument or a :class:`~specfit.engine.UtilityGate` subclass
given to the variant's :class:`~specfit.engine.online.OnlineModel`. ``--clock frozen`` (the default) makes every decision
independent of the machine's timing (host work costs 0 ms); ``measured`` prices the engine's measured
host CPU time and reports the ms the device hides (``tok/s hidden charged``: as if nothing were hidden).

Usage::

    python -m specfit.eval.mechanisms --cache-slots 16 --variants full,always,no-shadows
"""

from __future__ import annotations

import argparse
import sys

from specfit.core.io import dumps
from specfit.engine.policy import UtilityGate

VARIANTS = ("full", "ar", "always", "no-shadows", "no-twin", "no-explore", "no-depth-cap", "rate-mode", "no-bounds",
            "per-level-predict")


#: The :class:`~specfit.engine.SpecDecoder` arguments of each variant: its mechanism off (rate mode: on).
DECODER_ARGS = {"no-shadows": {"shadows": False}, "no-twin": {"twin": False}, "rate-mode": {"rate_mode": True},
               "no-bounds": {"stop_bounds": False}, "per-level-predict": {"batch_predict": False}}


class NoExploreGate(UtilityGate):
    """The AR gate without exploration bursts: an exploration waits for 10 ** 9 AR steps, so none starts."""

    EXPLORE_FIRST = EXPLORE_MAX = 10 ** 9


class NoDepthCapGate(UtilityGate):
    """The AR gate without the warm-up's depth cap: every drafted cycle may draft the tree's full depth."""

    def draft_depth(self, depth: int) -> int:
        """``depth``: no cap (:meth:`UtilityGate.draft_depth` caps it during the warm-up)."""
        return depth


#: The draft policy of each calibrated variant's online model (default: the gate).
POLICY = {"always": "always", "no-explore": NoExploreGate, "no-depth-cap": NoDepthCapGate}


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
        policy = POLICY.get(variant, "gate")
        online = OnlineModel(tree.depth, policy if isinstance(policy, str) else policy())
    out = dict(variant=variant, tokens=0, modeled_ms=0.0, host_ms=0.0, hidden_ms=0.0, predict_ms=0.0, solve_ms=0.0,
               levels=0, decisions={})
    for _, ids in prompts:
        models.target.reset_cache(models.cache_slots, models.eviction)
        kw = dict(tree=tree, cost=models.cost, clock=FrozenClock() if frozen else MeasuredClock())
        if method == "specfit":
            kw.update(predictor=models.predictor, online=online, **DECODER_ARGS.get(variant, {}))
        dec = SpecDecoder(models.target, models.drafter if method == "specfit" else None, method, **kw)
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
