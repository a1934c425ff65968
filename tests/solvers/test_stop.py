"""The stop rule never stops while a deeper tree could still do better (brute force)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.solvers import get_solver
from specfit.solvers.stop import should_stop
from specfit.core.cost import CostModel
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance
from specfit.core.tree import DraftTree
from strategies import BUDGETS, level_instances


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


@pytest.mark.parametrize("args,field", [((-1.0, 0.5), "best_throughput_tok_s"), ((math.nan, 0.5), "best_throughput_tok_s"),
                                        ((10.0, 1.5), "frontier_max_path_prob"), ((10.0, math.nan), "frontier_max_path_prob")])
def test_stop_rule_rejects_bad_arguments(args, field):
    with pytest.raises(SpecFitInputError, match=field):
        should_stop(*args, CostModel(1.0, 0.1, 0.0))
    with pytest.raises(SpecFitInputError, match="rate"):
        should_stop(10.0, 0.5, CostModel(1.0, 0.1, 0.0), rate=-1.0)
