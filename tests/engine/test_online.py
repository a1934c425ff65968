"""The engine's online model (specfit.engine.online): the predictor's error priced into the cost
model, and the AR gate's measured speedup with bounded exploration."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.cost import CostModel
from specfit.engine.online import OnlineModel
from specfit.engine.policy import UtilityGate

COST = CostModel(6.0, 0.1, (1.0, 2.0))  # two MoE layers, per-layer expert ms


def test_corrected_cost_prices_the_predictors_misses():
    on = OnlineModel(depth=4)
    assert on.corrected_cost(COST, [1, 2]) is COST  # nothing learned yet (root: 1 + 2 * 2 = 5 ms)
    # the root really needed one more uncached expert per layer than predicted; the selection's two draft
    # nodes brought 3 + 1 experts the prediction did not have (per layer 0, 1)
    on.observe(root_predicted_new=[1, 1], root_true_new=[2, 2], selected_predicted_new=[1, 2],
               transferred=[5, 4], draft_nodes=2, committed=2, cycle_ms=30.0, ar_ms=20.0)
    np.testing.assert_allclose(on.root_correction(), [1.0, 1.0])
    np.testing.assert_allclose(on.node_correction(), [(5 - 2 - 0) / 2, (4 - 2 - 1) / 2])
    c = on.corrected_cost(COST, [1, 2])
    assert c.fixed_ms == pytest.approx(6.0 + 1.0 * 1 + 2.0 * 1)
    assert c.per_node_ms == pytest.approx(0.1 + 1.0 * 1.5 + 2.0 * 0.5)
    assert c.per_expert_ms == COST.per_expert_ms and c.name == COST.name


def _fresh_corrected(on: OnlineModel, cost: CostModel, root_new) -> tuple[float, float]:
    """corrected_cost's fixed_ms and per_node_ms computed from the corrections as they are now."""
    e, m = on.root_correction(), on.node_correction()
    w = np.asarray(cost.per_expert_ms, dtype=np.float64)
    root_ms = float(w @ np.asarray(root_new, dtype=np.float64))
    fixed = cost.fixed_ms + (max(float(w @ e), -root_ms) if e is not None else 0.0)
    per_node = cost.per_node_ms + (max(0.0, float(w @ m)) if m is not None else 0.0)
    fixed = max(fixed, 0.0)
    return (fixed if fixed + per_node > 0 else cost.fixed_ms), per_node


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_corrected_cost_keeps_its_terms_only_until_the_corrections_change(data):
    """weighted_corrections' memo (filled in the learning slot, or by corrected_cost itself) gives the
    floats a fresh computation gives, after every observe, AR step or drafted cycle, and after a memo
    asked for with another cost's per-expert array."""
    on = OnlineModel(depth=4)
    other = CostModel(3.0, 0.05, (0.5, 4.0))
    counts = st.lists(st.integers(0, 6), min_size=2, max_size=2)
    for _ in range(data.draw(st.integers(1, 6))):
        pred, true = data.draw(counts), data.draw(counts)
        if data.draw(st.booleans()):  # a drafted cycle: the node correction too
            on.observe(root_predicted_new=pred, root_true_new=true, selected_predicted_new=data.draw(counts),
                       transferred=data.draw(counts), draft_nodes=data.draw(st.integers(0, 3)), committed=1,
                       cycle_ms=10.0, ar_ms=7.0)
        else:  # an AR step: the root's error alone
            on.observe(root_predicted_new=pred, root_true_new=true)
        for cost in data.draw(st.lists(st.sampled_from([COST, other]), max_size=3)):  # the learning slot's
            on.weighted_corrections(cost.per_expert_array(2))
        root_new = data.draw(counts)
        for cost in (COST, other, COST):
            c = on.corrected_cost(cost, root_new)
            assert (c.fixed_ms, c.per_node_ms) == _fresh_corrected(on, cost, root_new)


def test_corrections_never_make_a_cycle_cheaper_than_its_verified_nodes():
    on = OnlineModel(depth=4)
    # the predictor over-predicts: 3 predicted uncached root experts per layer, none really uncached
    on.observe(root_predicted_new=[3, 3], root_true_new=[0, 0], selected_predicted_new=[6, 6],
               transferred=[0, 0], draft_nodes=3, committed=1, cycle_ms=10.0, ar_ms=6.1)
    c = on.corrected_cost(COST, [2, 0])  # this cycle's root: 2 ms of predicted experts
    assert c.fixed_ms == pytest.approx(4.0)  # T(root alone) = 4 + 0.1 + 2: a root with no uncached expert
    c = on.corrected_cost(COST, [3, 3])  # 1.0 * 3 + 2.0 * 3 ms
    assert c.fixed_ms == pytest.approx(0.0)  # -9 ms would make fixed_ms negative: corrected only to 0
    assert c.fixed_ms + c.per_node_ms + 9.0 >= COST.fixed_ms + COST.per_node_ms
    assert c.per_node_ms == pytest.approx(0.1)  # a draft node costs at least per_node_ms (stop rule's proof)


def test_decayed_sums_follow_a_change():
    on = OnlineModel(depth=4)
    for _ in range(200):
        on.observe(root_predicted_new=[0, 0], root_true_new=[4, 4])
    for _ in range(200):
        on.observe(root_predicted_new=[0, 0], root_true_new=[0, 0])
    assert on.root_correction().max() < 0.1  # the old error is forgotten (DECAY per observation)


def test_gate_drafts_until_measured_then_by_measured_speedup():
    on = OnlineModel(depth=4)
    assert on.policy.speedup is None and on.policy.decide() == "draft"
    for _ in range(on.policy.WARMUP + on.policy.MIN_DRAFTED - 1):  # drafting worse than AR: 1.2 tokens in 1.5 AR steps' time
        on.observe(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
                   transferred=[0, 0], draft_nodes=1, committed=1.2, cycle_ms=15.0, ar_ms=10.0)
        assert on.policy.decide() == "draft"  # learning, then measured but not trusted yet
    on.observe(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
               transferred=[0, 0], draft_nodes=1, committed=1.2, cycle_ms=15.0, ar_ms=10.0)
    assert on.policy.speedup == pytest.approx(1.2 * 10 / 15)
    seq = "".join(on.policy.decide()[0] for _ in range(40))
    assert seq == "aaaa" + "eeee" + "a" * 8 + "eeee" + "a" * 16 + "eeee"  # bursts of EXPLORE_BURST, doubling gaps
    # an exploration that finds drafting better: the gate drafts again and exploration resets
    for _ in range(30):
        on.observe(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
                   transferred=[0, 0], draft_nodes=3, committed=3, cycle_ms=15.0, ar_ms=10.0)
    assert on.policy.speedup > 1 and on.policy.decide() == "draft" and on.policy.state.explore_after == on.policy.EXPLORE_FIRST


def test_gate_respects_the_sound_bound_and_calls_it_only_when_drafting_pays():
    on = OnlineModel(depth=4)
    for _ in range(on.policy.WARMUP + on.policy.MIN_DRAFTED):
        on.observe(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
                   transferred=[0, 0], draft_nodes=3, committed=3, cycle_ms=15.0, ar_ms=10.0)
    assert on.policy.state.sound_said_draft  # before any answer: the engine may launch the first level before asking
    assert on.policy.decide(lambda: False) == "ar"  # Ŝ > 1, but no draft can beat AR this cycle within the model
    assert not on.policy.state.sound_said_draft
    assert on.policy.decide(lambda: True) == "draft" and on.policy.state.sound_said_draft

    def boom():
        raise AssertionError("the sound bound was computed although Ŝ <= 1")

    worse = OnlineModel(depth=4)
    for _ in range(worse.policy.WARMUP + worse.policy.MIN_DRAFTED):
        worse.observe(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
                      transferred=[0, 0], draft_nodes=1, committed=1, cycle_ms=15.0, ar_ms=10.0)
    assert worse.policy.decide(boom) == "ar"


def test_exploration_share_is_bounded():
    on = OnlineModel(depth=4)
    for _ in range(on.policy.WARMUP + on.policy.MIN_DRAFTED):
        on.observe(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
                   transferred=[0, 0], draft_nodes=1, committed=1, cycle_ms=15.0, ar_ms=10.0)
    n = 5000
    explored = sum(on.policy.decide() == "explore" for _ in range(n))
    # after the doubling, one burst per EXPLORE_MAX AR steps
    assert explored <= on.policy.EXPLORE_BURST * (n / on.policy.EXPLORE_MAX + 8)


def test_corrected_cost_stays_a_valid_cost_model():
    """A fitted cost model may have per_node_ms = 0 (specfit.core.cost.calibrate); the root's correction
    must not take fixed_ms to 0 with it (every cycle takes time)."""
    fitted = CostModel(0.5, 0.0, (1.0, 2.0))
    on = OnlineModel(depth=4)
    on.observe(root_predicted_new=[3, 3], root_true_new=[0, 0])
    c = on.corrected_cost(fitted, [3, 3])  # 9 ms
    assert c.fixed_ms + c.per_node_ms > 0 and c.fixed_ms == 0.5


def test_a_host_regime_profile_gets_the_draft_nodes_correction_outside_its_max():
    from specfit.core.cost import HOST_PROFILES

    host = next(iter(HOST_PROFILES.values())).for_layers(2)
    on = OnlineModel(depth=4)
    on.observe(root_predicted_new=[1, 1], root_true_new=[2, 2])
    assert on.corrected_cost(host, [1, 1]) is host  # the root's error alone: the AR step pays it too
    # a drafted cycle of 2 draft nodes whose verify computed 3 + 1 host experts beyond the root's,
    # where the selection predicted 1 + 0: 1.5 missed experts per draft node, summed over layers
    on.observe(root_predicted_new=[1, 1], root_true_new=[1, 1], selected_predicted_new=[2, 1],
               transferred=[4, 2], draft_nodes=2, committed=2, cycle_ms=30.0, ar_ms=12.0)
    got = on.corrected_cost(host, [1, 1])
    per_expert = host.host_per_expert_ms + host.host_per_row_ms
    assert got.node_extra_ms == pytest.approx(24 * per_expert * 1.5)          # R / L = 48 / 2 real layers each
    assert got.cycle_ms(3, [2, 2]) == pytest.approx(host.cycle_ms(3, [2, 2]) + 2 * got.node_extra_ms)
    assert got.min_node_ms == got.node_extra_ms                                 # the stop rule's per-node bound
    on.observe(root_predicted_new=[1, 1], root_true_new=[1, 1], selected_predicted_new=[9, 9],
               transferred=[1, 1], draft_nodes=2, committed=2, cycle_ms=30.0, ar_ms=12.0)
    assert on.corrected_cost(host, [1, 1]).node_extra_ms >= 0.0                # over-prediction: never below 0


def test_host_costs_are_measured_means_with_the_profile_as_prior():
    on = OnlineModel(depth=4)
    assert on.host_level_ms(0.6) == 0.6 and on.host_cycle_ms() == 0.0  # nothing measured: the prior
    on.observe_host(levels=4, level_ms=2.0, rest_ms=1.0)
    assert on.host_level_ms(0.6) == pytest.approx(0.5) and on.host_cycle_ms() == pytest.approx(1.0)
    on.observe_host(levels=2, level_ms=2.0, rest_ms=3.0)  # decayed sums: the older cycle weighs DECAY
    d = OnlineModel.DECAY
    assert on.host_level_ms(0.6) == pytest.approx((2.0 * d + 2.0) / (4 * d + 2))
    assert on.host_cycle_ms() == pytest.approx((1.0 * d + 3.0) / (d + 1))



def test_warmup_cycles_are_not_measured():
    """The first WARMUP drafted cycles (acceptance and the predictor's error still being learned) do not
    enter Ŝ: a bad start does not stop drafting that pays once learned."""
    on = OnlineModel(depth=4)
    for _ in range(on.policy.WARMUP):  # learning: drafting measured at 0.5x AR
        on.observe(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
                   transferred=[0, 0], draft_nodes=1, committed=1, cycle_ms=20.0, ar_ms=10.0)
        assert on.policy.decide() == "draft"
    assert on.policy.speedup is None
    for _ in range(on.policy.MIN_DRAFTED):  # learned: 1.2x AR
        on.observe(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
                   transferred=[0, 0], draft_nodes=2, committed=2.4, cycle_ms=20.0, ar_ms=10.0)
        assert on.policy.speedup == pytest.approx(1.2)  # the (WARMUP + 1)-th drafted cycle is the first in Ŝ
    assert on.policy.decide() == "draft"


def test_near_break_even_keeps_exploring_clearly_worse_backs_off():
    def gate(committed):
        on = OnlineModel(depth=4)
        for _ in range(on.policy.WARMUP + on.policy.MIN_DRAFTED):
            on.observe(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
                       transferred=[0, 0], draft_nodes=1, committed=committed, cycle_ms=10.0, ar_ms=10.0)
        return "".join(on.policy.decide()[0] for _ in range(40))

    # bursts of EXPLORE_BURST exploring cycles (each verifies draft nodes here)
    near = gate(0.97)  # Ŝ = 0.97 >= EXPLORE_MARGIN: one burst every EXPLORE_FIRST * EXPLORE_BURST AR steps
    assert near == "aaaa" + "eeee" + "a" * 16 + "eeee" + "a" * 12
    assert gate(0.5) == "aaaa" + "eeee" + "a" * 8 + "eeee" + "a" * 16 + "eeee"  # Ŝ = 0.5: doubling


def test_an_exploring_burst_ends_when_drafting_pays_or_verifies_the_root_alone():
    on = OnlineModel(depth=4)
    for _ in range(on.policy.WARMUP + on.policy.MIN_DRAFTED):
        on.observe(root_predicted_new=[0], root_true_new=[0], selected_predicted_new=[0], transferred=[0],
                   draft_nodes=1, committed=0.9, cycle_ms=10.0, ar_ms=10.0)
    assert "".join(on.policy.decide()[0] for _ in range(6)) == "aaaaee"
    on.observe(root_predicted_new=[0], root_true_new=[0], selected_predicted_new=[0], transferred=[0],
               draft_nodes=0, committed=1, cycle_ms=10.0, ar_ms=9.0)  # the root alone: the burst ends
    assert on.policy.decide() == "ar" and on.policy.state.burst_left == 0
    # its last cycle verified the root alone: the interval doubles (4 -> 8) once that cycle is learned
    assert "".join(on.policy.decide()[0] for _ in range(8)) == "a" * 7 + "e" and on.policy.state.explore_after == 8
    for _ in range(3):  # drafting now pays: the gate drafts, the burst is over
        on.observe(root_predicted_new=[0], root_true_new=[0], selected_predicted_new=[0], transferred=[0],
                   draft_nodes=3, committed=4, cycle_ms=10.0, ar_ms=10.0)
    assert on.policy.speedup > 1 and on.policy.decide() == "draft" and on.policy.state.burst_left == 0


def test_explorations_that_verify_the_root_alone_back_off_near_break_even():
    on = OnlineModel(depth=4)
    for _ in range(on.policy.WARMUP + on.policy.MIN_DRAFTED):  # Ŝ = 0.97, but every drafted cycle verified the root alone
        on.observe(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
                   transferred=[0, 0], draft_nodes=0, committed=1, cycle_ms=10.0, ar_ms=9.7)
    assert on.policy.speedup == pytest.approx(0.97) and not on.policy.state.verified_draft
    assert "".join(on.policy.decide()[0] for _ in range(40)) == "aaaae" + "a" * 8 + "e" + "a" * 16 + "e" + "a" * 9
    # an exploration that verifies draft nodes again restores the short interval
    on.observe(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
               transferred=[0, 0], draft_nodes=2, committed=1.0, cycle_ms=10.0, ar_ms=9.7)
    assert on.policy.state.verified_draft and on.policy.speedup >= on.policy.EXPLORE_MARGIN
    gap = on.policy.state.explore_after - on.policy.state.skips
    assert "".join(on.policy.decide()[0] for _ in range(gap + 1)) == "a" * gap + "e"  # a burst, draft nodes verified
    assert "".join(on.policy.decide()[0] for _ in range(5)) == "eeeaa"  # over; its outcome sets the interval
    assert on.policy.state.explore_after == on.policy.EXPLORE_FIRST * on.policy.EXPLORE_BURST


def test_warmup_drafts_one_level_past_the_last_selection():
    """During the warm-up a drafted cycle drafts at most one level deeper than the last drafted cycle's
    selection verified (all levels on the first); after it, every level."""
    on = OnlineModel(depth=6)
    assert on.policy.draft_depth(6) == 6  # nothing selected yet
    kw = dict(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
              transferred=[0, 0], cycle_ms=20.0, ar_ms=10.0)
    on.observe(draft_nodes=0, committed=1, selected_depth=0, **kw)  # the root alone
    assert on.policy.draft_depth(6) == 1
    on.observe(draft_nodes=3, committed=3, selected_depth=3, **kw)
    assert on.policy.draft_depth(6) == 4 and on.policy.draft_depth(2) == 2
    on.observe(draft_nodes=6, committed=4, selected_depth=6, **kw)
    assert on.policy.draft_depth(6) == 6
    on.observe(draft_nodes=0, committed=1, selected_depth=0, **kw)
    while on.policy.state.drafted < on.policy.WARMUP + on.policy.MIN_DRAFTED:
        assert on.policy.draft_depth(6) == 1
        on.observe(draft_nodes=0, committed=1, selected_depth=0, **kw)
    assert on.policy.draft_depth(6) == 6  # the warm-up is over


def test_counting_a_drafted_cycle_first_then_learning_it_is_learning_it_at_once():
    """observe_selection right after the verify, then observe(counted=True) (the engine's order: the
    learning runs during the next verify) leaves the state of one observe: every drafted cycle counted
    once, the warm-up's exclusion from Ŝ unchanged."""
    def cycles(on, split):
        for i in range(UtilityGate.WARMUP + 3):
            nodes, depth = i % 3, min(i % 3, 2)
            if split:
                on.policy.observe_selection(nodes, depth)
                assert on.policy.state.drafted == i + 1 and on.policy.state.verified_draft == (nodes > 0) and on.policy.state.selected_depth == depth
            on.observe(root_predicted_new=[1, 0], root_true_new=[1, 1], selected_predicted_new=[2, 1],
                       transferred=[3, 1], draft_nodes=nodes, committed=1 + nodes, cycle_ms=10.0 + i,
                       ar_ms=6.0, selected_depth=depth, counted=split)
        return on

    a, b = cycles(OnlineModel(depth=4), False), cycles(OnlineModel(depth=4), True)
    assert a.policy.state.drafted == b.policy.state.drafted == UtilityGate.WARMUP + 3
    assert a.policy.state.spent_ms > 0 and a.policy.speedup == pytest.approx(b.policy.speedup) and a.policy.state.spent_ms == pytest.approx(b.policy.state.spent_ms)
    np.testing.assert_allclose(a.node_correction(), b.node_correction())
    assert (a.policy.state.verified_draft, a.policy.state.selected_depth) == (b.policy.state.verified_draft, b.policy.state.selected_depth)


def test_speedup_prices_the_committed_tokens_as_ar_decoding_would():
    """Ŝ's gain is AR decoding's ms for a cycle's tokens when the engine knows it (the AR twin), else τ
    AR steps of the root: the same cycles give Ŝ > 1 or < 1 by which counterfactual prices them."""
    twin, root = OnlineModel(depth=4), OnlineModel(depth=4)
    for _ in range(twin.policy.WARMUP + twin.policy.MIN_DRAFTED):  # 2 tokens in 15 ms; the root's AR step 10 ms in the
        kw = dict(root_predicted_new=[0, 0], root_true_new=[0, 0], selected_predicted_new=[0, 0],
                  transferred=[0, 0], draft_nodes=1, committed=2, cycle_ms=15.0, ar_ms=10.0)
        root.observe(**kw)  # engine's cache, but AR decoding's own cache would have paid 7 ms per token
        twin.observe(**kw, ar_tokens_ms=14.0)
    assert root.policy.speedup == pytest.approx(20 / 15) and root.policy.decide() == "draft"
    assert twin.policy.speedup == pytest.approx(14 / 15) and twin.policy.decide() == "ar"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.2, 2.0), st.integers(0, 3), st.booleans()), min_size=1, max_size=120))
def test_deciding_ahead_after_an_ar_step_decides_as_at_the_next_cycle(cycles):
    """The engine calls decide_ahead while an AR step verifies; every decision, and every call of the
    sound bound, is the one decide() makes without it. Drawn: per cycle the measured speedup of a
    drafted cycle, its verified draft nodes, and the sound bound's answer."""
    def run(ahead: bool):
        on, out, asked = OnlineModel(depth=4), [], []
        for ratio, nodes, sound in cycles:
            d = on.policy.decide(lambda: asked.append(len(out)) or sound)
            out.append(d)
            if d == "ar":
                if ahead:
                    on.policy.decide_ahead()
            else:
                on.observe(root_predicted_new=[0], root_true_new=[0], selected_predicted_new=[0], transferred=[0],
                           draft_nodes=nodes, committed=ratio, cycle_ms=10.0, ar_ms=10.0)
        out.append(on.policy.decide(lambda: asked.append(-1) or True))  # the one decided ahead, if any
        return out, asked, (on.policy.state.skips, on.policy.state.explore_after, on.policy.state.burst_left, on.policy.state.explorations)

    assert run(True) == run(False)


def test_nothing_is_decided_ahead_where_the_sound_bound_is_needed():
    on = OnlineModel(depth=4)
    on.policy.decide_ahead()
    assert on.policy.state.ahead == "draft" and on.policy.decide(lambda: pytest.fail("not consulted")) == "draft" and on.policy.state.ahead is None
    for _ in range(on.policy.WARMUP + on.policy.MIN_DRAFTED):  # drafting pays: Ŝ = 2
        on.observe(root_predicted_new=[0], root_true_new=[0], selected_predicted_new=[0], transferred=[0],
                   draft_nodes=2, committed=2, cycle_ms=10.0, ar_ms=10.0)
    on.policy.decide_ahead()
    assert on.policy.state.ahead is None and on.policy.decide(lambda: False) == "ar"  # the bound, with this cycle's root, said no


def test_an_ar_step_decided_ahead_is_taken_once():
    """take_ar_ahead consumes an AR step decided ahead (what decide would return) and nothing else."""
    on = OnlineModel(depth=4)
    on.policy.decide_ahead()  # "draft": not an AR step, left for decide
    assert not on.policy.take_ar_ahead() and on.policy.state.ahead == "draft"
    on.policy.state.ahead = None
    for _ in range(on.policy.WARMUP + on.policy.MIN_DRAFTED):  # drafting measured at 0.5 x AR: AR steps
        on.observe(root_predicted_new=[0], root_true_new=[0], selected_predicted_new=[0], transferred=[0],
                   draft_nodes=1, committed=1, cycle_ms=20.0, ar_ms=10.0)
    on.policy.decide_ahead()
    assert on.policy.state.ahead == "ar" and on.policy.take_ar_ahead() and on.policy.state.ahead is None and not on.policy.take_ar_ahead()


def gate_in_engine_order(on, cycles, drafted_cycle):
    """``cycles`` decisions of the gate in the engine's order (``SpecDecoder._cycle``): decide; learn the
    last drafted cycle (observe) during this cycle's verify, then, after an AR step, decide ahead; a
    drafted cycle is counted right after its verify (observe_selection). ``drafted_cycle(k)`` gives the
    k-th drafted cycle's (draft nodes, committed tokens), each in 10 ms against a 10 ms AR step. Returns
    the decisions' first letters."""
    out, last, k = [], None, 0
    for _ in range(cycles):
        d = on.policy.decide()
        if last is not None:
            on.observe(**last, counted=True)
            last = None
        if d == "ar":
            on.policy.decide_ahead()
        else:
            nodes, committed = drafted_cycle(k)
            k += 1
            on.policy.observe_selection(nodes, min(nodes, 1))
            last = dict(root_predicted_new=[0], root_true_new=[0], selected_predicted_new=[0], transferred=[0],
                        draft_nodes=nodes, committed=committed, cycle_ms=10.0, ar_ms=10.0, selected_depth=min(nodes, 1))
        out.append(d[0])
    return "".join(out)


def test_an_explorations_own_outcome_sets_the_interval_after_it():
    """The interval after a burst follows that burst's outcome, learned one cycle late as in the engine,
    not the outcome of the burst before it: a burst that lifts Ŝ to near break-even is followed by 16 AR
    steps, a burst that drops it again by twice that."""
    warm = UtilityGate.WARMUP + UtilityGate.MIN_DRAFTED

    def drafted_cycle(k):  # measured at 0.5 x AR, then near break-even for a burst, then 0.2 x AR
        return 1, 0.5 if k < warm else 1.8 if k < warm + 4 else 0.2

    on = OnlineModel(depth=4)
    seq = gate_in_engine_order(on, warm + 4 + 4 + 16 + 4 + 33, drafted_cycle)
    assert seq == "d" * warm + "aaaa" + "eeee" + "a" * 16 + "eeee" + "a" * 32 + "e"
    assert on.policy.state.explore_after == 32 and on.policy.speedup < on.policy.EXPLORE_MARGIN


def test_clearly_worse_drafting_explores_six_bursts_in_252_ar_steps_then_ever_fewer_within_explore_cost():
    on = OnlineModel(depth=4)
    warm = on.policy.WARMUP + on.policy.MIN_DRAFTED
    seq = gate_in_engine_order(on, warm + 252 + 6 * 4 + 256 + 4 + 512 + 4 + 1024 + 4 + 1024 + 4 + 10, lambda k: (1, 0.5))
    assert seq[:warm] == "d" * warm
    gaps = [len(run) for run in seq[warm:].split("eeee")]
    # AR steps between bursts: doubling past EXPLORE_MAX (a burst at Ŝ = 0.5 loses ~4 AR steps, more than
    # EXPLORE_COST of 128), capped at 8 EXPLORE_MAX
    assert gaps == [4, 8, 16, 32, 64, 128, 256, 512, 1024, 1024, 10]
    assert on.policy.state.explore_after == 8 * on.policy.EXPLORE_MAX and sum(gaps[:6]) == 252


def test_the_first_trusted_decision_reads_the_measured_cycles_but_the_last():
    """In the engine's order the last warm-up cycle is counted at its verify but learned during the next
    verify: the gate's first decision after WARMUP + MIN_DRAFTED drafted cycles reads Ŝ of the
    MIN_DRAFTED - 1 before it (SPECFIT.md §3)."""
    on = OnlineModel(depth=4)
    warm = on.policy.WARMUP + on.policy.MIN_DRAFTED
    gate_in_engine_order(on, warm, lambda k: (1, 3.0 if k == warm - 1 else 0.5))
    assert on.policy.state.drafted == warm and on.policy.speedup == pytest.approx(0.5) and on.policy.decide() == "ar"


def test_corrected_cost_prices_each_missed_expert_at_its_copy_and_its_read():
    read = CostModel(6.0, 0.1, (1.0, 2.0), read_ms=0.25)
    on = OnlineModel(depth=4)
    on.observe(root_predicted_new=[1, 1], root_true_new=[2, 2], selected_predicted_new=[1, 2],
               transferred=[5, 4], draft_nodes=2, committed=2, cycle_ms=30.0, ar_ms=20.0)
    c = on.corrected_cost(read, [1, 2])
    assert c.fixed_ms == pytest.approx(6.0 + 1.25 * 1 + 2.25 * 1)
    assert c.per_node_ms == pytest.approx(0.1 + 1.25 * 1.5 + 2.25 * 0.5)
    # the charge a shadow cycle puts on each node it would have rejected is the same node term
    assert on.node_correction_ms(read) == pytest.approx(c.per_node_ms - read.per_node_ms)
