"""Hypothesis strategies for small random selection instances (reused across the solver tests).

``instances(...)`` draws a draft tree (parents before children), path probabilities as products of
q (with ties from a few round values), predicted experts per layer, an expert cache, a cost model
(scalar or per-layer ``per_expert_ms``) and optional budgets. ``level_instances(...)`` draws a tree
grown level by level (every node of level d+1 hangs off level d) for the stop-rule test.
``near_tie_instances(...)`` draws instances in which some children's path probability exceeds their
parent's by up to the validator's tolerance :data:`specfit.core.tree.PROB_TOL` (float round-off in a
drafter's products), which the validator admits.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from specfit.core.cost import CostModel, HostProfile
from specfit.core.instance import Instance
from specfit.core.tree import PROB_TOL, DraftTree

#: Budget kinds accepted by :func:`instances`.
BUDGETS = ("none", "nodes", "experts", "both")

_q = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.01, 1.0))


@st.composite
def costs(draw, layers: int, per_expert_zero: bool = False) -> CostModel:
    """A cost model with fixed_ms in [0.5, 20], per_node_ms in [0, 3], per_expert_ms in [0, 3] and
    read_ms (the read of every routed expert, resident or not) 0 or in [0, 2] (0 with ``per_expert_zero``:
    no expert term at all)."""
    fixed = draw(st.floats(0.5, 20.0))
    per_node = draw(st.floats(0.0, 3.0))
    if per_expert_zero:
        per_expert = 0.0
    elif layers and draw(st.booleans()):
        per_expert = draw(st.lists(st.floats(0.0, 3.0), min_size=layers, max_size=layers))
    else:
        per_expert = draw(st.floats(0.0, 3.0))
    read = 0.0 if per_expert_zero else draw(st.sampled_from([0.0]) | st.floats(0.0, 2.0))
    return CostModel(fixed, per_node, per_expert, read_ms=read)


@st.composite
def host_costs(draw, layers: int) -> HostProfile:
    """A host-regime profile for ``layers`` MoE layers: a GPU side as :func:`costs` (its per-expert
    term unused) standing for R in [max(layers, 1), 8] reference layers, host ms per expert in [0, 3],
    per row in [0, 1], sync in [0, 1], a sunk extra in [0, 5] ms and a per-draft-node extra in [0, 2]
    ms, so that either side of the per-layer max can bind; the GPU side reads each resident expert the
    nodes route to at read_ms 0 or in [0, 1]."""
    ref = draw(st.integers(max(layers, 1), 8))
    gpu = CostModel(draw(st.floats(0.5, 20.0)), draw(st.floats(0.0, 3.0)), 0.0, reference_layers=ref,
                    read_ms=draw(st.sampled_from([0.0]) | st.floats(0.0, 1.0)))
    prof = HostProfile("drawn", gpu, 80.0, draw(st.floats(0.0, 3.0)), draw(st.floats(0.0, 1.0)),
                       draw(st.floats(0.0, 1.0)), extra_ms=draw(st.sampled_from([0.0]) | st.floats(0.0, 5.0)),
                       node_extra_ms=draw(st.sampled_from([0.0]) | st.floats(0.0, 2.0)))
    return prof.for_layers(layers) if layers else prof


@st.composite
def _experts_and_cache(draw, n: int, layers: int, num_experts: int):
    k = draw(st.integers(1, min(num_experts, 3)))
    ids = st.lists(st.integers(0, num_experts - 1), min_size=k, max_size=k, unique=True)
    experts = np.array([[draw(ids) for _ in range(layers)] for _ in range(n)], dtype=np.int64).reshape(n, layers, k)
    cache = np.zeros((layers, num_experts), dtype=bool)
    for l in range(layers):
        cache[l, draw(st.lists(st.integers(0, num_experts - 1), max_size=num_experts, unique=True))] = True
    return experts, cache


def _with_budgets(draw, tree: DraftTree, cost: CostModel, cache, budget: str) -> Instance:
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {BUDGETS}")
    inst = Instance(tree, cost, cache)
    max_nodes = draw(st.integers(1, tree.n)) if budget in ("nodes", "both") else None
    max_new = None
    if budget in ("experts", "both"):
        root = int(inst.items.new_per_layer([0]).max(initial=0))
        max_new = draw(st.integers(root, root + 4))
    return Instance(tree, cost, cache, max_nodes, max_new)


@st.composite
def instances(draw, min_nodes: int = 1, max_nodes: int = 12, budget: str = "none",
              per_expert_zero: bool = False, host: bool = False) -> Instance:
    """A random instance with ``min_nodes..max_nodes`` nodes, 0-3 layers, 1-6 experts, top-1..3.

    Parameters
    ----------
    budget : str
        One of :data:`BUDGETS`: which of ``max_nodes`` / ``max_new_experts_per_layer`` to set
        (always feasible for the root).
    per_expert_zero : bool
        Force ``per_expert_ms = 0`` (no expert term).
    host : bool
        Draw a host-compute regime cost (:func:`host_costs`) instead of a transfer one.
    """
    n = draw(st.integers(min_nodes, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    q = [1.0] + [draw(_q) for _ in range(1, n)]
    layers = draw(st.integers(0, 3))
    num_experts = draw(st.integers(1, 6))
    experts, cache = draw(_experts_and_cache(n, layers, num_experts))
    tree = DraftTree(parents, q=q, experts=experts, num_experts=num_experts)
    cost = draw(host_costs(layers)) if host else draw(costs(layers, per_expert_zero))
    return _with_budgets(draw, tree, cost, cache, budget)


@st.composite
def level_instances(draw, max_total: int = 14, budget: str = "none",
                    host: bool = False) -> tuple[Instance, list[int]]:
    """A tree drafted level by level and the node count after each level.

    Returns
    -------
    instance : Instance
        Nodes in BFS order; the nodes of level d+1 all have parents in level d.
    host : bool
        Draw a host-compute regime cost (:func:`host_costs`).
    ends : list of int
        ``ends[d]``: number of nodes in levels 0..d, so nodes ``range(ends[d])`` are the tree
        drafted after level d (``ends[0] == 1``, ``ends[-1] == n``).
    """
    parents, q, ends = [-1], [1.0], [1]
    level = [0]
    while len(parents) < max_total:
        new = []
        for v in level:
            for _ in range(draw(st.integers(0, 2))):
                if len(parents) < max_total:
                    parents.append(v)
                    q.append(draw(_q))
                    new.append(len(parents) - 1)
        if not new:
            break
        ends.append(len(parents))
        level = new
    n = len(parents)
    layers = draw(st.integers(0, 3))
    num_experts = draw(st.integers(1, 6))
    experts, cache = draw(_experts_and_cache(n, layers, num_experts))
    tree = DraftTree(parents, q=q, experts=experts, num_experts=num_experts)
    cost = draw(host_costs(layers)) if host else draw(costs(layers))
    return _with_budgets(draw, tree, cost, cache, budget), ends


@st.composite
def near_tie_instances(draw, max_nodes: int = 10, budget: str = "none") -> Instance:
    """An instance whose path probabilities are ``P_parent + δ`` for some children, δ in (0, PROB_TOL].

    Path probabilities are drawn directly (not as products of q): each node either ties its parent
    up to ``δ`` above it, or takes a value in [0, P_parent]. Budgets as in :func:`instances`.
    """
    n = draw(st.integers(2, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    prob = [1.0]
    for v in range(1, n):
        p = prob[parents[v]]
        if draw(st.booleans()):
            delta = draw(st.sampled_from([PROB_TOL, PROB_TOL / 2, 1e-12]) | st.floats(1e-15, PROB_TOL))
            prob.append(min(p + delta, 1.0))
        else:
            prob.append(draw(st.sampled_from([0.0, p]) | st.floats(0.0, 1.0).map(lambda x, p=p: x * p)))
    layers = draw(st.integers(0, 2))
    num_experts = draw(st.integers(1, 4))
    experts, cache = draw(_experts_and_cache(n, layers, num_experts))
    tree = DraftTree(parents, path_prob=prob, experts=experts, num_experts=num_experts)
    return _with_budgets(draw, tree, draw(costs(layers)), cache, budget)


# --- numeric edges: values a user (or a fuzzer) puts where a number goes --------------------------
#: Real numbers no field accepts: NaN and the infinities.
NON_FINITE = (float("nan"), float("inf"), float("-inf"))


def non_integers() -> st.SearchStrategy:
    """Values that are not integers though they may look like one: integral and fractional floats
    (``2.0``, ``1.5``, ``-0.0``), NaN and infinities, booleans, numeric strings, None, lists."""
    return st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0.0, -0.0, 1.0, 2.0, 1e30, *NON_FINITE]),
        st.booleans(),
        st.sampled_from(["7", "1", "1.0", "nan", "", " 3 ", "0x10"]),
        st.none(),
        st.lists(st.integers(0, 3), max_size=2),
    )


def non_numbers() -> st.SearchStrategy:
    """Values that are not finite real numbers: NaN, infinities, booleans, numeric strings, None."""
    return st.one_of(st.sampled_from(NON_FINITE), st.booleans(),
                     st.sampled_from(["1", "0.5", "nan", "inf", ""]), st.none())


def edge_integers(low: int, high: int | None) -> st.SearchStrategy:
    """Integers just outside ``[low, high]`` and far outside (negatives, beyond int64)."""
    out = [st.integers(max_value=low - 1), st.sampled_from([low - 1, -(2 ** 63), -(2 ** 64)])]
    if high is not None:
        out += [st.integers(min_value=high + 1), st.sampled_from([high + 1, 2 ** 63, 2 ** 64, 10 ** 30])]
    return st.one_of(*out)


def edge_floats(low: float | None, high: float | None) -> st.SearchStrategy:
    """Finite floats just outside ``[low, high]`` (and huge ones beyond ``high``)."""
    out = []
    if low is not None:
        out.append(st.floats(max_value=low, exclude_max=True, allow_nan=False, allow_infinity=False))
    if high is not None:
        out.append(st.floats(min_value=high, exclude_min=True, allow_nan=False, allow_infinity=False))
    return st.one_of(*out)


#: Command-line spellings of the same edges (argparse hands strings to our parsers).
EDGE_STRINGS = ("nan", "NaN", "inf", "-inf", "infinity", "1e400", "-1e400", "-0", "-0.0", "1.5", "2.0", "-1",
                "99999999999999999999999", "1e30", "true", "", " ", "0x10", "1_000", "\u0661", "\u00b2", "7\u00a0")
