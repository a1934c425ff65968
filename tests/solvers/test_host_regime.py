"""Exact solver and stop rule in the host-compute regime (cost a HostProfile: per layer
max(GPU part, host part) + sync): the branch and bound's bound is checked on its own (from the
trivial incumbent); the stop rule stays sound with the host regime's per-node bounds, and the
transfer regime's per_node_ms would not be. The agreement of exact, cpsat and bruteforce, the
heuristics and the AR gate on host instances are in test_solvers.py and test_stop.py (``host``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.cost import CostModel, HostProfile
from specfit.core.instance import Instance
from specfit.core.objective import evaluate
from specfit.core.tree import DraftTree
from specfit.solvers import get_solver
from specfit.solvers.exact_host import HostSearch, select_host
from specfit.solvers.stop import should_stop
from strategies import BUDGETS, instances
from specfit.core.errors import SpecFitInputError
from test_solvers import RATES, check_selection, close
from test_stop import drafted_so_far


def _objective(inst: Instance, nodes, rate) -> float:
    ev = evaluate(inst, nodes)
    return ev.throughput if rate is None else ev.expected_tokens - rate / 1000.0 * ev.predicted_ms


@pytest.mark.parametrize("budget", BUDGETS)
@settings(max_examples=80, deadline=None)
@given(data=st.data(), rate=RATES)
def test_branch_and_bound_from_the_root_alone_is_exact(budget, data, rate):
    """Started from {root} instead of the best prefix, so that every pruning decision of the bound
    matters: an overestimated per-node time would lose the optimum here."""
    inst = data.draw(instances(budget=budget, host=True))
    ref = get_solver("bruteforce").solve(inst, rate)
    nodes, status = select_host(inst, rate, [0], 1e-12, None)
    assert status == "optimal" and inst.tree.is_ancestor_closed(nodes)
    assert close(_objective(inst, nodes, rate), ref.objective)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), lam=st.floats(0.0, 2.0))
def test_one_search_maximises_a_minus_lambda_t(data, lam):
    inst = data.draw(instances(host=True, max_nodes=10))
    nodes = HostSearch(inst).run(lam, [0])
    brute = get_solver("bruteforce").solve(inst, rate=1000.0 * lam)
    assert close(_objective(inst, nodes, 1000.0 * lam), brute.objective)


def _host_chain(p: float) -> Instance:
    """root -> a -> b; the root's uncached expert makes the host part bind in the one layer; a and b
    route to cached experts only, so verifying them costs no time at all."""
    experts = np.array([[[3]], [[0]], [[0]]])
    cache = np.zeros((1, 4), dtype=bool)
    cache[0, 0] = True
    gpu = CostModel(1.0, 0.1, 0.0, reference_layers=1)
    prof = HostProfile("t", gpu, 80.0, 5.0, 0.0, 0.0).for_layers(1)
    return Instance(DraftTree([-1, 0, 1], path_prob=[1.0, p, p], experts=experts, num_experts=4), prof, cache)


def test_stop_rule_uses_the_host_per_node_bound_of_zero():
    inst = _host_chain(0.01)
    brute = get_solver("bruteforce")
    best = brute.solve(drafted_so_far(inst, 2))  # after level 1: T = 5 ms whatever is verified
    assert best.predicted_ms == brute.solve(inst).predicted_ms == 5.0
    # with per_node_ms (0.1 ms) as the bound the rule would stop (0.01 <= 0.1 * R*), wrongly:
    assert 0.01 <= 0.1 * best.throughput / 1000.0
    assert brute.solve(inst).throughput > best.throughput
    assert inst.cost.min_node_ms == 0.0
    assert not should_stop(best.throughput, 0.01, inst.cost)
    assert not should_stop(best.throughput, 0.01, inst.cost, min_node_ms=inst.cost.min_node_ms_for(inst.cache))
    assert should_stop(best.throughput, 0.0, inst.cost)


def test_min_node_ms_given_the_cache_counts_only_full_layers():
    inst = _host_chain(0.5)
    prof = HostProfile("t", CostModel(1.0, 0.4, 0.0, reference_layers=48), 80.0, 1.0, 0.1, 0.0).for_layers(4)
    cache = np.zeros((4, 8), dtype=bool)
    assert prof.min_node_ms_for(cache) == 0.0
    cache[:2] = True  # two of four layers hold every expert
    assert prof.min_node_ms_for(cache) == pytest.approx(0.2)
    cache[:] = True
    assert prof.min_node_ms_for(cache) == pytest.approx(0.4)  # nothing on the host: the GPU's per_node_ms
    assert inst.cost.min_node_ms_for(inst.cache) == 0.0 and CostModel(1.0, 0.3, 0.1).min_node_ms_for(cache) == 0.3
    assert prof.min_node_ms_for(np.zeros((0, 8), dtype=bool)) == 0.4


def test_cpsat_models_the_max_on_a_preset_instance():
    """48-layer Qwen3-30B-A3B-shaped instances on a named host profile: exact and CP-SAT agree."""
    from dataclasses import replace

    from specfit.core.cost import DEFAULT_HOST_PROFILE, get_host_profile
    from specfit.eval.instances import PRESETS, generate_instances

    prof = get_host_profile(DEFAULT_HOST_PROFILE).for_layers(48)
    for _, _, inst in generate_instances(PRESETS["qwen3-30b-a3b"], [24], 3, seed=5):
        inst = replace(inst, cost=prof)
        a, b = get_solver("exact").solve(inst), get_solver("cpsat").solve(inst)
        assert a.status == b.status == "optimal"
        assert math.isclose(a.throughput, b.throughput, rel_tol=1e-9)


def test_cpsat_optimum_where_presolve_certified_a_wrong_one():
    """A hypothesis draw on which OR-Tools 9.15's presolve (inclusion detection, google/or-tools#5293)
    made CP-SAT report {0, 1, 3} at 90.9 tok/s as OPTIMAL; the optimum is {0, 3} at 96.2 (node 3
    routes to the root's experts, so its rows stay under the GPU part in every layer)."""
    experts = np.array([[[1], [0], [0]], [[2], [0], [0]], [[0], [0], [0]], [[1], [0], [0]], [[0], [0], [0]]])
    cache = np.zeros((3, 3), dtype=bool)
    cache[0, 0] = True
    prof = HostProfile("drawn", CostModel(12.0, 0.0, 0.0, reference_layers=3), 80.0, 2.75, 0.5, 0.0,
                       extra_ms=1.0).for_layers(3)
    tree = DraftTree([-1, 0, 1, 0, 0], path_prob=[1.0, 0.25, 0.0625, 0.25, 0.0], experts=experts, num_experts=3)
    inst = Instance(tree, prof, cache)
    ref = get_solver("bruteforce").solve(inst)
    assert ref.nodes == (0, 3) and close(ref.throughput, 1250.0 / 13.0)
    for name in ("exact", "cpsat"):
        sel = get_solver(name).solve(inst)
        assert sel.status == "optimal" and sel.nodes == (0, 3), name


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "many", 10**13])
def test_exact_rejects_a_bad_node_limit(bad):
    with pytest.raises(SpecFitInputError, match="max_visits"):
        get_solver("exact", max_visits=bad)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rate=RATES, visits=st.integers(1, 6))  # small: about a third stop early
def test_a_node_limit_stops_at_the_same_selection_on_any_machine(data, rate, visits):
    """``max_visits`` stops a branch and bound (the host regime's; under budgets the transfer regime's) after
    that many search nodes, whatever the clock says (here a clock that jumps a second per read: a wall-clock
    limit would stop at once); the answer is feasible, no better than the optimum, and the optimum whenever
    the search finished."""
    from unittest import mock

    inst = data.draw(instances(budget=data.draw(st.sampled_from(BUDGETS)), host=data.draw(st.booleans())))
    ref = get_solver("bruteforce").solve(inst, rate)
    first = get_solver("exact", max_visits=visits).solve(inst, rate)
    ticks = iter(range(10**9))
    with mock.patch("time.perf_counter", lambda: float(next(ticks))):
        slow = get_solver("exact", max_visits=visits).solve(inst, rate)
    assert slow.nodes == first.nodes and slow.status == first.status
    check_selection(inst, first, rate)
    assert _objective(inst, first.nodes, rate) <= ref.objective + 1e-9 * max(1.0, abs(ref.objective))
    if first.status == "optimal":
        assert close(_objective(inst, first.nodes, rate), ref.objective)
