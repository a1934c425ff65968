"""The AR step's lookahead chain (``Method.lookahead_levels``): ``ar+lookahead`` and specfit's AR steps draft a
short chain with the head before the step's forward, and its predicted experts are the lookahead expert cache's
demand during that forward. Outputs equal plain AR's; the chain's head forwards are priced by the shadow rule
(what exceeds the step's H2D copies, eval/modeled.py)."""

import json

import numpy as np
import pytest
import torch

from specfit.core.cost import get_profile
from specfit.engine import METHODS, SpecDecoder, TreeSettings
from specfit.engine.decoder import CycleRecord
from specfit.engine.policy import UtilityGate
from specfit.eval.modeled import modeled_cycle_ms
from specfit.models.eagle3 import Eagle3Config, Eagle3Drafter, check_target, load_eagle3
from specfit.models.experts import DeviceExpertCache
from specfit.models.predictors import get_predictor
from specfit.models.proxy import paths
from specfit.models.qwen3_moe import OffloadedQwen3Moe
from specfit.models.qwen3_moe.generate import load_tokenizer
from specfit.eval.datasets import encode, load_prompts

NEW_TOKENS = 12
LEVELS = METHODS["ar+lookahead"].lookahead_levels
#: Nodes of the lookahead draft (an EAGLE-2 tree of lookahead_top_k children per expanded node).
NODES = sum(TreeSettings(depth=LEVELS, top_k=METHODS["ar+lookahead"].lookahead_top_k).level_width(j)
            for j in range(1, LEVELS + 1))


@pytest.fixture(scope="module")
def lite(one_torch_thread):
    """Two proxy targets (the engine's and plain AR's; ``reset_cache`` sets their slots and eviction), the
    shipped lite head's drafter, a pcie4 cost and two prompts' ids (one GSM8K, one CNN/DailyMail)."""
    d = paths()
    target_config = json.loads((d["target"] / "config.json").read_text())
    aux = check_target(Eagle3Config.from_dict(json.loads((d["eagle3-lite"] / "config.json").read_text())), target_config)
    targets = [OffloadedQwen3Moe.from_pretrained(d["target"], cache_slots=16, max_len=256, aux_layers=aux,
                                                 dtype=torch.float32) for _ in range(2)]
    drafter = Eagle3Drafter(load_eagle3(d["eagle3-lite"], target_config=target_config,
                                        embed_weight=targets[0].embed_weight.float()))
    tok = load_tokenizer(d["target"])
    prompts = [encode(p, tok, max_article_tokens=48) for p in load_prompts("gsm8k", limit=1) + load_prompts("cnndm", limit=1)]
    cost = get_profile("qwen3-30b-a3b-pcie4").for_layers(len(targets[0].spec.moe_layers))
    return targets, drafter, cost, prompts


def _predictor(spec):
    return get_predictor("recency", num_layers=len(spec.moe_layers), num_experts=spec.num_experts, top_k=spec.top_k)


def _spy(monkeypatch, events):
    """Record, in order, each demand the engine sets and each target forward it launches."""
    set_original, verify_original = DeviceExpertCache.set_lookahead, OffloadedQwen3Moe.verify
    monkeypatch.setattr(DeviceExpertCache, "set_lookahead", lambda self, demand: (
        events.append(("set", None if demand is None else np.array(demand))), set_original(self, demand))[1])
    monkeypatch.setattr(OffloadedQwen3Moe, "verify", lambda self, tokens, parents: (
        events.append(("verify", len(parents))), verify_original(self, tokens, parents))[1])


def _ar(lite, slots, prompt, tokens):
    """Plain AR decoding (LRU) of ``prompt`` on the second target."""
    (_, target), _, cost, _ = lite
    target.reset_cache(slots, "lru")
    return SpecDecoder(target, None, "ar", cost=cost).generate(prompt, tokens)


def test_ar_lookahead_equals_ar_and_sets_a_chain_demand_before_every_forward(lite, monkeypatch):
    (target, _), drafter, cost, prompts = lite
    want = _ar(lite, 16, prompts[0], NEW_TOKENS)
    events = []
    _spy(monkeypatch, events)
    target.reset_cache(16, "lookahead")
    spec = target.spec
    L, E, k = len(spec.moe_layers), spec.num_experts, spec.top_k
    g = SpecDecoder(target, drafter, "ar+lookahead", cost=cost, predictor=_predictor(spec)).generate(prompts[0], NEW_TOKENS)
    assert g.output_ids == want.output_ids  # timing only
    # every step drafts the lookahead after a forward that copied an expert (the prefill did), none after one
    # that copied nothing (it would be paid in full for an eviction that likely does not come)
    drafts = [j == 0 or sum(g.cycles[j - 1].transferred) > 0 for j in range(len(g.cycles))]
    assert sum(drafts) >= len(drafts) - 2  # 16 slots: nearly every AR step copies
    assert [(c.levels, c.nodes_verified, c.shadow_levels) for c in g.cycles] == [(0, 1, LEVELS * d) for d in drafts]
    # before each AR forward (every cycle verifies the root alone) that drafts, a fresh demand was set
    forwards = [i for i, e in enumerate(events) if e[0] == "verify"]
    assert len(forwards) == len(g.cycles)
    last = -1
    for i, drafted in zip(forwards, drafts):
        demands = [e[1] for e in events[last + 1:i] if e[0] == "set"]
        if not drafted:
            assert not demands
            last = i
            continue
        assert demands and demands[-1] is not None, "no lookahead demand before an AR forward"
        d = demands[-1]
        assert d.shape == (L, E) and (d >= 0).all()
        per_layer = d.sum(axis=1)  # each drafted node adds its path probability to k experts per layer
        assert np.allclose(per_layer, per_layer[0]) and 0 < per_layer[0] <= k * NODES + 1e-9
        last = i
    # the chain's head forwards are priced by the shadow rule: what exceeds the step's H2D copies
    dl = cost.draft_level_ms
    for c, drafted in zip(g.cycles, drafts):
        moved = float(cost.per_expert_array(len(c.transferred)) @ c.transferred)
        assert modeled_cycle_ms(c, cost)["draft_ms"] == pytest.approx(max(0.0, LEVELS * dl * drafted - moved))


def test_ar_lookahead_drafts_nothing_where_the_cache_does_not_look_ahead(lite):
    """Under LRU (the cache ignores demand) or with every expert resident (nothing is evicted) the chain
    would be paid for nothing: ar+lookahead is plain AR there, record for record."""
    (target, _), drafter, cost, prompts = lite
    for slots, eviction in ((16, "lru"), ("all", "lookahead")):
        a = _ar(lite, slots, prompts[0], 6)
        target.reset_cache(slots, eviction)
        g = SpecDecoder(target, drafter, "ar+lookahead", cost=cost, predictor=_predictor(target.spec)).generate(
            prompts[0], 6)
        assert g.output_ids == a.output_ids
        assert [(c.shadow_levels, c.transferred) for c in g.cycles] == [(0, c.transferred) for c in a.cycles]


def test_no_lookahead_draft_after_a_forward_that_copied_nothing(lite):
    """With most experts resident (112 of 128 slots) many forwards copy nothing: the step after one drafts no
    lookahead (and sets no demand), the step after a copying forward does."""
    (target, _), drafter, cost, prompts = lite
    target.reset_cache(112, "lookahead")
    g = SpecDecoder(target, drafter, "ar+lookahead", cost=cost, predictor=_predictor(target.spec)).generate(
        prompts[1], NEW_TOKENS)
    copied = [True] + [sum(c.transferred) > 0 for c in g.cycles[:-1]]
    assert [c.shadow_levels for c in g.cycles] == [LEVELS * d for d in copied]
    assert not all(copied)  # the case is exercised


def test_specfit_ar_steps_draft_the_chain_with_a_lookahead_cache(lite, monkeypatch):
    """specfit's AR steps (here every cycle: the gate says AR) draft the chain and set its demand with
    ``eviction="lookahead"``, and not under LRU; the output is AR's either way."""
    (target, _), drafter, cost, prompts = lite
    monkeypatch.setattr(UtilityGate, "decide", lambda self, sound=None: "ar")
    monkeypatch.setattr(UtilityGate, "decide_ahead", lambda self: None)
    want = _ar(lite, 16, prompts[1], 8).output_ids
    for eviction, levels in (("lookahead", LEVELS), ("lru", 0)):
        target.reset_cache(16, eviction)
        dec = SpecDecoder(target, drafter, "specfit", tree=TreeSettings(32, 6, 4), cost=cost,
                          predictor=_predictor(target.spec))
        g = dec.generate(prompts[1], 8)
        assert g.output_ids == want
        steps = [c for c in g.cycles if c.decision == "ar"]
        assert steps and all(c.shadow_levels == levels and c.levels == 0 for c in steps)


def test_the_chain_is_priced_like_a_shadows_levels():
    """An AR step's chain forwards cost what exceeds the step's modeled H2D copies (the shadow rule of
    eval/modeled.py): nothing where it copies enough, every level where it copies nothing."""
    cost = get_profile("qwen3-30b-a3b-pcie4").for_layers(2)
    dl = cost.draft_level_ms
    assert float(cost.per_expert_array(2) @ np.array([3, 0])) > LEVELS * dl  # 3 copies hide the whole chain
    plain = modeled_cycle_ms(CycleRecord(transferred=[3, 0], true_experts=[4, 4]), cost)
    hid = modeled_cycle_ms(CycleRecord(shadow_levels=LEVELS, transferred=[3, 0], true_experts=[4, 4]), cost)
    bare = modeled_cycle_ms(CycleRecord(shadow_levels=LEVELS, transferred=[0, 0], true_experts=[4, 4]), cost)
    assert hid["total_ms"] == pytest.approx(plain["total_ms"]) and hid["draft_ms"] == 0.0
    assert bare["draft_ms"] == pytest.approx(LEVELS * dl)
    assert bare["total_ms"] == pytest.approx(modeled_cycle_ms(CycleRecord(transferred=[0, 0], true_experts=[4, 4]),
                                                              cost)["total_ms"] + LEVELS * dl)


def test_the_gates_ar_twin_evicts_by_the_cycles_lookahead(lite, monkeypatch):
    """Under a lookahead cache the AR twin is ``ar+lookahead``'s cache: it replays an AR step's token with
    the chain's demand the engine's cache evicted by, and a drafted cycle's tokens with the whole tree's
    demand (the engine's cache got the tree less the verified nodes: never more); under LRU it never gets
    a demand. The output is AR's either way."""
    from specfit.engine.twin import ARTwinCache

    (target, _), drafter, cost, prompts = lite
    turn = iter(["ar", "draft"] * 100)
    monkeypatch.setattr(UtilityGate, "decide", lambda self, sound=None: next(turn))
    monkeypatch.setattr(UtilityGate, "decide_ahead", lambda self: None)
    engine, twin = [], []
    set_engine, set_twin = DeviceExpertCache.set_lookahead, ARTwinCache.set_lookahead
    monkeypatch.setattr(DeviceExpertCache, "set_lookahead", lambda self, demand: (
        engine.append(None if demand is None else np.array(demand)), set_engine(self, demand))[1])
    monkeypatch.setattr(ARTwinCache, "set_lookahead", lambda self, demand: (
        twin.append(None if demand is None else np.array(demand)), set_twin(self, demand))[1])
    want = _ar(lite, 16, prompts[0], NEW_TOKENS).output_ids
    for eviction in ("lru", "lookahead"):
        engine.clear(), twin.clear()
        target.reset_cache(16, eviction)
        dec = SpecDecoder(target, drafter, "specfit", tree=TreeSettings(32, 6, 4), cost=cost,
                          predictor=_predictor(target.spec))
        g = dec.generate(prompts[0], NEW_TOKENS)
        assert g.output_ids == want and dec._twin.cache is not None
        assert dec._twin.cache.looks_ahead == (eviction == "lookahead")
        demands = [d for d in twin if d is not None]
        if eviction == "lru":
            assert not demands
            continue
        sets = [d for d in engine if d is not None]
        chains = [d for d in demands if any(d.shape == e.shape and (d == e).all() for e in sets)]
        trees = [d for d in demands if any((d >= e).all() and d.sum() > e.sum() for e in sets)]
        assert chains and trees  # AR steps' chains as set; drafted trees with their verified nodes too
        assert {c.decision for c in g.cycles} == {"ar", "draft"}
