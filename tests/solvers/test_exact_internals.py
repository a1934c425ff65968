"""Pieces of the exact solver: the minimum cut, coverage accounting, the closure step."""

import itertools

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.solvers import exact as exact_mod
from specfit.core.coverage import coverage
from specfit.core.cost import CostModel
from specfit.core.instance import Instance
from specfit.core.objective import evaluate
from specfit.core.tree import DraftTree


def _closures(parents):
    """All ancestor-closed node sets of a tree (independent enumeration by bitmask)."""
    n = len(parents)
    for mask in range(1 << (n - 1)):
        s = [0] + [v for v in range(1, n) if mask >> (v - 1) & 1]
        if all(parents[v] in s for v in s[1:]):
            yield s


@st.composite
def shared_instances(draw, max_n=10):
    """Small instances with heavy expert sharing between siblings, so the min-cut path runs."""
    n = draw(st.integers(1, max_n))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    q = [1.0] + [draw(st.floats(0.05, 1.0)) for _ in range(1, n)]
    layers, experts, k = draw(st.integers(1, 3)), draw(st.integers(3, 6)), draw(st.integers(1, 2))
    exp = np.array(draw(st.lists(st.lists(st.lists(st.integers(0, experts - 1), min_size=k, max_size=k),
                                          min_size=layers, max_size=layers), min_size=n, max_size=n)))
    cost = CostModel(draw(st.floats(0.5, 5.0)), draw(st.floats(0.0, 0.5)), draw(st.floats(0.0, 1.5)))
    cache = np.array(draw(st.lists(st.lists(st.booleans(), min_size=experts, max_size=experts),
                                   min_size=layers, max_size=layers)))
    return Instance(DraftTree(parents, q=q, experts=exp, num_experts=experts), cost, cache)


@given(st.integers(2, 12), st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_min_cut_source_side_is_a_minimum_cut(num_vertices, seed):
    rng = np.random.default_rng(seed)
    edges = []
    g = nx.DiGraph()
    g.add_nodes_from(range(num_vertices))
    for u, v in itertools.permutations(range(num_vertices), 2):
        if rng.random() < 0.35:
            c = float(rng.uniform(0, 3)) if rng.random() < 0.8 else float("inf")
            edges.append((u, v, c))
            g.add_edge(u, v, capacity=c)
    side = exact_mod.min_cut_source_side(num_vertices, 0, num_vertices - 1, edges)
    assert side[0] and not side[-1]
    cut = sum(c for u, v, c in edges if side[u] and not side[v])
    try:
        expected, _ = nx.minimum_cut(g, 0, num_vertices - 1)
    except nx.NetworkXUnbounded:
        expected = float("inf")
    assert cut == pytest.approx(expected, rel=1e-9, abs=1e-9)


@given(shared_instances())
@settings(max_examples=80, deadline=None)
def test_coverage_value_equals_objective_on_every_closure(inst):
    cov = coverage(inst)
    for s in itertools.islice(_closures(inst.tree.parents.tolist()), 64):
        a, t = cov.value(s)
        ev = evaluate(inst, s)
        assert a == pytest.approx(ev.expected_tokens)
        assert t == pytest.approx(ev.predicted_ms)


@given(shared_instances(), st.floats(0.0, 2.0))
@settings(max_examples=150, deadline=None)
def test_max_closure_maximises_a_minus_lambda_t(inst, lam):
    cov = coverage(inst)
    got = exact_mod.max_closure(cov, lam)
    assert inst.tree.is_ancestor_closed(got)
    a, t = cov.value(got)
    best = max(cov.value(s)[0] - lam * cov.value(s)[1] for s in _closures(inst.tree.parents.tolist()))
    assert a - lam * t == pytest.approx(best, rel=1e-9, abs=1e-9)


def test_min_cut_path_is_exercised_by_shared_siblings():
    # two siblings share an uncached expert the root lacks: neither pays alone, both together do
    exp = [[[0]], [[1]], [[1]]]
    inst = Instance(DraftTree([-1, 0, 0], path_prob=[1.0, 0.5, 0.5], experts=exp, num_experts=2),
                    CostModel(1.0, 0.0, 1.2))
    calls = []
    original = exact_mod.min_cut_source_side

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    exact_mod.min_cut_source_side = spy
    try:
        nodes = exact_mod.max_closure(coverage(inst), 0.45)  # each alone: 0.5 - 0.45*1.2 < 0; both: 1 - 0.54 > 0
    finally:
        exact_mod.min_cut_source_side = original
    assert calls and nodes == [0, 1, 2]
