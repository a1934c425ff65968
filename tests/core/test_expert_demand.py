"""Predicted expert demand of a draft tree (specfit.core.lookahead) against a direct count."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.errors import SpecFitInputError
from specfit.core.lookahead import expert_demand, tree_expert_demand
from specfit.core.tree import DraftTree


@st.composite
def trees(draw):
    """A draft tree with path probabilities (products of q) and k distinct predicted experts per layer."""
    n = draw(st.integers(1, 9))
    L, E = draw(st.integers(1, 3)), draw(st.integers(2, 7))
    k = draw(st.integers(1, E))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    q = [1.0] + [draw(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0.0, 1.0)) for _ in range(1, n)]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    experts = np.array([[rng.permutation(E)[:k] for _ in range(L)] for _ in range(n)], dtype=np.int64)
    return DraftTree(parents, q=q, experts=experts, num_experts=E)


def direct(weights, experts, E) -> np.ndarray:
    n, L, _ = experts.shape
    out = np.zeros((L, E))
    for v in range(n):
        for layer in range(L):
            for e in experts[v, layer]:
                out[layer, e] += weights[v]
    return out


@settings(max_examples=80, deadline=None)
@given(trees(), st.booleans())
def test_tree_demand_is_the_expected_count(tree, include_root):
    """demand[l, e] = Σ_v P_v [e ∈ E[v][l]] over the non-root nodes (or all with include_root); per layer it
    sums to k Σ_v P_v (each node brings k experts); nodes of probability 0 add nothing."""
    got = tree_expert_demand(tree, include_root=include_root)
    start = 0 if include_root else 1
    pp, exp = tree.path_prob[start:], tree.experts[start:]
    E, k = tree.num_experts, tree.experts.shape[2]
    assert got.shape == (tree.num_layers, E) and got.dtype == np.float64
    np.testing.assert_allclose(got, direct(pp, exp, E), atol=1e-12)
    np.testing.assert_allclose(got.sum(axis=1), k * pp.sum(), atol=1e-9)
    keep = pp > 0
    np.testing.assert_allclose(got, expert_demand(pp[keep], exp[keep], E), atol=1e-12)
    assert (got >= 0).all()


@settings(max_examples=60, deadline=None)
@given(trees(), st.data())
def test_excluded_nodes_are_not_counted(tree, data):
    """Excluding the verified nodes leaves the demand of the others; the parts add up to the whole."""
    verified = data.draw(st.sets(st.integers(0, tree.n - 1)))
    rest = [v for v in range(1, tree.n) if v not in verified]
    got = tree_expert_demand(tree, exclude=verified)
    np.testing.assert_allclose(got, direct(tree.path_prob[rest], tree.experts[rest], tree.num_experts), atol=1e-12)
    part = direct(tree.path_prob[sorted(verified - {0})], tree.experts[sorted(verified - {0})], tree.num_experts)
    np.testing.assert_allclose(got + part, tree_expert_demand(tree), atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(trees(), st.integers(0, 2**32 - 1))
def test_calibrated_weights_replace_path_probabilities(tree, seed):
    """Given P̂, the demand uses it in place of the tree's P; the root's weight is P̂_0 when counted."""
    p_hat = np.random.default_rng(seed).random(tree.n)
    np.testing.assert_allclose(tree_expert_demand(tree, p_hat), direct(p_hat[1:], tree.experts[1:], tree.num_experts),
                               atol=1e-12)
    np.testing.assert_allclose(tree_expert_demand(tree, p_hat, include_root=True),
                               direct(p_hat, tree.experts, tree.num_experts), atol=1e-12)


def test_known_values_and_errors():
    experts = [[[0, 2]], [[2, 3]], [[1, 2]]]                 # 3 nodes, 1 layer, k = 2
    np.testing.assert_allclose(expert_demand([1.0, 0.5, 0.25], experts, 4), [[1.0, 0.25, 1.75, 0.5]])
    assert expert_demand(np.zeros(0), np.zeros((0, 2, 3), np.int64), 5).tolist() == [[0.0] * 5] * 2
    for args, field in [(([1.0, 2.0, 0.0], experts, 4), "weights"), (([1.0, 1.0], experts, 4), "weights"),
                        (([1.0] * 3, experts, 3), "experts"), (([1.0] * 3, [[0, 1]], 4), "experts"),
                        (([1.0] * 3, experts, 0), "num_experts")]:
        with pytest.raises(SpecFitInputError, match=field):
            expert_demand(*args)
    with pytest.raises(SpecFitInputError, match="experts"):
        tree_expert_demand(DraftTree([-1, 0], q=[1.0, 0.5]))
    with pytest.raises(SpecFitInputError, match="exclude"):
        tree_expert_demand(DraftTree([-1, 0], q=[1.0, 0.5], experts=experts[:2], num_experts=4), exclude=[2])
    with pytest.raises(SpecFitInputError, match="path_prob"):
        tree_expert_demand(DraftTree([-1, 0], q=[1.0, 0.5], experts=experts[:2], num_experts=4), [1.0])
