"""Brute force over every ancestor-closed subtree: the reference the tests check other solvers
against. Exponential; refuses trees with more than :data:`MAX_NODES` nodes."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specfit.solvers.base import Solver
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance

#: Largest tree :class:`BruteForceSolver` accepts (a star of 20 nodes has 2^19 subtrees).
MAX_NODES = 20


class BruteForceSolver(Solver):
    """Enumerate all ancestor-closed subtrees within budget and keep the best (tests only).

    The enumeration decides nodes in index order (parents precede children), so a node is
    included only when its parent is; a node whose inclusion breaks a budget is skipped with its
    whole subtree, which loses nothing because |S| and the coverage only grow with S.
    ``A`` is carried down the recursion and ``T`` recomputed from integer counts at each leaf,
    so no rounding accumulates. Ties keep the first set found (fewer, lower-index nodes). In the
    host-compute regime (a :class:`~specfit.core.cost.HostProfile` cost) the leaf prices its counts
    with the profile's own :meth:`~specfit.core.cost.HostProfile.cycle_ms` (uncached experts and
    rows per layer), the function :func:`specfit.core.objective.evaluate` uses.

    Raises
    ------
    SpecFitInputError
        From :meth:`solve`, if the tree has more than :data:`MAX_NODES` nodes (field ``parents``).
    """

    name = "bruteforce"
    exact = True

    def select(self, instance: Instance, rate: float | None) -> tuple[Sequence[int], str]:
        n = instance.n
        if n > MAX_NODES:
            raise SpecFitInputError("parents", f"bruteforce enumerates all subtrees and accepts at most {MAX_NODES} "
                                    f"nodes, got {n}")
        E, L = max(instance.num_experts, 1), instance.num_layers
        par = instance.tree.parents.tolist()
        prob = instance.tree.path_prob.tolist()
        items = [instance.node_items[v].tolist() for v in range(n)]
        reads = instance.reads_priced  # routed experts read once: their own refcounts, item ids of the tree
        read_items = [instance.read_node_items[v].tolist() for v in range(n)] if reads else [[] for _ in range(n)]
        cost = instance.cost
        host = cost.regime == "host"
        if not host:
            pe = cost.per_expert_array(L)
            rd = cost.read_array(L)
            fixed, per_node = cost.fixed_ms, cost.per_node_ms
        rows = instance.items.rows
        layer_rows = np.zeros(L, dtype=np.int64)
        max_nodes = instance.max_nodes if instance.max_nodes is not None else n
        cap = instance.max_new_experts_per_layer
        lam = None if rate is None else rate / 1000.0
        refs: dict[int, int] = {}
        read_refs: dict[int, int] = {}
        layer_new = np.zeros(L, dtype=np.int64)
        layer_read = np.zeros(L, dtype=np.int64)
        chosen = [False] * n
        stack = [0]
        best = [-np.inf, (0,)]

        def cover(v: int, sign: int) -> None:
            for it in items[v]:
                c = refs.get(it, 0) + sign
                refs[it] = c
                if (sign > 0 and c == 1) or (sign < 0 and c == 0):
                    layer_new[it // E] += sign
            for it in read_items[v]:
                c = read_refs.get(it, 0) + sign
                read_refs[it] = c
                if (sign > 0 and c == 1) or (sign < 0 and c == 0):
                    layer_read[it // E] += sign

        def leaf(a: float) -> None:
            if host:  # resident experts read on the GPU: routed minus host-computed
                t = cost.cycle_ms(len(stack), layer_new, layer_rows, None, layer_read - layer_new if reads else None)
            else:
                t = fixed + per_node * len(stack) + float(pe @ layer_new) + (float(rd @ layer_read) if reads else 0.0)
            value = a / t if lam is None else a - lam * t
            if value > best[0]:
                best[0], best[1] = value, tuple(stack)

        def rec(i: int, a: float) -> None:
            if i == n:
                leaf(a)
                return
            rec(i + 1, a)
            if chosen[par[i]] and len(stack) < max_nodes:
                cover(i, +1)
                if cap is None or L == 0 or layer_new.max() <= cap:
                    chosen[i] = True
                    stack.append(i)
                    layer_rows[:] += rows[i]
                    rec(i + 1, a + prob[i])
                    layer_rows[:] -= rows[i]
                    stack.pop()
                    chosen[i] = False
                cover(i, -1)

        chosen[0] = True
        cover(0, +1)
        layer_rows += rows[0]
        rec(1, 1.0)
        return best[1], "optimal"
