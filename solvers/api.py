"""The public entry point: select the verified subtree of a draft tree given as a networkx DAG.

``select`` is what a user of the library calls (re-exported as ``specfit.select``): it takes the
draft tree in the interchange form of the design card — a networkx ``DiGraph`` whose nodes carry
``path_prob`` and ``experts`` (docs/SPECFIT.md §2) — or a :class:`~specfit.core.tree.DraftTree`, a
cost model or a named hardware profile, and the expert cache as lists of ids; it builds the
:class:`~specfit.core.instance.Instance` (numpy arrays inside) and runs a registered solver.
"""

from __future__ import annotations

from dataclasses import replace

import networkx as nx

from specfit.core.cost import HOST_PROFILES, CostModel, HostProfile, get_host_profile, get_profile
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance, cache_mask
from specfit.core.tree import DraftTree
from specfit.solvers.base import Selection, get_solver


def select(tree, cost=None, cache=None, *, solver: str = "exact", num_experts: int | None = None,
           max_nodes: int | None = None, max_new_experts_per_layer: int | None = None,
           rate: float | None = None, time_limit_s: float | None = None) -> Selection:
    """Select the subtree of a draft tree to verify: maximise ``A(S) / T(S)`` (or ``A - λT``).

    Parameters
    ----------
    tree : networkx.DiGraph, DraftTree or Instance
        The draft tree. An :class:`~specfit.core.instance.Instance` (e.g. from
        :func:`~specfit.core.instance.load_instance`, the JSON of SPECFIT.md §4) already carries its
        cost model, cache and budgets: then ``cost``, ``cache`` and ``num_experts`` must be None, and
        ``max_nodes`` / ``max_new_experts_per_layer`` override the instance's budgets when given. A ``DiGraph`` has edges parent → child and node attributes ``path_prob``
        (float in [0, 1], 1 at the root, non-increasing along paths), ``experts`` (``experts[l]``:
        the k expert ids the node is predicted to route to in MoE layer l; optional — without it
        there is no expert term) and optionally ``token``; node labels may be any hashable
        (:meth:`DraftTree.from_networkx`).
    cost : CostModel, HostProfile or str
        The cycle-time model in ms (SPECFIT.md §3), or the name of a hardware profile of
        :data:`specfit.core.cost.PROFILES` (e.g. ``"qwen3-30b-a3b-pcie4"``) or of the host-compute
        regime's :data:`specfit.core.cost.HOST_PROFILES`, used as is (a host profile counts each of the
        tree's layers for R / L real ones). Required unless ``tree`` is an Instance.
    cache : list of list of int, optional
        ``cache[l]``: the experts of MoE layer l resident on the device (empty cache if None).
    solver : str
        A registered solver (:func:`specfit.solvers.available_solvers`); default ``exact``.
    num_experts : int, optional
        Experts per MoE layer; default ``tree.graph["num_experts"]``, else the profile's.
    max_nodes : int, optional
        Budget on |S|, root included.
    max_new_experts_per_layer : int, optional
        Budget on the uncached experts per layer.
    rate : float, optional
        Long-run rate λ in tokens/s: maximise ``A - (λ/1000) T`` instead of ``A / T``.
    time_limit_s : float, optional
        Wall-clock limit of solvers that take one (``exact``, ``cpsat``); refused by the others.

    Returns
    -------
    Selection
        ``nodes`` are the caller's node labels when ``tree`` is a graph (in the tree's breadth-first
        order, root first), else the sorted node ids; ``expected_tokens`` A(S) in tokens,
        ``predicted_ms`` T(S) in ms, ``throughput`` in tokens/s, ``solve_ms``, ``status``.

    Raises
    ------
    SpecFitInputError
        Naming the field and the rule: a graph that is not a rooted tree or lacks an attribute
        (``graph.nodes[<label>].<attribute>``), an unknown profile or solver, a bad cache,
        cost, budget or rate.

    Examples
    --------
    >>> import networkx as nx
    >>> g = nx.DiGraph(num_experts=4)
    >>> g.add_node("root", path_prob=1.0, experts=[[0, 1]])
    >>> g.add_node("a", path_prob=0.9, experts=[[0, 1]])
    >>> g.add_node("b", path_prob=0.1, experts=[[2, 3]])
    >>> g.add_edges_from([("root", "a"), ("root", "b")])
    >>> select(g, "qwen3-30b-a3b-pcie4", cache=[[0, 1]]).nodes
    ('root', 'a')
    """
    options = {} if time_limit_s is None else {"time_limit_s": time_limit_s}
    if isinstance(tree, Instance):
        for name, value in (("cost", cost), ("cache", cache), ("num_experts", num_experts)):
            if value is not None:
                raise SpecFitInputError(name, "must be None when tree is an Instance (the instance carries it)")
        budgets = {k: v for k, v in (("max_nodes", max_nodes), ("max_new_experts_per_layer", max_new_experts_per_layer))
                   if v is not None}
        return get_solver(solver, **options).solve(replace(tree, **budgets), rate=rate)
    profile = None
    if cost is None:
        raise SpecFitInputError("cost", "is required: a CostModel, a HostProfile or a hardware profile name")
    if isinstance(cost, str):
        profile = cost = get_host_profile(cost) if cost in HOST_PROFILES else get_profile(cost)
    elif not isinstance(cost, (CostModel, HostProfile)):
        raise SpecFitInputError("cost", "must be a CostModel, a HostProfile or a hardware profile name, got "
                                f"{type(cost).__name__}")
    if isinstance(tree, nx.DiGraph):
        if num_experts is None:
            num_experts = tree.graph.get("num_experts", profile.num_experts if profile is not None else None)
        draft = DraftTree.from_networkx(tree, num_experts=num_experts)
    elif isinstance(tree, DraftTree):
        draft = tree
    else:
        raise SpecFitInputError("tree", f"must be a networkx.DiGraph or a DraftTree, got {type(tree).__name__}")
    mask = None
    if cache is not None:
        mask = cache_mask(cache, draft.num_layers, draft.num_experts or 0)
    instance = Instance(draft, cost, mask, max_nodes, max_new_experts_per_layer)
    sel = get_solver(solver, **options).solve(instance, rate=rate)
    if draft.labels is None:
        return sel
    return replace(sel, nodes=tuple(draft.labels[v] for v in sel.nodes))
