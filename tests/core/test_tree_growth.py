"""The draft tree grows level by level and keeps its coverage accounting in step; networkx interchange."""

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.coverage import ItemSets
from specfit.core.errors import SpecFitInputError
from specfit.core.tree import DraftTree

PARENTS = [-1, 0, 0, 1, 1, 2]
PP = [1.0, 0.6, 0.3, 0.3, 0.15, 0.27]


def _experts(n, L=3, k=2, E=8, seed=0):
    return np.argsort(np.random.default_rng(seed).random((n, L, E)), axis=2)[..., :k]  # distinct per node and layer


def test_grown_tree_equals_tree_built_at_once_and_items_are_incremental():
    exp = _experts(6)
    cache = np.zeros((3, 8), dtype=bool)
    cache[0, :4] = True
    whole = DraftTree(PARENTS, path_prob=PP, tokens=range(6), experts=exp, num_experts=8)
    grown = DraftTree([-1], path_prob=[1.0], tokens=[0], experts=exp[:1], num_experts=8)
    items = grown.items(cache)
    assert grown.add_level([0, 0], PP[1:3], [1, 2], exp[1:3]).tolist() == [1, 2]
    assert grown.depth.tolist() == [0, 1, 1]
    grown.add_level([1, 1, 2], PP[3:], [3, 4, 5], exp[3:])
    assert grown.items(cache) is items  # extended in place, not rebuilt
    assert grown.last_level.tolist() == [3, 4, 5]
    for name in ("parents", "path_prob", "tokens", "experts", "depth", "ancestor_mask"):
        assert np.array_equal(getattr(grown, name), getattr(whole, name)), name
    assert grown.children == whole.children
    fresh = ItemSets(cache)
    fresh.extend(PARENTS, exp)
    assert items.need == fresh.need and items.own == fresh.own and items.above == fresh.above
    # own = needed and cached by no proper ancestor; the per-layer union matches a direct set count
    for nodes in ([0], [0, 1, 3], list(range(6))):
        direct = [len({int(e) for v in nodes for e in exp[v, l]} - set(np.flatnonzero(cache[l]).tolist()))
                  for l in range(3)]
        assert items.new_per_layer(nodes).tolist() == direct


@pytest.mark.parametrize("kwargs, field", [
    (dict(parents=[7], path_prob=[0.1]), "parents[3]"),
    (dict(parents=[1], path_prob=[0.9]), "path_prob[3]"),
    (dict(parents=[1], path_prob=[float("nan")]), "path_prob[0]"),
    (dict(parents=[1], path_prob=[0.1], experts=np.full((1, 3, 2), 9)), "experts[3][0]"),
    (dict(parents=[1], path_prob=[0.1]), "experts"),
])
def test_add_level_rejects_bad_levels(kwargs, field):
    t = DraftTree(PARENTS[:3], path_prob=PP[:3], experts=_experts(3), num_experts=8)
    kwargs.setdefault("experts", _experts(len(kwargs["parents"])) if "experts" not in kwargs and field != "experts"
                      else kwargs.get("experts"))
    with pytest.raises(SpecFitInputError) as err:
        t.add_level(**kwargs)
    assert err.value.field == field
    assert t.n == 3  # nothing appended


def test_networkx_round_trip_keeps_labels_and_data():
    exp = _experts(6)
    t = DraftTree(PARENTS, path_prob=PP, tokens=[5, 6, 7, 8, 9, 10], experts=exp, num_experts=8)
    g = t.to_networkx()
    assert sorted(g.edges) == [(0, 1), (0, 2), (1, 3), (1, 4), (2, 5)]
    assert g.graph["num_experts"] == 8
    assert g.nodes[4] == {"path_prob": pytest.approx(0.15), "token": 9, "experts": exp[4].tolist()}
    back = DraftTree.from_networkx(g)
    for name in ("parents", "path_prob", "tokens", "experts"):
        assert np.array_equal(getattr(back, name), getattr(t, name)), name
    relabelled = nx.relabel_nodes(g, {v: f"n{v}" for v in g})
    tree = DraftTree.from_networkx(relabelled)
    assert tree.labels[0] == "n0" and sorted(tree.labels) == sorted(relabelled)
    assert nx.utils.graphs_equal(tree.to_networkx(), relabelled)


def test_from_networkx_numbers_breadth_first_so_parents_precede_children():
    g = nx.DiGraph()
    g.add_node("leaf", path_prob=0.2)
    g.add_node("root", path_prob=1.0)
    g.add_node("mid", path_prob=0.5)
    g.add_edges_from([("mid", "leaf"), ("root", "mid")])
    t = DraftTree.from_networkx(g)
    assert t.labels == ["root", "mid", "leaf"]
    assert t.parents.tolist() == [-1, 0, 1] and t.experts is None and t.tokens is None


def _graph(overrides=()):
    g = nx.DiGraph(num_experts=4)
    g.add_node("r", path_prob=1.0, experts=[[0, 1]])
    g.add_node("a", path_prob=0.5, experts=[[1, 2]])
    g.add_node("b", path_prob=0.4, experts=[[3, 0]])
    g.add_edges_from([("r", "a"), ("a", "b")])
    for (node, key), value in dict(overrides).items():
        if value is None:
            del g.nodes[node][key]
        else:
            g.nodes[node][key] = value
    return g


def test_from_networkx_reads_the_graph_attribute_num_experts():
    t = DraftTree.from_networkx(_graph())
    assert t.num_experts == 4 and t.experts.shape == (3, 1, 2)


@pytest.mark.parametrize("make, field, rule", [
    (lambda: nx.DiGraph(), "graph", "at least the root"),
    (lambda: nx.Graph([(0, 1)]), "graph", "DiGraph"),
    (lambda: nx.DiGraph([(0, 1), (1, 2), (2, 1)]), "graph", "cycle"),
    (lambda: nx.DiGraph([(0, 2), (1, 3)]), "graph", "exactly one root"),
    (lambda: nx.DiGraph([(0, 1), (0, 2), (1, 3), (2, 3)]), "graph.nodes[3]", "2 parents"),
    (lambda: _graph({("a", "path_prob"): None}), "graph.nodes['a'].path_prob", "is required"),
    (lambda: _graph({("b", "experts"): None}), "graph.nodes['b'].experts", "on every node or on none"),
    (lambda: _graph({("a", "experts"): [[1, 2, 3]]}), "graph.nodes['a'].experts", "the same L and k"),
    (lambda: _graph({("a", "experts"): [[1, 9]]}), "graph.nodes['a'].experts[0]", "out of range"),
    (lambda: _graph({("b", "path_prob"): 0.9}), "graph.nodes['b'].path_prob", "must not exceed"),
    (lambda: _graph({("b", "path_prob"): "high"}), "graph.nodes['b'].path_prob", "number"),
    (lambda: _graph({("r", "path_prob"): 0.5}), "graph.nodes['r'].path_prob", "must be 1.0"),
])
def test_from_networkx_rejects_bad_graphs_naming_node_and_attribute(make, field, rule):
    with pytest.raises(SpecFitInputError) as err:
        DraftTree.from_networkx(make())
    assert err.value.field == field
    assert rule in err.value.rule


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 3), st.sampled_from([1, 3, 8, 64, 70]), st.integers(1, 4))
def test_extend_packs_the_need_mask_bits_and_counts_rows(seed, layers, num_experts, k):
    """ItemSets.extend's compiled pass (need bits, rows per layer) against need_mask: the same bitsets and
    rows, a repeated id counted once."""
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 12))
    experts = rng.integers(0, num_experts, size=(m, layers, k))
    cache = rng.random((layers, num_experts)) < 0.4
    items = ItemSets(cache)
    items.extend([-1] + [int(rng.integers(0, v)) for v in range(1, m)], experts)
    mask = items.need_mask(experts)
    want = [int.from_bytes(np.packbits(r, bitorder="little").tobytes(), "little") for r in mask]
    assert items.need == want
    np.testing.assert_array_equal(items.rows, mask.reshape(m, layers, num_experts).sum(axis=2))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 4), st.sampled_from([3, 64, 70]))
def test_item_words_and_python_int_views_agree(seed, layers, num_experts):
    """The words ItemSets keeps and the Python ints it gives the Python solvers are one accounting: above =
    the ancestors' needs, own = need & ~above, words() row v = own[v] (row 0 = need[0]), the root's row of
    rows = per_layer(need[0]), any_uncached = any(need); over several extends."""
    rng = np.random.default_rng(seed)
    cache = rng.random((layers, num_experts)) < 0.5
    items, parents = ItemSets(cache), [-1]
    items.extend([-1], rng.integers(0, num_experts, size=(1, layers, 2)))
    for _ in range(int(rng.integers(0, 4))):
        m = int(rng.integers(1, 6))
        new = [int(rng.integers(0, len(parents) + i)) for i in range(m)]
        items.extend(new, rng.integers(0, num_experts, size=(m, layers, 2)))
        parents += new
    need = items.need
    for v, p in enumerate(parents):
        above, u = 0, p
        while u >= 0:
            above |= need[u]
            u = parents[u]
        assert items.above[v] == above and items.own[v] == (need[v] & ~above if v else 0)
        row = items.words()[v]
        assert int.from_bytes(row.tobytes(), "little") == (need[0] if v == 0 else items.own[v])
    assert items.root_new_per_layer == items.per_layer(need[0])
    assert items.any_uncached() == any(need)


@pytest.mark.parametrize("parents, experts, field", [
    ([-1, 5], np.zeros((2, 1, 1), dtype=np.int64), "parents"),  # not an earlier node
    ([0], np.zeros((1, 1, 1), dtype=np.int64), "parents"),  # the first node must be the root
    ([-1, -1], np.zeros((2, 1, 1), dtype=np.int64), "parents"),  # one root
    ([-1, 0], np.full((2, 1, 1), 4), "experts"),  # an id outside [0, 4)
    ([-1, 0], np.zeros((3, 1, 1), dtype=np.int64), "experts"),  # one row per node
    ([-1, 0], np.zeros((2, 2, 1), dtype=np.int64), "cache"),  # one row per layer of the cache
    ([-1, 0.9], np.zeros((2, 1, 1), dtype=np.int64), "parents"),  # integers, not truncated floats
    ([-1, "0"], np.zeros((2, 1, 1), dtype=np.int64), "parents"),
    (np.zeros((2, 1), dtype=np.int64), np.zeros((2, 1, 1), dtype=np.int64), "parents"),  # one dimension
    (None, np.zeros((1, 1, 1), dtype=np.int64), "parents"),
    ([-1, 0], np.full((2, 1, 1), 2.7), "experts"),
    ([-1, 0], np.ones((2, 1, 1), dtype=bool), "experts"),
    ([-1, 0], [[[1]], [[1, 2]]], "experts"),  # ragged
    ([-1, 0], [[[1]], [[2 ** 70]]], "experts"),  # beyond int64
])
def test_extend_refuses_bad_nodes_and_appends_nothing(parents, experts, field):
    items = ItemSets(np.zeros((1, 4), dtype=bool))
    with pytest.raises(SpecFitInputError) as err:
        items.extend(parents, experts)
    assert err.value.field == field
    assert len(items) == 0 and items.words().shape == (0, 1) and items.need == []


def test_extend_takes_empty_levels_and_other_integer_types():
    items = ItemSets(np.zeros((1, 4), dtype=bool))
    for parents, experts in (([], []), ([], np.zeros(0)), (np.array([], np.int32), np.zeros((0, 1, 1), np.int64))):
        items.extend(parents, experts)
    assert len(items) == 0
    items.extend(np.array([-1], np.int32), np.array([[[3]]], np.uint8))
    items.extend((0,), [[[1]]])
    assert items.need == [1 << 3, 1 << 1] and items.own == [0, 1 << 1]


def test_int_arrays_refuse_unsigned_ids_beyond_int64():
    from specfit.core.errors import as_int_array

    with pytest.raises(SpecFitInputError, match="int64") as err:
        as_int_array(np.array([0, 2 ** 64 - 1], dtype=np.uint64), "tokens", 1)  # astype(int64) would give -1
    assert err.value.field == "tokens"
    assert as_int_array(np.array([0, 2 ** 63 - 1], dtype=np.uint64), "tokens", 1).tolist() == [0, 2 ** 63 - 1]


@pytest.mark.parametrize("cache", [np.zeros(4, dtype=bool), np.zeros((1, 2, 3), dtype=bool)])
def test_item_sets_refuse_a_cache_that_is_not_layers_by_experts(cache):
    with pytest.raises(SpecFitInputError) as err:
        ItemSets(cache)
    assert err.value.field == "cache"


def test_extend_refuses_expert_ids_out_of_range():
    items = ItemSets(np.zeros((1, 4), dtype=bool))
    with pytest.raises(SpecFitInputError, match="experts"):
        items.extend([-1], np.array([[[4]]]))
    with pytest.raises(SpecFitInputError, match="experts"):
        items.extend([-1], np.array([[[-1]]]))


def test_extend_refuses_a_cache_with_other_layers_than_the_experts():
    """The compiled pass reads cache[l, e] unchecked: a cache with fewer layers is refused by field first."""
    items = ItemSets(np.zeros((1, 8), dtype=bool))
    with pytest.raises(SpecFitInputError, match="cache"):
        items.extend([-1], np.zeros((1, 3, 1), dtype=np.int64))
    tree = DraftTree([-1, 0], path_prob=[1.0, 0.5], experts=np.zeros((2, 4, 1), np.int64), num_experts=8)
    with pytest.raises(SpecFitInputError, match="cache"):
        tree.items(np.zeros((1, 8), dtype=bool))
