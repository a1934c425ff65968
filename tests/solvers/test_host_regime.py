"""Solvers, stop rule and AR gate in the host-compute regime (cost a HostProfile: per layer
max(GPU part, host part) + sync): exact, cpsat and bruteforce agree; the branch and bound's bound is
checked on its own (from the trivial incumbent); the stop rule and the AR gate stay sound with the
host regime's per-node bound of 0, and the transfer regime's per_node_ms would not be."""

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
from specfit.solvers.stop import draft_can_beat_ar, should_stop
from strategies import BUDGETS, instances, level_instances
from test_solvers import EXACT, HEURISTICS, RATES, check_selection, close
from test_stop import _with_fixed, drafted_so_far


def _objective(inst: Instance, nodes, rate) -> float:
    ev = evaluate(inst, nodes)
    return ev.throughput if rate is None else ev.expected_tokens - rate / 1000.0 * ev.predicted_ms


@pytest.mark.parametrize("budget", BUDGETS)
@settings(max_examples=80, deadline=None)
@given(data=st.data(), rate=RATES)
def test_exact_solvers_agree_on_host_instances(budget, data, rate):
    inst = data.draw(instances(budget=budget, host=True))
    ref = get_solver("bruteforce").solve(inst, rate)
    for name in EXACT:
        sel = get_solver(name).solve(inst, rate)
        check_selection(inst, sel, rate)
        assert sel.status == "optimal", name
        assert close(sel.objective, ref.objective), (name, sel.objective, ref.objective, sel.nodes, ref.nodes)


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


@pytest.mark.parametrize("budget", BUDGETS)
@settings(max_examples=30, deadline=None)
@given(data=st.data(), rate=RATES)
def test_heuristics_are_valid_and_never_beat_exact_on_host_instances(budget, data, rate):
    inst = data.draw(instances(budget=budget, host=True))
    best = get_solver("exact").solve(inst, rate)
    for name in HEURISTICS:
        sel = get_solver(name).solve(inst, rate)
        check_selection(inst, sel, rate)
        assert sel.objective <= best.objective + 1e-9 * max(1.0, abs(best.objective)), name


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


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("mode", ["ratio", "rate"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_stop_rule_is_sound_on_host_instances(budget, mode, data):
    """With the cache-aware per-node bound the engine passes (``min_node_ms_for(cache)``)."""
    inst, ends = data.draw(level_instances(budget=budget, host=True))
    node_ms = inst.cost.min_node_ms_for(inst.cache)
    rate = data.draw(st.floats(0.0, 800.0)) if mode == "rate" else None
    level_ms = data.draw(st.sampled_from([0.0]) | st.floats(0.0, 20.0))
    width = max(b - a for a, b in zip(ends, ends[1:])) if len(ends) > 1 else 1
    brute = get_solver("bruteforce")
    best = [brute.solve(_with_fixed(inst, m, d * level_ms), rate) for d, m in enumerate(ends)]
    for d, m in enumerate(ends[:-1]):
        p_f = float(inst.tree.path_prob[ends[d - 1] if d else 0:m].max())
        if should_stop(best[d].throughput, p_f, inst.cost, rate, level_ms=level_ms, level_width=width,
                       min_node_ms=node_ms):
            deeper = max(b.objective for b in best[d + 1:])
            assert deeper <= best[d].objective + 1e-9 * max(1.0, abs(best[d].objective)), (d, deeper, best[d].objective)


@pytest.mark.parametrize("budget", BUDGETS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_ar_gate_is_sound_on_host_instances(budget, data):
    """The engine's host inputs: per-node bound min_node_ms = 0 and X = the smallest single-node
    increment T({root, v}) - T({root}) (HostProfile.node_added_ms)."""
    inst, ends = data.draw(level_instances(budget=budget, host=True))
    level_ms = data.draw(st.floats(0.0, 20.0))
    items, cost = inst.items, inst.cost
    ar_ms = cost.cycle_ms(1, items.root_new_per_layer)
    assert ar_ms == pytest.approx(evaluate(inst, [0]).predicted_ms)
    mass = [float(inst.tree.path_prob[a:b].sum()) for a, b in zip(ends, ends[1:])]
    new = np.array([items.per_layer(items.need[v] & ~items.need[0]) for v in range(1, inst.n)],
                   dtype=np.int64).reshape(inst.n - 1, inst.num_layers)
    added = cost.node_added_ms(items.root_new_per_layer, new, items.rows[1:])
    cheapest = float(added.min()) if added.size else 0.0
    if draft_can_beat_ar(ar_ms, mass, level_ms, cost.min_node_ms, cheapest):
        return
    brute = get_solver("bruteforce")
    for d, m in enumerate(ends[1:], 1):
        best = brute.solve(_with_fixed(inst, m, d * level_ms))
        assert best.throughput <= 1000.0 / ar_ms * (1 + 1e-9), (d, best.throughput, 1000.0 / ar_ms)


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
