"""The public entry point ``specfit.solvers.select``: a networkx DAG in, the same selection as the
instance-based path out, with the caller's node labels."""

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.cost import get_profile
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance
from specfit.core.tree import DraftTree
from specfit.solvers import get_solver, select

from strategies import instances


def _as_graph(inst: Instance) -> tuple[nx.DiGraph, list]:
    """The instance's tree as a graph with string labels; the cache as lists of ids."""
    g = nx.relabel_nodes(inst.tree.to_networkx(), {v: f"node-{v}" for v in range(inst.n)})
    return g, [np.flatnonzero(row).tolist() for row in inst.cache]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["none", "nodes", "experts", "both"]).flatmap(lambda b: instances(budget=b)),
       st.sampled_from(["exact", "scan", "greedy", "eagle"]), st.one_of(st.none(), st.floats(0.0, 500.0)))
def test_select_on_a_graph_equals_the_instance_path(inst, solver, rate):
    g, cache = _as_graph(inst)
    got = select(g, inst.cost, cache, solver=solver, max_nodes=inst.max_nodes,
                 max_new_experts_per_layer=inst.max_new_experts_per_layer, rate=rate)
    # the same tree in the graph's breadth-first numbering, through the instance path
    bfs = DraftTree.from_networkx(g)
    same = Instance(bfs, inst.cost, inst.cache, inst.max_nodes, inst.max_new_experts_per_layer)
    want = get_solver(solver).solve(same, rate=rate)
    assert got.nodes == tuple(bfs.labels[v] for v in want.nodes)
    assert got.nodes[0] == "node-0"
    assert (got.expected_tokens, got.predicted_ms, got.status) == (want.expected_tokens, want.predicted_ms, want.status)
    # and the same value as on the original numbering (the optimum, for exact)
    if solver == "exact":
        orig = get_solver(solver).solve(inst, rate=rate)
        assert got.objective == pytest.approx(orig.objective, rel=1e-9)


def test_select_takes_a_profile_name_and_num_experts_from_graph_or_profile():
    g = nx.DiGraph()
    g.add_node("r", path_prob=1.0, experts=[[0, 1]])
    g.add_node("a", path_prob=0.9, experts=[[0, 1]])   # cached experts only: cheap
    g.add_node("b", path_prob=0.1, experts=[[2, 3]])   # two transfers for 0.1 tokens
    g.add_edges_from([("r", "a"), ("r", "b")])
    sel = select(g, "qwen3-30b-a3b-pcie4", cache=[[0, 1]])  # num_experts from the profile (128)
    assert sel.nodes == ("r", "a")
    # both resident experts are read once (read_ms each), none copied
    assert sel.predicted_ms == pytest.approx(get_profile("qwen3-30b-a3b-pcie4").cycle_ms(2, [0], None, [2]))
    g.graph["num_experts"] = 3
    with pytest.raises(SpecFitInputError) as err:  # the graph's num_experts wins: id 3 is out of range
        select(g, "qwen3-30b-a3b-pcie4")
    assert err.value.field == "graph.nodes['b'].experts[0]"


def test_select_takes_a_host_regime_profile_by_name_or_object():
    from specfit.core.cost import DEFAULT_HOST_PROFILE, get_host_profile

    g = nx.DiGraph()
    g.add_node("r", path_prob=1.0, experts=[[0, 1]])
    g.add_node("a", path_prob=0.9, experts=[[0, 1]])
    g.add_node("b", path_prob=0.1, experts=[[2, 3]])
    g.add_edges_from([("r", "a"), ("r", "b")])
    host = get_host_profile(DEFAULT_HOST_PROFILE)
    sel = select(g, DEFAULT_HOST_PROFILE, cache=[[0, 1]])  # num_experts from the profile's GPU side (128)
    assert sel.nodes == ("r", "a")
    # both nodes cached: the GPU forward and one read of each of the two resident experts
    assert sel.predicted_ms == pytest.approx(host.cycle_ms(2, [0], [0], None, [2]))
    g.graph["num_experts"] = 4  # an object, unlike a name, brings no num_experts
    assert select(g, host.for_layers(1), cache=[[0, 1]]).predicted_ms == pytest.approx(sel.predicted_ms)


def test_select_accepts_a_draft_tree_and_returns_ids():
    t = DraftTree([-1, 0, 0], path_prob=[1.0, 0.5, 0.4], experts=[[[0]], [[0]], [[1]]], num_experts=2)
    assert select(t, "qwen3-30b-a3b-h200", [[0]], solver="scan").nodes == (0, 1, 2)


@pytest.mark.parametrize("kwargs, field", [
    (dict(cost="no-such-profile"), "profile"),
    (dict(cost=3.0), "cost"),
    (dict(solver="nope"), "solver"),
    (dict(cache=[[0], [1]]), "cache"),
    (dict(cache=[[7]]), "cache[0]"),
    (dict(rate=-1.0), "rate"),
    (dict(max_nodes=0), "max_nodes"),
    (dict(tree=[[0, 1]]), "tree"),
])
def test_select_rejects_bad_input_naming_the_field(kwargs, field):
    g = nx.DiGraph(num_experts=2)
    g.add_node(0, path_prob=1.0, experts=[[0]])
    g.add_node(1, path_prob=0.5, experts=[[1]])
    g.add_edge(0, 1)
    args = {"tree": g, "cost": "qwen3-30b-a3b-pcie4", **kwargs}
    with pytest.raises(SpecFitInputError) as err:
        select(args.pop("tree"), args.pop("cost"), **args)
    assert err.value.field == field


@pytest.mark.parametrize("solver", ["exact", "bruteforce", "greedy", "scan", "eagle"])
def test_solve_ms_starts_after_the_coverage_kernel_is_loaded(solver, monkeypatch):
    """A process's first solve loads the compiled coverage kernel (numba's import: ~0.5-1 s); ``solve_ms``
    times the selection only, so the loader runs before the solver reads its clock."""
    import specfit.solvers.base as base
    import specfit.core.kernels as kernels

    events = []
    load, clock = kernels.item_words_kernel, base.time.perf_counter
    monkeypatch.setattr(kernels, "item_words_kernel", lambda: (events.append("load"), load())[1])
    monkeypatch.setattr(base.time, "perf_counter", lambda: (events.append("clock"), clock())[1])
    inst = Instance.from_json({"parents": [-1, 0, 0, 1], "path_prob": [1.0, 0.6, 0.3, 0.42], "num_experts": 16,
                               "experts": [[[3, 9], [1, 4]], [[3, 5], [1, 4]], [[2, 9], [6, 4]], [[3, 9], [1, 7]]],
                               "cache": [[3], [4, 7]],
                               "cost": {"fixed_ms": 12.0, "per_node_ms": 0.3, "per_expert_ms": 0.19}})
    get_solver(solver).solve(inst)
    assert "load" in events and "clock" in events and events.index("load") < events.index("clock")
