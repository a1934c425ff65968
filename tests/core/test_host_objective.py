"""The host-compute regime as the selection's objective: an Instance whose cost is a HostProfile."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.cost import CostModel, HostProfile
from specfit.core.coverage import GrowingSelection
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance
from specfit.core.objective import evaluate, predicted_ms
from specfit.core.tree import DraftTree
from strategies import instances

GPU = CostModel(4.8, 0.1, 0.4, reference_layers=48, draft_level_ms=0.5, host_level_ms=0.6)
HOST = HostProfile("t", GPU, 80.0, 0.1, 0.02, 0.03)


def star() -> Instance:
    """Root and two children over 2 layers of 4 experts, top-2; experts 0 and 1 cached in both layers."""
    experts = np.array([[[0, 2], [1, 2]],      # root: uncached 2 | 2
                        [[2, 3], [0, 1]],      # a: uncached 2, 3 | none
                        [[3, 1], [2, 3]]])     # b: uncached 3 | 2, 3
    tree = DraftTree([-1, 0, 0], path_prob=[1.0, 0.6, 0.3], experts=experts, num_experts=4)
    cache = np.zeros((2, 4), dtype=bool)
    cache[:, :2] = True
    return Instance(tree, HOST.for_layers(2), cache)


def test_rows_count_each_nodes_uncached_experts():
    inst = star()
    assert inst.items.rows.tolist() == [[1, 1], [2, 0], [1, 2]]
    assert inst.items.rows_per_layer([0, 1, 2]).tolist() == [4, 3]
    assert inst.items.new_per_layer([0, 1, 2]).tolist() == [2, 2]


def test_host_objective_is_the_profiles_per_layer_max():
    inst = star()
    # union: layer 0 {2, 3}, layer 1 {2, 3}; rows 4 and 3 -> the profile's cycle time of those counts
    want = HOST.for_layers(2).cycle_ms(3, [2, 2], [4, 3])
    assert predicted_ms(inst, [0, 1, 2]) == pytest.approx(want)
    g = (4.8 + 0.1 * 3) / 48
    layer = [max(g, 0.1 * 2 + 0.02 * 4) + 0.03, max(g, 0.1 * 2 + 0.02 * 3) + 0.03]
    assert want == pytest.approx(24 * sum(layer))
    ev = evaluate(inst, [0, 1])
    assert ev.predicted_ms == pytest.approx(HOST.for_layers(2).cycle_ms(2, [2, 1], [3, 1]))
    assert ev.throughput == pytest.approx(1000 * 1.6 / ev.predicted_ms)


def test_transfer_objective_is_unchanged():
    inst = star()
    transfer = Instance(inst.tree, CostModel(6.0, 0.1, 0.3932), inst.cache)
    assert predicted_ms(transfer, [0, 1, 2]) == 6.0 + 0.1 * 3 + 0.3932 * 4


def test_extra_ms_sits_outside_the_max_and_layers_must_match():
    inst = star()
    p = HOST.for_layers(2)
    assert Instance(inst.tree, p.plus_ms(1.5), inst.cache).tree is inst.tree
    assert predicted_ms(Instance(inst.tree, p.plus_ms(1.5), inst.cache), [0]) == pytest.approx(
        predicted_ms(inst, [0]) + 1.5)
    with pytest.raises(SpecFitInputError, match="cost"):
        Instance(inst.tree, HOST.for_layers(3), inst.cache)


def test_a_cached_node_can_add_nothing_so_min_node_ms_is_zero():
    # host binds (4 uncached experts at 1 ms each per layer); node 1 routes to cached experts only
    experts = np.array([[[4, 5, 6, 7]], [[0, 1, 2, 3]]])
    cache = np.zeros((1, 8), dtype=bool)
    cache[0, :4] = True
    p = HostProfile("t", GPU, 80.0, 1.0, 0.0, 0.0).for_layers(1)
    inst = Instance(DraftTree([-1, 0], path_prob=[1.0, 0.5], experts=experts, num_experts=8), p, cache)
    assert predicted_ms(inst, [0, 1]) == predicted_ms(inst, [0])
    assert p.min_node_ms == 0.0 and GPU.min_node_ms == GPU.per_node_ms


def test_node_added_ms_is_the_single_node_increment():
    inst = star()
    p = inst.cost
    root = inst.items.root_new_per_layer
    new = np.array([inst.items.per_layer(inst.items.need[v] & ~inst.items.need[0]) for v in (1, 2)])
    got = p.node_added_ms(root, new, inst.items.rows[1:])
    want = [predicted_ms(inst, [0, v]) - predicted_ms(inst, [0]) for v in (1, 2)]
    assert got == pytest.approx(want)
    assert GPU.node_added_ms(root, new, inst.items.rows[1:]) == pytest.approx(new @ [0.4, 0.4])
    # node_extra_ms is every draft node's, so min_node_ms: the increment beyond it is unchanged
    extra = Instance(inst.tree, replace(p, node_extra_ms=0.5), inst.cache)
    assert extra.cost.min_node_ms == 0.5
    assert extra.cost.node_added_ms(root, new, inst.items.rows[1:]) == pytest.approx(want)
    assert [predicted_ms(extra, [0, v]) - predicted_ms(extra, [0]) for v in (1, 2)] == pytest.approx(np.add(want, 0.5))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_growing_selection_tracks_the_host_objective_and_t_is_monotone(data):
    inst = data.draw(instances(host=True))
    order = data.draw(st.permutations(range(1, inst.n)))
    grow = GrowingSelection(inst)
    assert grow.t == pytest.approx(predicted_ms(inst, [0]))
    for v in order:
        if not grow.in_set[inst.tree.parents[v]]:
            continue
        before, step = grow.t, grow.step_ms(v)
        grow.add(v)
        assert grow.t == pytest.approx(predicted_ms(inst, grow.nodes()), rel=1e-12, abs=1e-12)
        assert grow.t - before == pytest.approx(step, rel=1e-9, abs=1e-9)
        assert step >= -1e-12  # T is monotone in S


def test_host_instance_json_round_trips(tmp_path):
    from specfit.core.instance import load_instance, save_instance

    inst = Instance(star().tree, HOST.for_layers(2).plus_ms(0.7), star().cache, max_nodes=2)
    save_instance(inst, tmp_path / "host.json")
    back = load_instance(tmp_path / "host.json")
    assert back.cost == inst.cost and back.cost.extra_ms == 0.7 and back.cost.reference_layers == 48
    assert predicted_ms(back, [0, 1]) == predicted_ms(inst, [0, 1])
    obj = inst.to_json()
    for bad, field in (({"regime": "cpu"}, "cost.regime"), ({"sync_ms": -1.0}, "cost.sync_ms"),
                       ({"surprise": 1}, "cost.surprise"), ({"num_layers": 0}, "cost.num_layers")):
        with pytest.raises(SpecFitInputError, match=field):
            Instance.from_json({**obj, "cost": {**obj["cost"], **bad}})
    del obj["cost"]["gpu"]
    with pytest.raises(SpecFitInputError, match="cost.gpu"):
        Instance.from_json(obj)
    transfer = {**obj, "cost": {"regime": "transfer", "fixed_ms": 1.0, "per_node_ms": 0.1, "per_expert_ms": 0.2}}
    assert Instance.from_json(transfer).cost == CostModel(1.0, 0.1, 0.2)
