"""Shadow cycles (SPECFIT.md §3, "Drafting in the AR step's shadow"): an AR step drafts and selects a tree
it does not verify, and learns what verifying it would have committed from the tokens decoding commits
after its root. Checked here: that outcome is the verify's, the gate's schedule with shadows, the
modeled price of a shadow's head forwards, and on the proxy that shadows change no output."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.cost import CostModel, get_profile
from specfit.engine import SpecDecoder, TreeSettings
from specfit.engine.decoder import CycleRecord, shadow_outcome
from specfit.engine.online import OnlineModel
from specfit.engine.verify import verify_greedy
from specfit.eval.modeled import modeled_cycle_ms


@st.composite
def trees(draw):
    """A draft tree over a 5-token vocabulary (equal sibling tokens allowed) and a deterministic target."""
    n = draw(st.integers(1, 14))
    parents = [-1] + [draw(st.integers(0, v - 1)) for v in range(1, n)]
    tokens = [draw(st.integers(0, 4)) for _ in range(n)]
    table = draw(st.lists(st.integers(0, 4), min_size=64, max_size=64))
    return parents, tokens, table


@settings(max_examples=300, deadline=None)
@given(trees())
def test_the_shadow_outcome_is_the_greedy_verify(case):
    """Walking the tree along what greedy AR decoding commits gives verify_greedy's path and bonus."""
    parents, tokens, table = case

    def target(prefix):  # the target's greedy next token after a prefix of token ids
        return table[hash(tuple(prefix)) % 64]

    def prefix(v):
        out = []
        while v >= 0:
            out.append(tokens[v])
            v = parents[v]
        return out[::-1]

    logits = torch.full((len(tokens), 5), -1.0)
    for v in range(len(tokens)):
        logits[v, target(prefix(v))] = 1.0
    acc = verify_greedy(tokens, parents, logits)
    ar = [tokens[0]]
    for _ in range(len(tokens) + 1):  # AR decoding from the root, past any path of the tree
        ar.append(target(ar))
    path, bonus = shadow_outcome(parents, tokens, ar[1:])
    assert path == acc.path and bonus == acc.bonus_token


def test_the_shadow_outcome_waits_for_its_continuation():
    parents, tokens = [-1, 0, 1, 0], [7, 1, 2, 3]  # root 7; chain 1 -> 2; sibling 3
    assert shadow_outcome(parents, tokens, []) is None
    assert shadow_outcome(parents, tokens, [1]) is None  # node 1 accepted; its child's outcome unknown yet
    assert shadow_outcome(parents, tokens, [1, 5]) == ([0, 1], 5)
    assert shadow_outcome(parents, tokens, [1, 2, 9]) == ([0, 1, 2], 9)
    assert shadow_outcome(parents, tokens, [4, 1]) == ([0], 4)
    assert shadow_outcome([-1, 0, 0], [7, 3, 3], [3, 0]) == ([0, 1], 0)  # equal siblings: the first wins


def shadowing_model():
    on = OnlineModel(depth=4)
    on.policy.shadow.shadowing = True
    return on


def shadow_cycles(on, n, *, draft_nodes, cycle_ms, ar_ms):
    """``n`` shadow decisions, each resolved at once with the given outcome."""
    out = []
    for _ in range(n):
        d = on.policy.decide()
        out.append(d)
        if d == "shadow":
            on.policy.observe_shadow_selection(draft_nodes)
            on.policy.observe_shadow(draft_nodes=draft_nodes, cycle_ms=cycle_ms, ar_tokens_ms=ar_ms)
    return out


def test_the_warmup_runs_in_the_shadow_and_a_losing_draft_is_never_paid():
    on = shadowing_model()
    warm = on.policy.WARMUP + on.policy.MIN_DRAFTED
    assert shadow_cycles(on, warm, draft_nodes=0, cycle_ms=10.5, ar_ms=10.0) == ["shadow"] * warm
    assert on.policy.shadow_speedup == pytest.approx(10.0 / 10.5) and on.policy.state.drafted == 0
    seq = "".join(d[0] for d in shadow_cycles(on, 300, draft_nodes=0, cycle_ms=10.5, ar_ms=10.0))
    assert set(seq) == {"a", "s"} and on.policy.state.cleared is False  # explorations are shadows too: no draft is paid
    assert seq.startswith("aaaa" + "s" + "a" * 8 + "s" + "a" * 16 + "s")  # one shadow a burst (root alone), doubling
    assert on.policy.state.drafted == 0 and on.policy.state.explorations == 0


def test_shadows_that_find_drafting_pays_clear_real_drafting_early():
    on = shadowing_model()
    seq = shadow_cycles(on, 40, draft_nodes=3, cycle_ms=10.0, ar_ms=20.0)
    first = on.policy.WARMUP + on.policy.SHADOW_EARLY  # calibration, then SHADOW_EARLY measured shadows with Ŝ_sh > 1
    assert seq[:first] == ["shadow"] * first and seq[first:] == ["draft"] * (40 - first)
    assert on.policy.state.cleared is True


def test_a_pending_shadow_is_waited_for_and_an_unresolved_one_dropped():
    on = shadowing_model()
    for _ in range(on.policy.WARMUP + on.policy.MIN_DRAFTED):
        assert on.policy.decide() == "shadow"
        on.policy.observe_shadow_selection(1)
    assert on.policy.decide() == "ar" and on.policy.state.cleared is None  # the warm-up's shadows are not resolved yet
    on.policy.drop_shadows(on.policy.shadow.pending)  # a generation ended: no outcome will come
    assert on.policy.shadow.pending == 0 and on.policy.decide() == "ar" and on.policy.state.cleared is False  # nothing measured: not cleared


def test_a_real_exploration_that_backs_off_sends_the_next_one_to_the_shadow():
    on = shadowing_model()
    on.policy.state.cleared = True  # the shadows cleared drafting; real drafting then measured it worse than AR
    for _ in range(on.policy.WARMUP + on.policy.MIN_DRAFTED):
        assert on.policy.decide() == "draft"
        on.observe(root_predicted_new=[0], root_true_new=[0], selected_predicted_new=[0], transferred=[0],
                   draft_nodes=1, committed=1, cycle_ms=15.0, ar_ms=10.0)
    seq = "".join(on.policy.decide()[0] for _ in range(4 + 4 + 2))
    assert seq == "aaaa" + "eeee" + "aa" and on.policy.state.cleared is False  # judged: clearly worse
    assert on.policy.state.burst_shadow is False
    nxt = "".join(d[0] for d in shadow_cycles(on, 8, draft_nodes=0, cycle_ms=10.5, ar_ms=10.0))
    assert "s" in nxt and "e" not in nxt


def test_the_ar_steps_h2d_mean_follows_what_they_copy():
    on = OnlineModel(depth=4)
    assert on.policy.ar_h2d_ms() is None
    on.policy.observe_ar_h2d(10.0)
    assert on.policy.ar_h2d_ms() == pytest.approx(10.0)
    for _ in range(300):
        on.policy.observe_ar_h2d(0.0)
    assert on.policy.ar_h2d_ms() < 0.1  # decayed: the recent steps copy nothing


def test_without_shadowing_the_gate_is_unchanged():
    on = OnlineModel(depth=4)
    assert [on.policy.decide() for _ in range(3)] == ["draft"] * 3


def test_a_shadows_head_forwards_are_charged_only_past_the_ar_steps_copies():
    cost = get_profile("qwen3-30b-a3b-pcie4").for_layers(2)
    dl = cost.draft_level_ms
    copies = cost.cycle_ms(1, [1, 0]) - cost.cycle_ms(1, [0, 0])  # one expert copied: ms of H2D
    hidden = CycleRecord(decision="shadow", shadow_levels=int(copies // dl), transferred=[1, 0])
    assert modeled_cycle_ms(hidden, cost)["draft_ms"] == 0.0
    bare = CycleRecord(decision="shadow", shadow_levels=3, transferred=[0, 0])  # nothing copied: all paid
    assert modeled_cycle_ms(bare, cost)["draft_ms"] == pytest.approx(3 * dl)
    over = CycleRecord(decision="shadow", shadow_levels=int(copies // dl) + 2, transferred=[1, 0])
    assert modeled_cycle_ms(over, cost)["draft_ms"] == pytest.approx((int(copies // dl) + 2) * dl - copies)


@pytest.mark.slow
def test_shadows_on_the_proxy_change_no_output_and_teach_the_calibrator(one_torch_thread):
    from test_engine_proxy import decoder, load_proxy, proxy_prompts
    from specfit.engine import METHODS

    targets, drafter = load_proxy("cpu", torch.float32)
    prompts = proxy_prompts()[:4]
    ar = SpecDecoder(targets[32], None, "ar")
    expected = [ar.generate(p, 24).output_ids for p in prompts]
    dec = decoder(targets, drafter, METHODS["specfit"])
    gens = [dec.generate(p, 24) for p in prompts]
    assert [g.output_ids for g in gens] == expected
    shadows = [c for g in gens for c in g.cycles if c.decision == "shadow"]
    assert shadows and all(c.levels == 0 and c.levels_ahead == 0 and c.shadow_levels > 0 for c in shadows)
    assert all(c.nodes_verified == 1 and c.committed == 1 for c in shadows)  # an AR step each
    on = dec.online
    assert on.policy.shadow.drafted == len(shadows) and on.policy.shadow.resolved > on.policy.WARMUP and on.policy.shadow.pending == 0
    assert on.acceptance.trials.sum() > 0  # the shadows' trials, learned without a verify
