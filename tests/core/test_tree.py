"""Draft tree: derived views, subtree extraction, JSON round trip."""

import json

import networkx as nx
import numpy as np
import pytest

from specfit.core.cost import CostModel
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance, load_instance, save_instance
from specfit.core.tree import DraftTree

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
PARENTS = [-1, 0, 0, 1, 1, 2]
Q = [1.0, 0.6, 0.3, 0.5, 0.25, 0.9]


def test_path_prob_is_product_of_q_along_the_root_path():
    t = DraftTree(PARENTS, q=Q)
    assert t.path_prob.tolist() == pytest.approx([1.0, 0.6, 0.3, 0.3, 0.15, 0.27])
    back = DraftTree(PARENTS, path_prob=t.path_prob)
    assert back.q[1:].tolist() == pytest.approx(Q[1:])


def test_depth_children_paths():
    t = DraftTree(PARENTS, q=Q)
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 2]
    assert t.children == [[1, 2], [3, 4], [5], [], [], []]


def test_ancestor_mask_matches_networkx_ancestors():
    rng = np.random.default_rng(3)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, 30)]
    t = DraftTree(parents, q=rng.uniform(size=30))
    for i in range(30):
        expected = nx.ancestors(t.to_networkx(), i) | {i}
        assert set(np.flatnonzero(t.ancestor_mask[i]).tolist()) == expected


def test_subtree_renumbers_and_keeps_data():
    exp = np.arange(6 * 1 * 2).reshape(6, 1, 2) % 5
    t = DraftTree(PARENTS, q=Q, tokens=[5, 6, 7, 8, 9, 10], experts=exp, num_experts=5)
    sub, old = t.subtree([0, 2, 5, 1])
    assert old.tolist() == [0, 1, 2, 5]
    assert sub.parents.tolist() == [-1, 0, 0, 2]
    assert sub.tokens.tolist() == [5, 6, 7, 10]
    assert sub.path_prob.tolist() == pytest.approx([1.0, 0.6, 0.3, 0.27])
    assert sub.experts.tolist() == exp[[0, 1, 2, 5]].tolist()
    with pytest.raises(SpecFitInputError, match="ancestor-closed"):
        t.subtree([0, 5])


def test_instance_json_round_trip(tmp_path):
    exp = np.argsort(np.random.default_rng(0).random((6, 3, 8)), axis=2)[..., :2]  # a node's experts are a set
    t = DraftTree(PARENTS, q=Q, tokens=[1, 2, 3, 4, 5, 6], experts=exp, num_experts=8)
    cache = np.zeros((3, 8), dtype=bool)
    cache[1, [2, 5]] = True
    inst = Instance(t, CostModel(12.0, 0.3, [0.1, 0.2, 0.3]), cache, max_nodes=4, max_new_experts_per_layer=9)
    path = tmp_path / "inst.json"
    save_instance(inst, path)
    obj = json.loads(path.read_text())
    assert obj["cache"] == [[], [2, 5], []]
    back = load_instance(path)
    assert back.to_json() == inst.to_json()
    assert back.tree.experts.tolist() == exp.tolist()
    assert not list(tmp_path.glob("*.tmp"))


def test_instance_without_layers_has_no_expert_term():
    inst = Instance.from_json({"parents": [-1, 0], "path_prob": [1.0, 0.5], "num_experts": 4,
                               "experts": [[], []], "cost": {"fixed_ms": 1, "per_node_ms": 0, "per_expert_ms": 1}})
    assert inst.num_layers == 0
    assert inst.items.new_per_layer([0, 1]).tolist() == []
