"""The stop rule never stops while a deeper tree could still do better (brute force)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.solvers import get_solver
from specfit.solvers.stop import draft_can_beat_ar, ratio_upper_bound, selectable, should_stop, stop_node_ms
from specfit.core.cost import CostModel
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance
from specfit.core.objective import predicted_ms
from specfit.core.tree import DraftTree
from strategies import BUDGETS, instances, level_instances


def drafted_so_far(inst: Instance, m: int) -> Instance:
    """The instance restricted to nodes 0..m-1 (the levels drafted so far; BFS order)."""
    sub, _ = inst.tree.subtree(range(m))
    return Instance(sub, inst.cost, inst.cache, inst.max_nodes, inst.max_new_experts_per_layer)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("mode", ["ratio", "rate"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stop_rule_is_sound(budget, mode, data):
    inst, ends = data.draw(level_instances(budget=budget))
    rate = data.draw(st.floats(0.0, 800.0)) if mode == "rate" else None
    brute = get_solver("bruteforce")
    full = brute.solve(inst, rate).objective
    for d, m in enumerate(ends[:-1]):
        best = brute.solve(drafted_so_far(inst, m), rate)
        p_f = float(inst.tree.path_prob[ends[d - 1] if d else 0:m].max())
        if should_stop(best.throughput, p_f, inst.cost, rate):
            assert full <= best.objective + 1e-9 * max(1.0, abs(best.objective)), (d, full, best.objective)


def _chain(q: float) -> Instance:
    return Instance(DraftTree([-1, 0, 1], q=[1.0, q, q]), CostModel(fixed_ms=10.0, per_node_ms=1.0, per_expert_ms=0.0))


def test_stop_rule_stops_when_deeper_nodes_cannot_pay():
    inst = _chain(0.05)  # after level 1: R* = 1/11 tokens/ms, P_f = 0.05 <= 1.0 * R*
    best = get_solver("bruteforce").solve(Instance(inst.tree.subtree([0, 1])[0], inst.cost))
    assert should_stop(best.throughput, 0.05, inst.cost)
    assert get_solver("bruteforce").solve(inst).throughput <= best.throughput


def test_stop_rule_continues_when_a_deeper_tree_is_better():
    inst = _chain(0.9)
    best = get_solver("bruteforce").solve(Instance(inst.tree.subtree([0, 1])[0], inst.cost))
    assert not should_stop(best.throughput, 0.9, inst.cost)
    assert get_solver("bruteforce").solve(inst).throughput > best.throughput


def test_stop_rule_rate_mode_threshold():
    cost = CostModel(10.0, 0.5, 0.0)
    assert should_stop(0.0, 0.1, cost, rate=200.0)        # 0.1 <= 0.5 ms * 0.2 tokens/ms
    assert not should_stop(1e9, 0.11, cost, rate=200.0)   # rate mode ignores the throughput
    assert should_stop(50.0, 0.0, cost)                   # nothing left to expand


def test_stop_node_ms_is_the_rule_s_per_node_bound():
    cost = CostModel(10.0, 0.5, 0.0)
    assert stop_node_ms(cost) == 0.5                                              # cost.min_node_ms
    assert stop_node_ms(cost, level_ms=2.0, level_width=16) == 0.5 + 2.0 / 16
    assert stop_node_ms(cost, level_ms=2.0, level_width=16, min_node_ms=0.0) == 2.0 / 16
    assert stop_node_ms(cost, level_ms=2.0) == 0.5                                # no width: no level term
    # the rule fires exactly at P_f = stop_node_ms * R* / 1000 (R* = 800 tokens/s here)
    at = stop_node_ms(cost, level_ms=2.0, level_width=16) * 800.0 / 1000.0
    assert should_stop(800.0, at, cost, level_ms=2.0, level_width=16)
    assert not should_stop(800.0, math.nextafter(at, 1.0), cost, level_ms=2.0, level_width=16)
    for kwargs, field in (({"level_ms": -1.0, "level_width": 4}, "level_ms"), ({"level_width": 0}, "level_width"),
                          ({"min_node_ms": math.inf}, "min_node_ms")):
        with pytest.raises(SpecFitInputError, match=field):
            stop_node_ms(cost, **kwargs)


@pytest.mark.parametrize("args,field", [((-1.0, 0.5), "best_throughput_tok_s"), ((math.nan, 0.5), "best_throughput_tok_s"),
                                        ((10.0, 1.5), "frontier_max_path_prob"), ((10.0, math.nan), "frontier_max_path_prob")])
def test_stop_rule_rejects_bad_arguments(args, field):
    with pytest.raises(SpecFitInputError, match=field):
        should_stop(*args, CostModel(1.0, 0.1, 0.0))
    with pytest.raises(SpecFitInputError, match="rate"):
        should_stop(10.0, 0.5, CostModel(1.0, 0.1, 0.0), rate=-1.0)


def _with_fixed(inst: Instance, m: int, extra_ms: float) -> Instance:
    """Nodes 0..m-1 of ``inst`` with ``extra_ms`` added to fixed_ms (the levels drafted: a cost of the cycle)."""
    sub, _ = inst.tree.subtree(range(m))
    return Instance(sub, inst.cost.plus_ms(extra_ms), inst.cache, inst.max_nodes,
                    inst.max_new_experts_per_layer)


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("mode", ["ratio", "rate"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_stop_rule_with_level_cost_is_sound(budget, mode, host, data):
    """Whole-cycle objective: a tree drafted d levels deep pays d * level_ms; when the rule (with the
    next levels' cost spread over at most ``width`` nodes a level) stops, no deeper tree is better.
    Both regimes, with the per-node bound the engine passes (``min_node_ms_for`` the cache)."""
    inst, ends = data.draw(level_instances(budget=budget, host=host))
    node_ms = inst.cost.min_node_ms_for(inst.cache)
    rate = data.draw(st.floats(0.0, 800.0)) if mode == "rate" else None
    level_ms = data.draw(st.floats(0.0, 20.0))
    width = max(b - a for a, b in zip(ends, ends[1:])) if len(ends) > 1 else 1
    brute = get_solver("bruteforce")
    best = [brute.solve(_with_fixed(inst, m, d * level_ms), rate) for d, m in enumerate(ends)]
    for d, m in enumerate(ends[:-1]):
        p_f = float(inst.tree.path_prob[ends[d - 1] if d else 0:m].max())
        if should_stop(best[d].throughput, p_f, inst.cost, rate, level_ms=level_ms, level_width=width,
                       min_node_ms=node_ms):
            deeper = max(b.objective for b in best[d + 1:])
            assert deeper <= best[d].objective + 1e-9 * max(1.0, abs(best[d].objective)), (d, deeper, best[d].objective)


def test_level_cost_lets_the_rule_stop_earlier():
    cost = CostModel(10.0, 0.1, 0.0)
    assert not should_stop(100.0, 0.05, cost)  # 0.05 > 0.1 ms * 0.1 tokens/ms
    assert should_stop(100.0, 0.05, cost, level_ms=2.0, level_width=4)  # 0.05 <= (0.1 + 0.5) * 0.1
    assert not should_stop(100.0, 0.05, cost, level_ms=2.0)  # unbounded width: the level cost is not used
    with pytest.raises(SpecFitInputError, match="level_width"):
        should_stop(100.0, 0.05, cost, level_ms=2.0, level_width=0)


def _gate_inputs(inst: Instance, ends: list[int], level_ms: float):
    """The AR gate's inputs with the tightest bounds the drawn tree allows: T(AR), the level masses and
    the cheapest single node's cost beyond ``min_node_ms`` (``node_added_ms``, either regime)."""
    tree, cost, items = inst.tree, inst.cost, inst.items
    ar_ms = cost.cycle_ms(1, items.root_new_per_layer)
    mass = [float(tree.path_prob[a:b].sum()) for a, b in zip(ends, ends[1:])]
    new = np.array([items.per_layer(items.need[v] & ~items.need[0]) for v in range(1, tree.n)],
                   dtype=np.int64).reshape(tree.n - 1, inst.num_layers)
    added = cost.node_added_ms(items.root_new_per_layer, new, items.rows[1:])
    return ar_ms, mass, max(float(added.min()), 0.0) if added.size else 0.0


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("budget", BUDGETS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_ar_gate_skips_only_when_no_draft_beats_ar(budget, host, data):
    """Whenever the gate says no draft can beat AR, no subtree of any drafted depth (paying its levels)
    beats the AR step's 1 token in T(root alone) — brute force over every subtree. Host regime: the
    per-node bound is ``min_node_ms`` = 0 and the cheapest node's cost T({root, v}) - T({root})."""
    inst, ends = data.draw(level_instances(budget=budget, host=host))
    level_ms = data.draw(st.floats(0.0, 20.0))
    ar_ms, mass, cheapest = _gate_inputs(inst, ends, level_ms)
    if draft_can_beat_ar(ar_ms, mass, level_ms, inst.cost.min_node_ms, cheapest):
        return
    brute = get_solver("bruteforce")
    for d, m in enumerate(ends[1:], 1):
        best = brute.solve(_with_fixed(inst, m, d * level_ms))
        assert best.throughput <= 1000.0 / ar_ms * (1 + 1e-9), (d, best.throughput, 1000.0 / ar_ms)


def test_ar_gate_decides_by_the_expert_cost_of_a_draft():
    # AR: 10 ms. One level of mass 0.5 gains 0.5 * 10 ms = 5 ms against 1 ms of level and node cost.
    assert draft_can_beat_ar(10.0, [0.5], 0.9, 0.1, 3.9)
    assert not draft_can_beat_ar(10.0, [0.5], 0.9, 0.1, 4.0)   # the cheapest draft node brings 4 ms of experts
    assert not draft_can_beat_ar(10.0, [0.0, 0.0], 0.0, 0.0, 0.0)  # nothing can be accepted
    assert draft_can_beat_ar(10.0, [0.05, 0.9], 0.1, 0.0, 0.0)  # a deeper level can pay for a shallow one
    with pytest.raises(SpecFitInputError, match="ar_ms"):
        draft_can_beat_ar(0.0, [0.5], 0.0, 0.0, 0.0)
    with pytest.raises(SpecFitInputError, match=r"level_mass\[0\]"):
        draft_can_beat_ar(1.0, [-0.5], 0.0, 0.0, 0.0)


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("mode", ["ratio", "rate"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_selectable_drops_only_nodes_in_no_optimal_selection(budget, mode, host, data):
    """Every optimal selection (brute force) holds only selectable nodes, against R_lo = R* itself and
    the engine's bound (the root alone, every level paid); so the optimum over the selectable nodes
    is the optimum over the whole tree."""
    inst = data.draw(instances(max_nodes=10, budget=budget, host=host))
    extra = data.draw(st.floats(0.0, 20.0))  # levels paid: a cost of the cycle
    inst = Instance(inst.tree, inst.cost.plus_ms(extra), inst.cache, inst.max_nodes, inst.max_new_experts_per_layer)
    node_ms = inst.cost.min_node_ms_for(inst.cache)
    rate = data.draw(st.floats(0.0, 800.0)) if mode == "rate" else None
    brute = get_solver("bruteforce")
    best = brute.solve(inst, rate)
    root_alone = 1000.0 / predicted_ms(inst, [0])  # T(root alone), the reads of its resident experts included
    for lo in ([rate] if rate is not None else [best.throughput, root_alone]):
        keep = selectable(inst.tree.path_prob, node_ms, lo)
        keep[0] = True  # the root is in every selection; only draft nodes are dropped
        assert keep[list(best.nodes)].all()
        kept = np.flatnonzero(keep)
        sub, _ = inst.tree.subtree(kept)
        pruned = brute.solve(Instance(sub, inst.cost, inst.cache, inst.max_nodes, inst.max_new_experts_per_layer), rate)
        assert pruned.objective == pytest.approx(best.objective, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("mode", ["ratio", "rate"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_ratio_upper_bound_is_never_below_the_optimum(budget, mode, host, data):
    """R* of every generated instance (brute force, with a sunk cost of the cycle) is at most
    ratio_upper_bound, which is at most the engine's older bound 1000 (1 + ΣP) / T(root alone). In rate
    mode the solver's throughput is that of the selection maximising A - λT: no higher than R* either."""
    inst = data.draw(instances(max_nodes=10, budget=budget, host=host))
    inst = Instance(inst.tree, inst.cost.plus_ms(data.draw(st.floats(0.0, 20.0))), inst.cache, inst.max_nodes,
                    inst.max_new_experts_per_layer)
    rate = data.draw(st.floats(0.0, 800.0)) if mode == "rate" else None
    best = get_solver("bruteforce").solve(inst, rate)
    root_ms = inst.cost.cycle_ms(1, inst.items.root_new_per_layer, inst.items.rows[0])
    bound = ratio_upper_bound(inst.tree.path_prob[1:], root_ms, inst.cost.min_node_ms_for(inst.cache))
    assert best.throughput <= bound * (1 + 1e-9)
    assert bound <= 1000.0 * float(inst.tree.path_prob.sum()) / root_ms * (1 + 1e-12)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.25, 0.5, 1.0])), max_size=60),
       st.floats(1e-3, 50.0), st.one_of(st.just(0.0), st.floats(0.0, 5.0)))
def test_ratio_upper_bound_is_the_numpy_formula_bit_for_bit(path_prob, root_ms, min_node_ms):
    """The compiled bound (specfit.core.kernels.ratio_bound_kernel) gives the numpy formula's float: the
    stop rule's decisions do not move by a rounding."""
    p = np.sort(np.asarray(path_prob, dtype=np.float64))[::-1]
    want = 1.0 / root_ms
    if p.size:
        want = max(want, float(((1.0 + np.cumsum(p)) / (root_ms + min_node_ms * np.arange(1, p.size + 1))).max()))
    assert ratio_upper_bound(path_prob, root_ms, min_node_ms) == 1000.0 * want


def test_ratio_upper_bound_is_exact_on_a_cached_star():
    """A star with no expert term: every k-node prefix by P is a subtree, so the bound is R*."""
    tree = DraftTree([-1, 0, 0, 0, 0], q=[1.0, 0.9, 0.5, 0.2, 0.01])
    inst = Instance(tree, CostModel(fixed_ms=10.0, per_node_ms=2.0, per_expert_ms=0.0))
    best = get_solver("bruteforce").solve(inst)
    bound = ratio_upper_bound(tree.path_prob[1:], inst.cost.cycle_ms(1, ()), 2.0)
    assert bound == pytest.approx(best.throughput, rel=1e-12)
    assert bound == pytest.approx(1000.0 * (1 + 0.9 + 0.5) / (12.0 + 2 * 2.0))  # 0.2 < 2 ms * 0.15 tokens/ms: no gain
    assert ratio_upper_bound([], 4.0, 1.0) == 250.0  # the root alone
    for args, field in [(([0.5], 0.0, 1.0), "root_ms"), (([0.5], None, 1.0), "root_ms"), (([0.5], 1.0, -1.0), "min_node_ms"),
                        (([0.9, math.nan], 10.0, 1.0), r"path_prob\[1\]"), (([0.9, 2.0], 10.0, 1.0), r"path_prob\[1\]"),
                        (([-0.1], 10.0, 1.0), r"path_prob\[0\]"), ((None, 10.0, 1.0), "path_prob"),
                        (([[0.5, 0.5]], 10.0, 1.0), "path_prob"), ((["a"], 10.0, 1.0), "path_prob")]:
        with pytest.raises(SpecFitInputError, match=field):
            ratio_upper_bound(*args)


def test_selectable_threshold_and_errors():
    assert selectable([1.0, 0.2, 0.1, 0.05], 1.0, 100.0).tolist() == [True, True, True, False]  # 0.1 tokens/ms * 1 ms
    assert selectable([0.0], 0.0, 0.0).tolist() == [True]
    with pytest.raises(SpecFitInputError, match="rate_lo"):
        selectable([1.0], 1.0, math.nan)
    with pytest.raises(SpecFitInputError, match="min_node_ms"):
        selectable([1.0], -1.0, 10.0)
