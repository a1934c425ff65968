"""Lossless on the shipped proxy: every method's greedy output equals greedy AR, token for token, on
20 prompts across GSM8K and CNN/DailyMail (the evaluation's own prompt templates), in float32; in
bfloat16 it leaves AR's only at rounding ties. ``pytest --device cuda`` runs both on a GPU."""

import json
import math

import numpy as np
import pytest
import torch

from specfit.eval.datasets import encode, load_prompts
from specfit.models.eagle3 import Eagle3Config, Eagle3Drafter, check_target, load_eagle3
from specfit.models.predictors import get_predictor
from specfit.models.proxy import paths
from specfit.models.qwen3_moe import OffloadedQwen3Moe
from specfit.models.qwen3_moe.generate import load_tokenizer
from specfit.core.cost import get_profile
from specfit.engine import METHODS, SpecDecoder, TreeSettings
from specfit.engine.policy import UtilityGate

NEW_TOKENS = 10


#: Largest gap between AR's logits for its own token and for a speculative method's token, at the first
#: position where the method's bfloat16 output leaves AR's, that counts as a numerical tie (logits).
#: In bfloat16 the same context's logits differ with the batch shape (one AR token against a tree
#: verify) and with the order the experts' outputs are summed in (which the expert cache's state
#: sets): by up to 0.09 between a decode and a prefill of the same text on the proxy (BENCHMARKS.md,
#: "First CUDA run"). A method that commits a token AR would not choose, by logic rather than
#: rounding, loses by far more.
BF16_TIE_LOGITS = 0.25


def load_proxy(device, dtype):
    """The proxy's targets with 0, 32 and all slots on ``device`` in ``dtype``, and the shipped head."""
    d = paths()
    target_config = json.loads((d["target"] / "config.json").read_text())
    aux = check_target(Eagle3Config.from_dict(json.loads((d["eagle3"] / "config.json").read_text())), target_config)
    targets = {s: OffloadedQwen3Moe.from_pretrained(d["target"], cache_slots=s, max_len=1024, aux_layers=aux,
                                                   device=device, dtype=dtype)
               for s in (0, 32, "all")}
    head = load_eagle3(d["eagle3"], target_config=target_config, embed_weight=targets[32].embed_weight.float(),
                       device=targets[32].device, dtype=dtype)
    return targets, Eagle3Drafter(head)


def proxy_prompts() -> list[list[int]]:
    """Token ids of 10 GSM8K and 10 CNN/DailyMail prompts (the evaluation's templates)."""
    tok = load_tokenizer(paths()["target"])
    prompts = load_prompts("gsm8k", limit=10) + load_prompts("cnndm", limit=10)
    return [encode(p, tok, max_article_tokens=96) for p in prompts]


def decoder(targets, drafter, method):
    """A SpecDecoder of ``method`` on the proxy: pcie4 profile, a 32-node tree, the recency predictor."""
    spec = targets[32].spec
    cost = get_profile("qwen3-30b-a3b-pcie4").for_layers(len(spec.moe_layers))
    predictor = get_predictor("recency", num_layers=len(spec.moe_layers), num_experts=spec.num_experts,
                              top_k=spec.top_k)
    return SpecDecoder(targets[32 if method.uses_cache else 0], drafter, method, tree=TreeSettings(32, 6, 4),
                       cost=cost, predictor=predictor, reference=targets["all"] if method.needs_reference else None)


@pytest.fixture(scope="module")
def proxy(one_torch_thread, device):
    """The proxy in float32 on ``device`` (pytest ``--device``), its head, and 20 prompts' ids."""
    targets, drafter = load_proxy(device, torch.float32)
    return targets, drafter, proxy_prompts()


@pytest.mark.slow
def test_every_method_equals_ar_on_20_proxy_prompts(proxy):
    targets, drafter, prompts = proxy
    ar = SpecDecoder(targets[32], None, "ar")
    expected = [ar.generate(p, NEW_TOKENS).output_ids for p in prompts]
    taus = {}
    for name, method in METHODS.items():
        if name == "ar":
            continue
        dec = decoder(targets, drafter, method)
        gens = [dec.generate(p, NEW_TOKENS) for p in prompts]
        for i, (g, e) in enumerate(zip(gens, expected)):
            assert g.output_ids == e, f"{name} diverges from AR on prompt {i}"
        taus[name] = sum(g.tau for g in gens) / len(gens)
    assert taus["eagle3"] > 1.0  # the shipped head accepts draft tokens


def ar_logits(target, prompt, generated) -> torch.Tensor:
    """(V,) float32 logits AR decoding computes after ``prompt + generated``: a prefill of the prompt,
    then one decode per generated token (the batch shapes AR uses)."""
    target.reset()
    out = target.prefill(prompt)
    for tok in generated:
        out = target.decode(tok)
    return out.logits[-1].float().cpu()


@pytest.mark.slow
def test_bfloat16_output_leaves_ar_only_at_numerical_ties(one_torch_thread, device):
    """In bfloat16 (the CUDA dtype) a method's greedy output may leave AR's only where AR's logits
    for the two tokens are within rounding (:data:`BF16_TIE_LOGITS`); float32 output equals AR's
    (:func:`test_every_method_equals_ar_on_20_proxy_prompts`). 24 new tokens per prompt: on the
    proxy some bfloat16 outputs do leave AR's within that many."""
    targets, drafter = load_proxy(device, torch.bfloat16)
    prompts = proxy_prompts()
    ar = SpecDecoder(targets[32], None, "ar")
    expected = [ar.generate(p, 24).output_ids for p in prompts]
    for name, method in METHODS.items():
        if name == "ar" or method.needs_reference:  # the oracle: slow, and its float32 run above suffices
            continue
        dec = decoder(targets, drafter, method)
        for i, p in enumerate(prompts):
            got, want = dec.generate(p, 24).output_ids, expected[i]
            if got == want:
                continue
            j = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
            logits = ar_logits(targets[32], p, want[:j])
            gap = float(logits[want[j]] - logits[got[j]])
            assert abs(gap) <= BF16_TIE_LOGITS, (f"{name} leaves AR on prompt {i} at token {j}: {got[j]} for "
                                                 f"{want[j]}, {gap:.3f} logits apart (not a rounding tie)")


def test_dropping_unselectable_nodes_changes_no_selection(proxy, monkeypatch):
    """The nodes :func:`selectable` drops (the engine's threshold, :func:`selectable_threshold`) are in no optimal selection: with them dropped (before any
    expert prediction) every cycle verifies the same subtree as with every drafted node priced, and
    calibration learns from the same trials (dropped nodes are still drafted)."""
    import specfit.engine.decoder as decoder
    from specfit.engine.online import OnlineModel

    targets, drafter, prompts = proxy
    spec = targets[32].spec
    cost = get_profile("qwen3-30b-a3b-pcie4").for_layers(len(spec.moe_layers))
    monkeypatch.setattr(UtilityGate, "decide", lambda self, sound_can_draft=None: "draft")  # every cycle drafts
    # the measured host ms enter the objective (level costs): the profile's priors keep both runs' costs equal
    monkeypatch.setattr(OnlineModel, "observe_host", lambda self, levels, level_ms, rest_ms: None)

    def run():
        predictor = get_predictor("recency", num_layers=len(spec.moe_layers), num_experts=spec.num_experts,
                                  top_k=spec.top_k)
        dec = SpecDecoder(targets[32], drafter, "specfit", tree=TreeSettings(32, 6, 4), cost=cost, predictor=predictor)
        targets[32].reset_cache(32)  # both runs start from the same (empty) expert cache
        gens = [dec.generate(p, NEW_TOKENS) for p in prompts[:3] + prompts[10:13]]
        return gens, dec.acceptance

    pruned, cal = run()
    monkeypatch.setattr(decoder, "selectable_threshold", lambda node_ms, rate_lo: -np.inf)  # every node kept
    full, cal_full = run()
    assert sum(c.nodes_pruned for g in pruned for c in g.cycles) > 0  # the bound bites on the proxy
    assert all(c.nodes_pruned == 0 for g in full for c in g.cycles)
    for a, b in zip(pruned, full):
        assert a.output_ids == b.output_ids
        assert [(c.nodes_drafted, c.nodes_verified, c.accepted) for c in a.cycles] == \
               [(c.nodes_drafted, c.nodes_verified, c.accepted) for c in b.cycles]
        np.testing.assert_allclose([c.expected_tokens for c in a.cycles], [c.expected_tokens for c in b.cycles])
    np.testing.assert_array_equal(cal.trials, cal_full.trials)
    np.testing.assert_array_equal(cal.accepted, cal_full.accepted)


@pytest.mark.slow
@pytest.mark.parametrize("slots,profile", [(32, "qwen3-30b-a3b-pcie4"), ("all", "qwen3-30b-a3b-h200")])
def test_solves_the_ratio_bound_skips_change_no_stop_and_no_selection(proxy, monkeypatch, slots, profile):
    """A mid-drafting solve is skipped only when :func:`ratio_upper_bound` shows it could not stop
    drafting: every cycle drafts the same levels and verifies the same subtree as a run that solves
    whenever the looser pre-check passes, with fewer solves. (It also catches a selection kept from an
    earlier level after a further level was paid whose nodes were all dropped: its sunk ms is one level
    short, which made the two runs differ, everything cached.)"""
    import specfit.engine.decoder as decoder
    from specfit.engine.online import OnlineModel

    targets, drafter, prompts = proxy
    spec = targets[slots].spec
    cost = get_profile(profile).for_layers(len(spec.moe_layers))
    monkeypatch.setattr(UtilityGate, "decide", lambda self, sound_can_draft=None: "draft")  # every cycle drafts
    monkeypatch.setattr(OnlineModel, "observe_host", lambda self, levels, level_ms, rest_ms: None)  # equal costs
    select, solves = SpecDecoder._select, []

    def counted(self, *args):
        solves.append(1)
        return select(self, *args)

    monkeypatch.setattr(SpecDecoder, "_select", counted)

    def run():
        predictor = get_predictor("recency", num_layers=len(spec.moe_layers), num_experts=spec.num_experts,
                                  top_k=spec.top_k)
        dec = SpecDecoder(targets[slots], drafter, "specfit", tree=TreeSettings(32, 6, 4), cost=cost, predictor=predictor)
        targets[slots].reset_cache(slots)  # both runs start from the same expert cache
        solves.clear()
        gens = [dec.generate(p, 48) for p in prompts[:2] + prompts[10:12]]  # past the warm-up's depth cap
        return gens, len(solves)

    bounded, n_bounded = run()
    monkeypatch.setattr(decoder, "ratio_upper_bound_unchecked", lambda p, root_ms, node_ms: math.inf)  # solve whenever
    full, n_full = run()
    assert n_bounded < n_full  # the bound bites on the proxy
    for a, b in zip(bounded, full):
        assert a.output_ids == b.output_ids
        assert [(c.levels, c.nodes_verified, c.accepted) for c in a.cycles] == \
               [(c.levels, c.nodes_verified, c.accepted) for c in b.cycles]
        np.testing.assert_allclose([c.expected_tokens for c in a.cycles], [c.expected_tokens for c in b.cycles])


def test_warmup_cycles_draft_one_level_past_the_last_selection(proxy):
    """The decoder tells the online model how deep each drafted cycle's selection verified, and drafts
    no deeper than the warm-up cap (:meth:`OnlineModel.draft_depth`): with every expert resident the
    selections verify deep trees and the cap grows to the full depth."""
    targets, drafter, prompts = proxy
    spec = targets["all"].spec
    cost = get_profile("qwen3-30b-a3b-pcie4").for_layers(len(spec.moe_layers))
    dec = SpecDecoder(targets["all"], drafter, "specfit", tree=TreeSettings(32, 6, 4), cost=cost,
                      predictor=get_predictor("recency", num_layers=len(spec.moe_layers),
                                              num_experts=spec.num_experts, top_k=spec.top_k))
    caps = []
    cap = dec.online.policy.draft_depth
    dec.online.policy.draft_depth = lambda depth: caps.append(cap(depth)) or caps[-1]
    cycles = [c for p in prompts[:2] for c in dec.generate(p, NEW_TOKENS).cycles if c.levels]
    assert len(caps) == len(cycles) and all(c.levels <= k for c, k in zip(cycles, caps))
    assert caps[0] == 6 and 1 < max(caps[1:dec.online.policy.WARMUP]) <= 6  # uncapped, then past deep selections
    assert dec.online.policy.state.selected_depth >= 1


@pytest.mark.parametrize("policy", ["lru", "lfu", "lookahead", "lookahead-lfu"])
def test_ar_twin_prices_what_ar_decoding_pays(proxy, monkeypatch, policy):
    """The AR gate's counterfactual (the AR twin, specfit.engine.twin): the AR ms it gives each cycle's
    committed tokens sum to what AR decoding of the same tokens pays with its own expert cache (the tokens
    the output keeps). Under LRU / LFU, over a generation that drafts every cycle: plain AR's, and the
    drafted generation's own cache would have priced them differently (the pollution the twin keeps out
    of the gate's Ŝ). Under a lookahead cache AR decoding is ``ar+lookahead``; over a generation of AR
    steps (each drafting the lookahead chain, as ar+lookahead does) the twin pays exactly its copies, which
    differ from plain LRU / LFU decoding's."""
    from specfit.engine.twin import ARTwinCache

    _, drafter, prompts = proxy
    d = paths()
    target_config = json.loads((d["target"] / "config.json").read_text())
    aux = check_target(Eagle3Config.from_dict(json.loads((d["eagle3"] / "config.json").read_text())), target_config)

    def fresh(eviction):
        return OffloadedQwen3Moe.from_pretrained(d["target"], cache_slots=24, max_len=1024, eviction=eviction,
                                                 aux_layers=aux)

    base = {"lookahead": "lru", "lookahead-lfu": "lfu"}.get(policy, policy)
    drafting = base == policy
    monkeypatch.setattr(UtilityGate, "decide", lambda self, sound=None: "draft" if drafting else "ar")
    monkeypatch.setattr(UtilityGate, "decide_ahead", lambda self: None)
    twin_ms = root_ms = ar_ms = base_ms = 0.0
    replayed, step = [], ARTwinCache.step
    monkeypatch.setattr(ARTwinCache, "step", lambda self, experts: (replayed.append(m := step(self, experts)), m)[1])
    for p in (prompts[0], prompts[10]):  # fresh caches: AR decoding and the engine start alike
        spec_target = fresh(policy)
        spec = spec_target.spec
        cost = get_profile("qwen3-30b-a3b-h200").for_layers(len(spec.moe_layers))
        predictor = get_predictor("recency", num_layers=len(spec.moe_layers), num_experts=spec.num_experts,
                                  top_k=spec.top_k)
        dec = SpecDecoder(spec_target, drafter, "specfit", tree=TreeSettings(32, 6, 4), cost=cost, predictor=predictor)
        ar = SpecDecoder(fresh(policy), drafter, "ar" if drafting else "ar+lookahead", cost=cost, predictor=predictor)
        replayed.clear()
        g = dec.generate(p, 24)
        a = ar.generate(p, 24)  # the tokens past 24 the last cycle may commit gain nothing
        plain = SpecDecoder(fresh(base), None, "ar", cost=cost).generate(p, 24)
        assert a.output_ids == g.output_ids == plain.output_ids
        if drafting:
            assert all(c.ar_tokens_ms > 0 for c in g.cycles) and max(c.committed for c in g.cycles) > 1
            twin_ms += sum(c.ar_tokens_ms for c in g.cycles)
            root_ms += sum(c.committed * c.ar_step_ms for c in g.cycles)
            ar_ms += sum(cost.cycle_ms(1, c.transferred) for c in a.cycles)
        else:  # each replayed AR step against ar+lookahead's forward of the same token, copy for copy
            steps = [s.tolist() for s in replayed]
            assert len(steps) >= len(g.cycles) - 1 and all(c.committed == 1 for c in g.cycles)
            assert steps == [list(c.transferred) for c in a.cycles[:len(steps)]]
            ar_ms += sum(cost.cycle_ms(1, c.transferred) for c in a.cycles)
            base_ms += sum(cost.cycle_ms(1, c.transferred) for c in plain.cycles)
    if drafting:
        assert twin_ms == pytest.approx(ar_ms, rel=1e-9)
        assert abs(root_ms - ar_ms) > 1e-3 * ar_ms
    else:
        assert abs(base_ms - ar_ms) > 1e-3 * ar_ms  # ar+lookahead is not plain AR here


def test_lookahead_eviction_reads_the_draft_trees_demand_and_keeps_the_output(proxy, monkeypatch):
    """With ``eviction="lookahead"`` a drafted cycle hands the cache the demand of the drafted nodes it
    does not verify (a shadow cycle: every non-root node), each generation starts with none, and the
    greedy output equals AR's (timing only)."""
    from specfit.models.experts import DeviceExpertCache

    _, drafter, prompts = proxy
    d = paths()
    target_config = json.loads((d["target"] / "config.json").read_text())
    aux = check_target(Eagle3Config.from_dict(json.loads((d["eagle3"] / "config.json").read_text())), target_config)
    target = OffloadedQwen3Moe.from_pretrained(d["target"], cache_slots=16, max_len=1024, aux_layers=aux,
                                               eviction="lookahead")
    spec = target.spec
    cost = get_profile("qwen3-30b-a3b-pcie4").for_layers(len(spec.moe_layers))
    predictor = get_predictor("recency", num_layers=len(spec.moe_layers), num_experts=spec.num_experts,
                              top_k=spec.top_k)
    calls = []
    original = DeviceExpertCache.set_lookahead
    monkeypatch.setattr(DeviceExpertCache, "set_lookahead",
                        lambda self, demand: (calls.append(None if demand is None else np.array(demand)),
                                              original(self, demand))[1])
    monkeypatch.setattr(UtilityGate, "decide", lambda self, sound=None: "draft")
    dec = SpecDecoder(target, drafter, "specfit", tree=TreeSettings(32, 6, 4), cost=cost, predictor=predictor)
    ar = SpecDecoder(OffloadedQwen3Moe.from_pretrained(d["target"], cache_slots=16, max_len=1024), None, "ar")
    for p in (prompts[0], prompts[10]):
        calls.clear()
        g = dec.generate(p, 16)
        assert g.output_ids == ar.generate(p, 16).output_ids
        assert calls[0] is None  # the prefill: no demand from the last generation
        demands = [c for c in calls[1:] if c is not None]
        assert demands and all(c.shape == (len(spec.moe_layers), spec.num_experts) and (c >= 0).all() for c in demands)
        assert any(c.sum() > 0 for c in demands)
    assert dec._twin.cache is not None and dec._twin.cache.policy == "lru"  # AR's cache: the base policy


def test_ar_twin_only_where_it_replays_the_runtime_cache_and_follows_a_new_cache(proxy):
    """No twin with fewer slots than a token's experts (the runtime copies a forward's experts in
    rounds there), and the twin follows the cache the target holds now (slots, policy)."""
    _, drafter, prompts = proxy
    d = paths()
    target_config = json.loads((d["target"] / "config.json").read_text())
    aux = check_target(Eagle3Config.from_dict(json.loads((d["eagle3"] / "config.json").read_text())), target_config)
    target = OffloadedQwen3Moe.from_pretrained(d["target"], cache_slots=6, max_len=1024, aux_layers=aux)
    spec = target.spec
    cost = get_profile("qwen3-30b-a3b-h200").for_layers(len(spec.moe_layers))
    predictor = get_predictor("recency", num_layers=len(spec.moe_layers), num_experts=spec.num_experts,
                              top_k=spec.top_k)
    dec = SpecDecoder(target, drafter, "specfit", tree=TreeSettings(32, 6, 4), cost=cost, predictor=predictor)
    assert spec.top_k > 6
    g = dec.generate(prompts[0], 8)
    assert dec._twin.cache is None and all(c.ar_tokens_ms == 0.0 for c in g.cycles)
    target.reset_cache(16, eviction="lfu")
    g = dec.generate(prompts[0], 8)
    assert (dec._twin.cache.slots, dec._twin.cache.policy) == (16, "lfu") and any(c.ar_tokens_ms > 0 for c in g.cycles)
    target.reset_cache(24)
    dec.generate(prompts[0], 8)
    assert (dec._twin.cache.slots, dec._twin.cache.policy) == (24, "lfu")


def test_ar_twin_per_cycle_with_the_gates_ar_steps_in_between(proxy, monkeypatch):
    """Cycle by cycle, with AR steps the gate takes (and does not learn from) between drafted cycles:
    each learned cycle's ``ar_tokens_ms`` equals what plain AR decoding paid for exactly those tokens."""
    from specfit.engine.online import OnlineModel

    _, drafter, prompts = proxy
    d = paths()
    target_config = json.loads((d["target"] / "config.json").read_text())
    aux = check_target(Eagle3Config.from_dict(json.loads((d["eagle3"] / "config.json").read_text())), target_config)
    calls = iter(range(10**6))
    monkeypatch.setattr(UtilityGate, "decide", lambda self, sound=None: "ar" if next(calls) % 3 == 0 else "draft")
    spec_target, ar_target = (OffloadedQwen3Moe.from_pretrained(d["target"], cache_slots=24, max_len=1024,
                                                                aux_layers=aux) for _ in range(2))
    spec = spec_target.spec
    cost = get_profile("qwen3-30b-a3b-h200").for_layers(len(spec.moe_layers))
    predictor = get_predictor("recency", num_layers=len(spec.moe_layers), num_experts=spec.num_experts,
                              top_k=spec.top_k)
    dec = SpecDecoder(spec_target, drafter, "specfit", tree=TreeSettings(32, 6, 4), cost=cost, predictor=predictor)
    g = dec.generate(prompts[1], 32)
    a = SpecDecoder(ar_target, None, "ar", cost=cost).generate(prompts[1], 32)  # the tokens the output keeps
    per_token = [cost.cycle_ms(1, c.transferred) for c in a.cycles]
    t, checked, after_ar = 0, 0, 0
    for i, c in enumerate(g.cycles):
        if c.ar_tokens_ms > 0:
            assert c.ar_tokens_ms == pytest.approx(sum(per_token[t:t + c.committed]), rel=1e-9)
            checked += 1
            after_ar += i > 0 and g.cycles[i - 1].decision == "ar"
        t += c.committed
    assert checked >= 5 and after_ar >= 2


def test_a_calibrated_cycle_drafts_and_gains_only_what_the_output_keeps(proxy, monkeypatch):
    """Near the end of a generation a calibrated method drafts at most one level less than the new tokens
    still kept (at least one), and each cycle is credited (``ar_tokens_ms``, the gain Ŝ learns) with what
    plain AR decoding pays for the tokens the output keeps: one that commits past ``max_new_tokens``
    (a one-level draft with one new token left) gains nothing for the token dropped."""
    _, drafter, prompts = proxy
    d = paths()
    target_config = json.loads((d["target"] / "config.json").read_text())
    aux = check_target(Eagle3Config.from_dict(json.loads((d["eagle3"] / "config.json").read_text())), target_config)
    monkeypatch.setattr(UtilityGate, "decide", lambda self, sound=None: "draft")

    def run(method, budget):
        target = OffloadedQwen3Moe.from_pretrained(d["target"], cache_slots=24, max_len=1024, aux_layers=aux)
        spec = target.spec
        cost = get_profile("qwen3-30b-a3b-h200").for_layers(len(spec.moe_layers))
        predictor = get_predictor("recency", num_layers=len(spec.moe_layers), num_experts=spec.num_experts,
                                  top_k=spec.top_k)
        dec = SpecDecoder(target, drafter if method == "specfit" else None, method, tree=TreeSettings(32, 6, 4),
                          cost=cost, predictor=predictor)
        return dec.generate(prompts[0], budget), cost

    past = capped = 0
    for budget in (1, 2, 3, 5, 8):
        g, cost = run("specfit", budget)
        a, _ = run("ar", budget)
        assert g.output_ids == a.output_ids
        per_token = [cost.cycle_ms(1, c.transferred) for c in a.cycles]
        t = 0
        for c in g.cycles:
            assert 1 <= c.levels <= max(budget - t - 1, 1)
            assert c.ar_tokens_ms == pytest.approx(sum(per_token[t:t + c.committed]), rel=1e-9)
            past += t + c.committed > budget
            capped += budget - t - 1 < 6
            t += c.committed
    assert past >= 1 and capped >= 5


@pytest.mark.slow
def test_the_gates_decision_made_during_an_ar_steps_verify_is_the_same(proxy, monkeypatch):
    """After an AR step the engine makes the next decision while the verify runs
    (OnlineModel.decide_ahead): the same decisions and outputs as deciding at the cycle's start
    (host CPU time frozen: the gate prices measured host ms), and no AR-twin replay is left for the
    end of a generation whose last cycle is an AR step (nothing would read it)."""
    from specfit.engine.clock import FrozenClock
    from specfit.engine.online import OnlineModel

    targets, drafter, prompts = proxy
    spec = targets[32].spec
    cost = get_profile("qwen3-30b-a3b-pcie4").for_layers(len(spec.moe_layers))

    def run():
        online, out = OnlineModel(6), []
        predictor = get_predictor("recency", num_layers=len(spec.moe_layers), num_experts=spec.num_experts,
                                  top_k=spec.top_k)
        for p in prompts[:10]:
            targets[32].reset_cache(32)  # each generation from an empty expert cache, as in the evaluation
            dec = SpecDecoder(targets[32], drafter, "specfit", tree=TreeSettings(32, 6, 4), cost=cost,
                              predictor=predictor, online=online, clock=FrozenClock())
            g = dec.generate(p, 24)
            assert dec._twin.cache is not None and dec._carry.twin_path is None
            out.append((g.output_ids, [c.decision for c in g.cycles], [c.nodes_verified for c in g.cycles]))
        return out

    ahead = run()
    monkeypatch.setattr(UtilityGate, "decide_ahead", lambda self: None)
    assert run() == ahead
    decisions = [d for _, ds, _ in ahead for d in ds]
    assert decisions.count("ar") >= 10 and decisions.count("draft") >= UtilityGate.WARMUP + UtilityGate.MIN_DRAFTED
    assert any(ds[-1] == "ar" for _, ds, _ in ahead)
