"""The exact solver's compiled path (solvers/exact_compiled.py) against its Python reference.

The compiled path (``ExactSolver()``, the default) and the Python one (``ExactSolver(compiled=False)``)
run the same algorithm; on generated instances without budgets they must reach the same optimum, and
return the same nodes with the same A, T and throughput unless two selections tie to within float
round-off (then each path's answer is optimal: a newcomer found such ties in about 1 of 20,000 generated
ratio-mode instances), and both must match brute force. (tests/solvers/test_solvers.py
checks the default, compiled, solver against CP-SAT and brute force with and without budgets.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.coverage import ItemSets
from specfit.core.cost import CostModel
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance
from specfit.core.objective import evaluate
from specfit.core.tree import DraftTree
from specfit.solvers import get_solver
from specfit.solvers.exact import ExactSolver
from specfit.solvers.exact_compiled import _segments, linear_prefix_selection
from specfit.solvers import greedy
from strategies import instances

RATES = st.one_of(st.none(), st.floats(0.0, 600.0))
COMPILED, PYTHON = ExactSolver(), ExactSolver(compiled=False)


def fields(sel) -> tuple:
    return sel.nodes, sel.expected_tokens, sel.predicted_ms, sel.throughput, sel.status


def same_selection(inst, got, ref, rate) -> None:
    """The same nodes and floats, or (a tie to round-off) two selections of the same objective."""
    if fields(got) == fields(ref):
        return
    assert got.status == ref.status == "optimal"
    assert math.isclose(got.objective, ref.objective, rel_tol=1e-12, abs_tol=1e-12), (fields(got), fields(ref))
    check = evaluate(inst, got.nodes)
    assert (check.expected_tokens, check.predicted_ms) == (got.expected_tokens, got.predicted_ms)


@settings(max_examples=300, deadline=None)
@given(instances(max_nodes=12), RATES)
def test_compiled_equals_python_path(inst, rate):
    """Same nodes, same floats as the Python path (or a tie to round-off); the optimum brute force finds."""
    got, ref = COMPILED.solve(inst, rate), PYTHON.solve(inst, rate)
    same_selection(inst, got, ref, rate)
    assert all(type(v) is int for v in got.nodes)
    brute = get_solver("bruteforce").solve(inst, rate)
    assert math.isclose(got.objective, brute.objective, rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from([1, 3, 64, 65, 128]), st.booleans(), RATES)
def test_compiled_equals_python_path_on_wide_layers(seed, num_experts, per_layer, rate):
    """Layers of 1-128 experts (items straddling 64-bit words, per-layer costs): the same selection."""
    rng = np.random.default_rng(seed)
    n, L, k = int(rng.integers(2, 40)), int(rng.integers(1, 4)), min(num_experts, 4)
    parents = [-1] + [int(rng.integers(0, v)) for v in range(1, n)]
    q = [1.0] + rng.uniform(0.05, 1.0, n - 1).tolist()
    hot = rng.choice(num_experts, size=min(num_experts, 6), replace=False)  # shared experts: coupled nodes
    experts = np.stack([np.stack([rng.choice(hot, k, replace=False) if rng.random() < 0.7 else
                                  rng.choice(num_experts, k, replace=False) for _ in range(L)]) for _ in range(n)])
    cache = rng.random((L, num_experts)) < 0.3
    per_expert = rng.uniform(0.0, 2.0, L).tolist() if per_layer else float(rng.uniform(0.0, 2.0))
    tree = DraftTree(parents, q=q, experts=experts, num_experts=num_experts)
    inst = Instance(tree, CostModel(float(rng.uniform(0.5, 10.0)), float(rng.uniform(0.0, 1.0)), per_expert), cache)
    same_selection(inst, COMPILED.solve(inst, rate), PYTHON.solve(inst, rate), rate)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(2, 300), st.integers(1, 8), st.booleans(), RATES)
def test_compiled_a_and_t_are_evaluates_floats_on_large_selections(seed, n, layers, per_layer, rate):
    """The kernel's own A and T (no evaluate after it) are evaluate's floats bit for bit on selections of up
    to 300 nodes: A's sum in numpy's pairwise order (plain, eight accumulators, halves above 128), T's
    expert term layer by layer. Likely nodes and cheap experts make selections of 30-260 nodes."""
    rng = np.random.default_rng(seed)
    num_experts, k = 16, 2
    parents = [-1] + [int(rng.integers(0, v)) for v in range(1, n)]  # a random recursive tree: ~ln n deep
    q = [1.0] + rng.uniform(0.7, 1.0, n - 1).tolist()
    experts = rng.integers(0, num_experts, size=(n, layers, k))
    cache = rng.random((layers, num_experts)) < 0.8
    per_expert = rng.uniform(0.0, 0.01, layers).tolist() if per_layer else float(rng.uniform(0.0, 0.01))
    tree = DraftTree(parents, q=q, experts=experts, num_experts=num_experts)
    inst = Instance(tree, CostModel(float(rng.uniform(1.0, 20.0)), float(rng.uniform(0.0, 0.2)), per_expert), cache)
    got = COMPILED.solve(inst, rate)
    check = evaluate(inst, got.nodes)
    assert (got.expected_tokens, got.predicted_ms, got.throughput) == (
        check.expected_tokens, check.predicted_ms, check.throughput)


@settings(max_examples=200, deadline=None)
@given(instances(max_nodes=14, per_expert_zero=True), st.one_of(st.none(), st.integers(1, 14)),
       st.one_of(st.none(), st.floats(0.0, 2.0)))
def test_compiled_linear_prefix_is_the_numpy_prefix(inst, max_nodes, lam):
    """greedy.linear_prefix and its compiled twin: the same prefix (ties in P included), and the twin's A
    and T are evaluate's floats."""
    capped = Instance(inst.tree, inst.cost, inst.cache, max_nodes=max_nodes)
    nodes, a, t = linear_prefix_selection(inst.tree, inst.cost.fixed_ms, inst.cost.per_node_ms, max_nodes, lam)
    assert nodes.tolist() == greedy.linear_prefix(capped, lam)
    check = evaluate(inst, nodes.tolist())
    assert (a, t) == (check.expected_tokens, check.predicted_ms)


def test_item_words_hold_the_roots_items_then_each_nodes_own():
    """ItemSets.words: row 0 the root's items, row v its own items; item l * E + e is bit (i % 64) of
    word i // 64."""
    cache = np.zeros((2, 40), dtype=bool)
    items = ItemSets(cache)
    experts = np.array([[[1], [39]], [[1], [2]], [[5], [39]]])  # root: items 1, 79; node 1 owns 42; node 2 owns 5
    items.extend([-1, 0, 1], experts)
    words = items.words()
    assert words.shape == (3, 2) and words.dtype == np.uint64
    assert words[0].tolist() == [1 << 1, 1 << (79 - 64)]
    assert words[1].tolist() == [1 << 42, 0]
    assert words[2].tolist() == [1 << 5, 0]
    items.extend([2], np.array([[[7], [0]]]))
    assert items.words().shape == (4, 2) and items.words()[3].tolist() == [1 << 7 | 1 << 40, 0]


@pytest.mark.parametrize("num_experts", [1, 5, 64, 100, 128])
def test_segments_cover_every_item_of_its_layer_once(num_experts):
    """The (word, mask, layer) segments partition the L * E item bits by layer."""
    L = 3
    word, mask, layer = _segments(L, num_experts)
    seen = {}
    for w, m, l in zip(word.tolist(), mask.tolist(), layer.tolist()):
        for b in range(64):
            if m >> b & 1:
                assert 64 * w + b not in seen
                seen[64 * w + b] = l
    assert seen == {i: i // num_experts for i in range(L * num_experts)}


def test_compiled_linear_prefix_keeps_the_first_of_tied_prefixes():
    """Free nodes of probability 0 tie the objective; the shortest best prefix wins, as np.argmax."""
    tree = DraftTree([-1, 0, 0, 1], path_prob=[1.0, 0.5, 0.0, 0.0])
    inst = Instance(tree, CostModel(1.0, 0.0, 0.0))
    for lam in (None, 0.5):
        nodes = linear_prefix_selection(tree, 1.0, 0.0, None, lam)[0]
        assert nodes.tolist() == greedy.linear_prefix(inst, lam) == [0, 1]


def test_other_array_layouts_do_not_compile_the_kernels_again():
    """Read-only or strided inputs (a caller's arrays) are copied into the layout the kernels were compiled
    for, instead of compiling a new specialisation inside a solve."""
    from specfit.core.kernels import _item_words, item_words_kernel
    from specfit.solvers.exact_compiled import _linear_prefix, _select, exact_kernel, linear_prefix_kernel

    pp = np.array([1.0, 9.0, 0.5, 9.0, 0.4, 9.0])[::2]
    experts = np.array([[[1]], [[2]], [[3]]], dtype=np.int32)
    experts.setflags(write=False)
    cache = np.zeros((1, 8), dtype=bool)
    cache.setflags(write=False)
    for k in (exact_kernel, linear_prefix_kernel, item_words_kernel):
        k()  # compiled for the engine's types
    before = {k: len(k.signatures) for k in (_select, _linear_prefix, _item_words)}
    tree = DraftTree([-1, 0, 0], path_prob=pp, experts=experts, num_experts=8)
    for c in (cache, np.ones((1, 8), dtype=bool)):
        inst = Instance(tree, CostModel(1.0, 0.1, 0.5), c)
        same_selection(inst, COMPILED.solve(inst), PYTHON.solve(inst), None)
    assert {k: len(k.signatures) for k in before} == before


def test_a_round_off_tie_may_resolve_either_way():
    """A newcomer's instance: the root alone and {root, 2} tie to one ulp (T priced per item or per layer),
    the paths pick different ones, both optimal within round-off and as brute force finds."""
    experts = [[[53, 43, 64], [9, 1, 53], [64, 53, 9], [11, 12, 64], [34, 34, 53]],
               [[9, 9, 9], [53, 53, 53], [48, 48, 48], [3, 3, 3], [64, 64, 64]],
               [[9, 9, 9], [53, 53, 64], [9, 12, 9], [53, 53, 9], [12, 33, 12]]]
    inst = Instance(DraftTree([-1, 0, 0], path_prob=[1.0, 0.0, 0.5], experts=experts, num_experts=65),
                    CostModel(0.1, 0.1, 0.3))
    got, ref = COMPILED.solve(inst), PYTHON.solve(inst)
    same_selection(inst, got, ref, None)
    assert math.isclose(got.throughput, get_solver("bruteforce").solve(inst).throughput, rel_tol=1e-12)


@pytest.mark.parametrize("solver", [COMPILED, PYTHON], ids=["compiled", "python"])
def test_dinkelbach_ends_when_t_overflows(solver):
    """A newcomer's cost whose T overflows to inf (each field finite): F_λ is NaN there, and the loop,
    which used to run forever (the compiled one deaf to Ctrl-C), ends."""
    tree = DraftTree([-1, 0], path_prob=[1.0, 0.5], experts=[[[0, 1]], [[2, 3]]], num_experts=4)
    cost = CostModel(1.0, 0.0, 1.0)
    object.__setattr__(cost, "per_expert_ms", 1e308)  # past MAX_MS, which CostModel refuses: the solver's own guard
    with np.errstate(over="ignore"):
        sel = solver.solve(Instance(tree, cost))
    assert sel.nodes[0] == 0 and sel.status == "optimal"


SUNK = st.one_of(st.just(0.0), st.floats(0.0, 50.0))


def selection_fields(sel) -> tuple:
    """Everything a Selection holds but its measured solve time."""
    return sel.solver, sel.nodes, sel.expected_tokens, sel.predicted_ms, sel.throughput, sel.status, sel.mode, sel.rate


@settings(max_examples=300, deadline=None)
@given(st.one_of(instances(max_nodes=14), instances(max_nodes=14, per_expert_zero=True),
                 instances(max_nodes=8, host=True)), RATES, SUNK, st.one_of(st.none(), st.integers(1, 14)))
def test_solve_tree_is_solve_of_the_instance(inst, rate, sunk, max_nodes):
    """Solver.solve_tree (the engine's per-cycle call; the exact solver's answers it by one compiled call
    without building the instance) returns what solve returns for Instance(tree, cost.plus_ms(sunk), cache,
    max_nodes):
    the same nodes and floats, for every registered kind of path (compiled exact with and without uncached
    experts, the host regime, the Python exact path, a greedy baseline)."""
    cost = inst.cost.plus_ms(sunk) if sunk else inst.cost
    for solver in (COMPILED, PYTHON, get_solver("scan")):
        got = solver.solve_tree(inst.tree, inst.cost, inst.cache, rate=rate, sunk_ms=sunk, max_nodes=max_nodes)
        ref = solver.solve(Instance(inst.tree, cost, inst.cache, max_nodes=max_nodes), rate)
        assert selection_fields(got) == selection_fields(ref)
        assert all(type(v) is int for v in got.nodes)


def test_solve_tree_without_experts_is_the_best_prefix():
    """A tree without experts (the engine's when every expert is cached: no expert term) gets the best prefix
    of the path-probability order, the cycle's sunk ms in T."""
    tree = DraftTree([-1, 0, 0, 1], path_prob=[1.0, 0.9, 0.05, 0.8], num_experts=8)
    cache = np.zeros((0, 8), dtype=bool)
    sel = COMPILED.solve_tree(tree, CostModel(2.0, 0.5, 1.0), cache, sunk_ms=1.0)
    assert sel.nodes == (0, 1, 3)
    assert (sel.expected_tokens, sel.predicted_ms) == (1.0 + (0.9 + 0.8), 3.0 + 0.5 * 3)


@pytest.mark.parametrize("solver", [COMPILED, PYTHON], ids=["compiled", "python"])
def test_solve_tree_names_the_field_it_refuses(solver):
    """Bad input to solve_tree gets the errors Instance and solve give: the sunk ms, the cache's shape, the rate."""
    tree = DraftTree([-1, 0], path_prob=[1.0, 0.5], experts=[[[0, 1]], [[2, 3]]], num_experts=4)
    cache, cost = np.zeros((1, 4), dtype=bool), CostModel(1.0, 0.1, 0.5)
    for kwargs, field in (({"sunk_ms": -1.0}, "ms"), ({"sunk_ms": float("nan")}, "ms"), ({"rate": -5.0}, "rate")):
        with pytest.raises(SpecFitInputError) as err:
            solver.solve_tree(tree, cost, cache, **kwargs)
        assert err.value.field == field
    with pytest.raises(SpecFitInputError) as err:
        solver.solve_tree(tree, cost, np.zeros((2, 4), dtype=bool))
    assert err.value.field == "cache"
    with pytest.raises(SpecFitInputError) as err:
        solver.solve_tree(tree, CostModel(1.0, 0.1, [0.5, 0.5]), cache)
    assert err.value.field == "cost.per_expert_ms"
