"""Draft policies (specfit.engine.policy): the interface the engine reads, the fixed policies, the AR
gate's state as a typed object, and what the engine learned saved and restored as plain JSON."""

import json

import numpy as np
import pytest

from specfit.core.errors import SpecFitInputError
from specfit.engine.online import OnlineModel
from specfit.engine.policy import (AlwaysDraft, DraftPolicy, GateState, NeverDraft, ShadowState, UtilityGate,
                                   make_policy, policy_from_json)


def test_policies_by_name():
    assert isinstance(make_policy("gate"), UtilityGate)
    assert isinstance(make_policy("always"), AlwaysDraft) and isinstance(make_policy("never"), NeverDraft)
    mine = NeverDraft()
    assert make_policy(mine) is mine
    with pytest.raises(SpecFitInputError) as err:
        make_policy("sometimes")
    assert err.value.field == "policy"


def test_fixed_policies_never_change_their_answer():
    asked = []
    for policy, answer in ((AlwaysDraft(), "draft"), (NeverDraft(), "ar")):
        for i in range(30):
            assert policy.decide(lambda: asked.append(1) or False) == answer
            policy.observe_selection(draft_nodes=i % 3, selected_depth=i % 4)
            policy.observe_cycle(gain_ms=1.0, spent_ms=100.0)
            assert policy.draft_depth(6) == 6 and policy.speedup is None
            policy.decide_ahead()
            assert not policy.take_ar_ahead() and policy.decided_ahead() is None
    assert not asked  # the sound bound is never priced for them


def test_the_gate_drafts_through_the_warm_up_then_follows_its_measured_speedup():
    gate = UtilityGate()
    warm = gate.WARMUP + gate.MIN_DRAFTED
    for _ in range(warm):
        assert gate.decide() == "draft"
        gate.observe_selection(draft_nodes=2, selected_depth=2)
        gate.observe_cycle(gain_ms=10.0, spent_ms=20.0)  # drafting takes twice AR's time
    assert gate.speedup == pytest.approx(0.5) and gate.state.drafted == warm
    decisions = [gate.decide() for _ in range(gate.EXPLORE_FIRST + 1)]
    assert decisions == ["ar"] * gate.EXPLORE_FIRST + ["explore"]
    assert gate.state.explorations == 1


def test_the_gate_asks_the_sound_bound_only_when_drafting_measures_faster():
    gate = UtilityGate()
    for _ in range(gate.WARMUP + gate.MIN_DRAFTED):
        gate.decide()
        gate.observe_selection(draft_nodes=2, selected_depth=2)
        gate.observe_cycle(gain_ms=30.0, spent_ms=20.0)
    assert gate.asks_sound_bound()
    assert gate.decide(lambda: True) == "draft" and gate.sound_said_draft()
    assert gate.decide(lambda: False) == "ar" and not gate.sound_said_draft()


def test_the_warm_up_caps_the_depth_one_level_past_the_deepest_verified_node():
    gate = UtilityGate()
    assert gate.draft_depth(6) == 6  # no drafted cycle yet
    gate.observe_selection(draft_nodes=1, selected_depth=1)
    assert gate.draft_depth(6) == 2
    for _ in range(gate.WARMUP + gate.MIN_DRAFTED):
        gate.observe_selection(draft_nodes=0, selected_depth=0)
    assert gate.draft_depth(6) == 6  # lifted after the warm-up


def _learned_model() -> OnlineModel:
    """An online model after a few drafted cycles, AR steps and shadow cycles of every kind."""
    rng = np.random.default_rng(0)
    on = OnlineModel(depth=4)
    on.policy.set_shadowing(True)
    for i in range(40):
        decision = on.policy.decide(lambda: bool(i % 2))
        if decision == "shadow":
            on.policy.observe_shadow_selection(draft_nodes=i % 3)
            on.policy.observe_shadow(draft_nodes=i % 3, cycle_ms=12.0 + i, ar_tokens_ms=14.0)
        pred, true = rng.integers(0, 4, size=2), rng.integers(0, 4, size=2)
        on.observe(root_predicted_new=pred, root_true_new=true, selected_predicted_new=pred + 1,
                   transferred=true + 2, draft_nodes=i % 3, committed=1 + i % 3, cycle_ms=20.0 + i, ar_ms=9.0)
        on.observe_host(2, 1.5 + 0.1 * i, 0.7)
        on.policy.observe_ar_h2d(3.0 + i)
        on.min_expert_ms.append(0.25 * i)
        q, depth = rng.uniform(0.05, 1.0, size=6), rng.integers(1, 5, size=6)
        on.acceptance.update(q, depth, rng.uniform(size=6) < q)
    return on


def test_what_the_engine_learned_round_trips_through_plain_json():
    on = _learned_model()
    data = on.to_json()
    text = json.dumps(data, allow_nan=False)  # plain JSON: no NaN, no infinity
    back = OnlineModel.from_json(json.loads(text))
    assert back.to_json() == data
    assert back.policy.state == on.policy.state and back.policy.shadow == on.policy.shadow
    q, depth = np.linspace(0.01, 0.99, 9), np.array([1, 2, 3, 4, 1, 2, 3, 4, 4])
    np.testing.assert_allclose(back.acceptance.conditional(q, depth), on.acceptance.conditional(q, depth), rtol=1e-12)
    assert back.host_level_ms(0.0) == on.host_level_ms(0.0) and back.host_cycle_ms() == on.host_cycle_ms()
    np.testing.assert_array_equal(back.root_correction(), on.root_correction())
    # the restored model decides as the original does from here on
    for i in range(30):
        sound = bool(i % 3)
        assert back.policy.decide(lambda: sound) == on.policy.decide(lambda: sound)
        for m in (on, back):
            m.observe(root_predicted_new=[1, 1], root_true_new=[2, 1], selected_predicted_new=[2, 2],
                      transferred=[3, 3], draft_nodes=1, committed=2, cycle_ms=15.0, ar_ms=10.0)


def test_a_fresh_model_and_the_fixed_policies_round_trip():
    for policy in ("gate", "always", "never"):
        on = OnlineModel(depth=3, policy=policy)
        back = OnlineModel.from_json(json.loads(json.dumps(on.to_json(), allow_nan=False)))
        assert back.to_json() == on.to_json() and back.policy.name == policy


def test_bad_saved_state_gets_one_clear_error():
    data = _learned_model().to_json()
    cases = [({**data, "format": 99}, "format"),
             ({**data, "host_ms": [1.0, 2.0]}, "host_ms"),
             ({**data, "acceptance": {**data["acceptance"], "trials": [[1.0]]}}, "trials"),
             ({**data, "corrections": {**data["corrections"], "root_weight": float("nan")}}, "root_weight"),
             ({**data, "policy": {**data["policy"], "state": {**data["policy"]["state"], "drafted": "many"}}},
              "policy.state.drafted"),
             ({**data, "policy": {"policy": "sometimes"}}, "policy")]
    for bad, field in cases:
        with pytest.raises(SpecFitInputError) as err:
            OnlineModel.from_json(bad)
        assert err.value.field == field


def test_queued_learning_is_not_saved():
    on = OnlineModel(depth=3)
    on.defer(lambda: None)
    with pytest.raises(SpecFitInputError) as err:
        on.to_json()
    assert err.value.field == "deferred"


def test_the_gate_state_objects_stay_small():
    """State that survives cycles is typed and split by concern (no bag of 30 fields)."""
    from dataclasses import fields

    assert len(fields(GateState)) <= 15 and len(fields(ShadowState)) <= 15
    assert issubclass(UtilityGate, DraftPolicy) and policy_from_json(UtilityGate().to_json()).state == GateState()


def _gate_after_warm_up(speedup: float, resident: bool = False) -> UtilityGate:
    """A gate whose warm-up measured ``speedup`` (every drafted cycle verified draft nodes)."""
    gate = UtilityGate()
    gate.set_resident(resident)
    for _ in range(gate.WARMUP + gate.MIN_DRAFTED):
        assert gate.decide() == "draft"
        gate.observe_selection(draft_nodes=2, selected_depth=2)
        gate.observe_cycle(gain_ms=10.0 * speedup, spent_ms=10.0)
    return gate


def test_with_every_expert_resident_an_exploration_drafts_one_cycle():
    def decisions(resident):
        gate = _gate_after_warm_up(0.5, resident)
        return "".join(gate.decide()[0] for _ in range(30))

    assert decisions(False) == "aaaa" + "eeee" + "a" * 8 + "eeee" + "a" * 10
    assert decisions(True) == "aaaa" + "e" + "a" * 8 + "e" + "a" * 16
    for fixed in (AlwaysDraft(), NeverDraft()):  # the fixed policies ignore it
        fixed.set_resident(True)
        assert fixed.decide() == ("draft" if isinstance(fixed, AlwaysDraft) else "ar")


def test_explorations_that_lose_grow_their_interval_past_explore_max_within_the_cost_share():
    def intervals(speedup, resident=False):
        gate, seen = _gate_after_warm_up(speedup, resident), []
        for _ in range(6000):
            gate.decide()
            if not seen or seen[-1] != gate.state.explore_after:
                seen.append(gate.state.explore_after)
        return seen

    g = UtilityGate
    # Ŝ = 0.5: a burst of 4 loses ~4 AR steps; within EXPLORE_COST of the interval needs 2000: capped at 8 EXPLORE_MAX
    assert intervals(0.5) == [4, 8, 16, 32, 64, 128, 256, 512, 1024] and 8 * g.EXPLORE_MAX == 1024
    # Ŝ = 0.9: 4 (1/0.9 - 1) / 0.002 = 222.2 -> 223 AR steps; one resident cycle: 55.6, under EXPLORE_MAX
    assert intervals(0.9) == [4, 8, 16, 32, 64, 128, 223]
    assert intervals(0.9, resident=True) == [4, 8, 16, 32, 64, 128]
    assert _gate_after_warm_up(1.2).explore_max() == g.EXPLORE_MAX  # drafting pays: no loss to bound
