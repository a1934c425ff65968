"""Solvers against each other and against a recomputation of the objective.

``exact``, ``cpsat`` and ``bruteforce`` must agree on the optimal value with and without each
budget, in ratio and rate mode; every selection must be ancestor-closed, within budget, and report
the numbers :func:`specfit.core.objective.evaluate` recomputes; heuristics never beat ``exact``; ``scan``
equals ``exact`` without an expert term.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.solvers import STATUSES, get_solver
from specfit.solvers.greedy import path_prob_order
from specfit.core.cost import CostModel
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance
from specfit.core.objective import evaluate, within_budget
from specfit.core.tree import DraftTree
from strategies import BUDGETS, instances

EXACT = ("exact", "cpsat", "bruteforce")
HEURISTICS = ("eagle", "scan", "greedy")
RATES = st.one_of(st.none(), st.floats(0.0, 600.0))
REL = 1e-9


def close(a: float, b: float, rel: float = REL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


def check_selection(inst: Instance, sel, rate) -> None:
    """The invariants every solver's answer must satisfy."""
    nodes = list(sel.nodes)
    assert nodes == sorted(set(nodes)) and nodes[0] == 0
    assert inst.tree.is_ancestor_closed(nodes)
    assert within_budget(inst, nodes)
    ev = evaluate(inst, nodes)
    assert close(sel.expected_tokens, ev.expected_tokens, 1e-12)
    assert close(sel.predicted_ms, ev.predicted_ms, 1e-12)
    assert close(sel.throughput, ev.throughput, 1e-12)
    assert close(sel.throughput, 1000.0 * sel.expected_tokens / sel.predicted_ms, 1e-12)
    assert sel.status in STATUSES and sel.solve_ms >= 0
    assert sel.mode == ("ratio" if rate is None else "rate")


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("budget", BUDGETS)
@settings(max_examples=100, deadline=None)
@given(data=st.data(), rate=RATES)
def test_exact_solvers_agree_on_the_optimum(budget, host, data, rate):
    """Transfer and host-compute regime (a HostProfile cost: per layer max(GPU, host) + sync)."""
    inst = data.draw(instances(budget=budget, host=host))
    ref = get_solver("bruteforce").solve(inst, rate)
    for name in EXACT:
        sel = get_solver(name).solve(inst, rate)
        check_selection(inst, sel, rate)
        assert sel.status == "optimal", name
        assert close(sel.objective, ref.objective), (name, sel.objective, ref.objective, sel.nodes, ref.nodes)


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("budget", BUDGETS)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), rate=RATES)
def test_heuristics_are_valid_and_never_beat_exact(budget, host, data, rate):
    inst = data.draw(instances(budget=budget, host=host))
    best = get_solver("exact").solve(inst, rate)
    for name in HEURISTICS:
        sel = get_solver(name).solve(inst, rate)
        check_selection(inst, sel, rate)
        assert sel.status == "heuristic"
        assert sel.objective <= best.objective + REL * max(1.0, abs(best.objective)), name


@pytest.mark.parametrize("budget", ("none", "nodes"))
@settings(max_examples=60, deadline=None)
@given(data=st.data(), rate=RATES)
def test_scan_is_exact_without_expert_term(budget, data, rate):
    inst = data.draw(instances(budget=budget, per_expert_zero=True))
    scan = get_solver("scan").solve(inst, rate)
    assert close(scan.objective, get_solver("exact").solve(inst, rate).objective)


@settings(max_examples=30, deadline=None)
@given(inst=instances(max_nodes=16), total=st.integers(0, 16))
def test_eagle_takes_the_top_path_probability_prefix(inst, total):
    inst = replace(inst, max_nodes=None, max_new_experts_per_layer=None)
    sel = get_solver("eagle", total_tokens=total).solve(inst)
    assert list(sel.nodes) == sorted(path_prob_order(inst)[: total + 1])


def test_path_prob_order_is_ancestor_closed_despite_tolerance():
    # path_prob[2] exceeds its parent's by less than PROB_TOL: it must still come after node 1
    tree = DraftTree([-1, 0, 1], path_prob=[1.0, 0.5, 0.5 + 5e-10])
    inst = Instance(tree, CostModel(1.0, 0.1, 0.0))
    order = path_prob_order(inst)
    assert order == [0, 1, 2]


def test_greedy_picks_cached_child_over_likely_child_with_new_experts():
    # SPECFIT.md §3: a likely child needing many new experts loses to a less likely cached one
    experts = np.array([[[0, 1]], [[2, 3]], [[0, 1]]])
    tree = DraftTree([-1, 0, 0], path_prob=[1.0, 0.6, 0.3], experts=experts, num_experts=8)
    inst = Instance(tree, CostModel(10.0, 0.1, 20.0))
    assert get_solver("greedy").solve(inst).nodes == (0, 2)
    assert get_solver("scan").solve(inst).nodes == (0, 1, 2)  # the best P-prefix pays for node 1
    assert get_solver("eagle", total_tokens=1).solve(inst).nodes == (0, 1)
    assert get_solver("bruteforce").solve(inst).nodes == (0, 2)


def test_bruteforce_refuses_large_trees():
    tree = DraftTree(list(range(-1, 20)), path_prob=[1.0] * 21)
    with pytest.raises(SpecFitInputError, match="parents.*at most 20"):
        get_solver("bruteforce").solve(Instance(tree, CostModel(1.0, 0.1, 0.0)))


@pytest.mark.parametrize("options", [{"time_limit_s": 0}, {"time_limit_s": float("nan")}, {"time_limit_s": "soon"},
                                     {"workers": 0}, {"precision_bits": 5}])
def test_cpsat_rejects_bad_options(options):
    with pytest.raises(SpecFitInputError):
        get_solver("cpsat", **options)


def test_eagle_rejects_bad_total_tokens():
    with pytest.raises(SpecFitInputError, match="total_tokens"):
        get_solver("eagle", total_tokens=-1)


def test_cpsat_under_a_tiny_time_limit_never_claims_an_unproven_optimum():
    from specfit.eval.instances import PRESETS, generate_instance

    inst = generate_instance(96, PRESETS["qwen3-30b-a3b"], np.random.default_rng(3))
    inst = replace(inst, max_nodes=24)
    sel = get_solver("cpsat", time_limit_s=1e-6).solve(inst)
    check_selection(inst, sel, None)
    if sel.status == "optimal":
        assert close(sel.throughput, get_solver("exact").solve(inst).throughput)
    else:
        assert sel.status == "feasible"


@pytest.mark.parametrize("max_nodes", [None, 32])
def test_exact_and_cpsat_agree_on_preset_instances(max_nodes):
    from specfit.eval.instances import PRESETS, generate_instances, with_options

    spec = with_options(PRESETS["qwen3-30b-a3b"], max_nodes=max_nodes, sharing=0.8, cache_fraction=0.5)
    for _, _, inst in generate_instances(spec, [48], 4, seed=7):
        a, b = get_solver("exact").solve(inst), get_solver("cpsat").solve(inst)
        check_selection(inst, a, None)
        check_selection(inst, b, None)
        assert a.status == b.status == "optimal"
        assert close(a.throughput, b.throughput)


def test_cpsat_handles_denormal_costs():
    # found by hypothesis: a denormal per_node_ms made the integer scaling factor infinite
    from specfit.core.cost import CostModel
    from specfit.core.instance import Instance
    from specfit.core.tree import DraftTree

    inst = Instance(DraftTree([-1, 0], path_prob=[1.0, 0.0], experts=np.zeros((2, 0, 0), dtype=np.int64),
                              num_experts=1),
                    CostModel(1.0, 2.2250738585e-313, 0.0), max_nodes=1, max_new_experts_per_layer=0)
    assert get_solver("cpsat").solve(inst).nodes == get_solver("exact").solve(inst).nodes == (0,)


def _scanned_prefix(instance: Instance, lam):
    """best_prefix's scan, node by node (the reference for its closed form without uncached experts)."""
    from specfit.core.coverage import GrowingSelection

    cov, order = GrowingSelection(instance), path_prob_order(instance)
    best, best_len = cov.value(lam), 1
    for k, v in enumerate(order[1:], start=2):
        if not cov.fits(v):
            break
        cov.add(v)
        if cov.value(lam) > best:
            best, best_len = cov.value(lam), k
    return sorted(order[:best_len])


@settings(max_examples=200, deadline=None)
@given(instances(max_nodes=14, budget="nodes"), st.one_of(st.none(), st.floats(0.0, 2.0)),
       st.booleans())
def test_best_prefix_without_uncached_experts_is_the_scan(inst, lam, all_cached):
    from specfit.solvers.greedy import best_prefix

    if all_cached:  # every expert resident: the closed form applies
        inst = Instance(inst.tree, inst.cost, np.ones_like(inst.cache), inst.max_nodes, inst.max_new_experts_per_layer)
    assert best_prefix(inst, lam) == _scanned_prefix(inst, lam)


@settings(max_examples=100, deadline=None)
@given(instances(max_nodes=12, budget="nodes"), RATES)
def test_exact_without_uncached_experts_evaluates_its_prefix_as_evaluate_does(inst, rate):
    """With every expert resident and no resident-read term (``read_ms`` 0: a resident expert costs
    nothing) the exact solver returns the best prefix with its own A and T (objective.evaluate_uncovered):
    the optimum, and bit for bit evaluate's floats. With ``read_ms > 0`` a resident expert costs its read
    and T is not linear in |S| (the agreement tests cover that case)."""
    from specfit.core.objective import evaluate_uncovered

    cost = replace(inst.cost, read_ms=0.0)
    inst = Instance(inst.tree, cost, np.ones_like(inst.cache), inst.max_nodes, inst.max_new_experts_per_layer)
    sel = get_solver("exact").solve(inst, rate)
    ev = evaluate(inst, sel.nodes)
    assert (sel.nodes, sel.expected_tokens, sel.predicted_ms, sel.throughput) == (
        ev.nodes, ev.expected_tokens, ev.predicted_ms, ev.throughput)
    assert all(type(v) is int for v in sel.nodes)
    assert close(sel.objective, get_solver("bruteforce").solve(inst, rate).objective)
    order = path_prob_order(inst)
    for k in range(1, inst.n + 1):
        prefix = sorted(order[:k])
        a, b = evaluate_uncovered(inst, prefix), evaluate(inst, prefix)
        assert (a.nodes, a.expected_tokens, a.predicted_ms, a.throughput) == (b.nodes, b.expected_tokens,
                                                                              b.predicted_ms, b.throughput)
        np.testing.assert_array_equal(a.new_experts, b.new_experts)


def test_a_custom_select_may_return_two_values_or_no_evaluation():
    """Solver.solve evaluates the nodes itself unless select returned their Evaluation."""
    from specfit.solvers.base import Solver

    inst = Instance(DraftTree([-1, 0, 0], path_prob=[1.0, 0.6, 0.3]), CostModel(6.0, 0.1, 0.0))

    class Two(Solver):
        def select(self, instance, rate):
            return [0, 1], "feasible"

    class NoEvaluation(Solver):
        def select(self, instance, rate):
            return [np.int64(1), np.int64(0)], "feasible", None

    for solver in (Two(), NoEvaluation()):
        sel = solver.solve(inst)
        assert sel.nodes == (0, 1) and all(type(v) is int for v in sel.nodes)
        assert sel.expected_tokens == evaluate(inst, [0, 1]).expected_tokens
