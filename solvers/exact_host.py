"""The exact solver in the host-compute regime (an instance whose cost is a
:class:`~specfit.core.cost.HostProfile`): maximise A(S)/T(S) (or A(S) - λT(S)) with

    T(S) = extra_ms + c · sum_l [ max(g(|S|), h_l(S)) + sync_ms · [u_l(S) > 0] ],   c = R / L,
    g(n) = (gpu.fixed_ms + gpu.per_node_ms · n) / R,   h_l = host_per_expert_ms · u_l + host_per_row_ms · r_l

(u_l the union of the selected nodes' uncached experts in layer l, r_l their rows; SPECFIT.md §3,
"Host-compute regime"). With ``gpu.read_ms > 0`` the GPU part of layer l also reads each resident expert
the selection routes to, ``g_l = g + gpu.read_ms · s_l(S)``: it only raises the GPU part, so the bound
below (a node adds at least ``gpu.per_node_ms / R`` where the GPU part binds) holds unchanged; the search
carries the routed experts' coverage (``tree.read_items()``) to count s_l.

Why it is exact
---------------
*Ratio → parametric problem.* Dinkelbach (1967), as in :mod:`specfit.solvers.exact`: it needs only
T > 0 and an exact maximiser of F_λ(S) = A(S) - λT(S), not a closure structure.

*F_λ by branch and bound.* T is monotone in S but the per-layer max makes F_λ no closure objective,
so F_λ is maximised by depth-first branch and bound over the nodes in topological order (a node is
decided only once its parent is in). The bound rests on one inequality: for x, y >= 0,
max(a + x, b + y) - max(a, b) >= x when a >= b and >= y when b >= a. Take the current selection S
and any completion S' ⊇ S. In a layer where the GPU part binds at S (g >= h_l), T grows by at least
c · per_node_ms / R for every added node; where the host part binds (h_l > g) it grows by at least
c · (host_per_row_ms · r_v,l + host_per_expert_ms · x_v,l) summed over the added nodes v, with x_v,l
the items of layer l that v alone owns (no ancestor of v and no other node needs them: they are
new whatever else is selected). The sync term never falls, and the profile's ``node_extra_ms``
(outside the max) adds exactly that per node. So, with m_v(S) the sum over layers of the bound that
applies in each layer at S plus ``node_extra_ms``, F_λ(S') <= F_λ(S) + sum_{v in S' \\ S} (P_v - λ m_v(S)),
and the tree DP ``dp[v] = max(0, P_v - λ m_v(S) + sum dp[child])`` over the undecided subtrees
hanging off S bounds what any completion adds (capped, under ``max_nodes``, by the largest positive
terms the node budget admits). The bound never underestimates, so pruning loses no optimum. It is
recomputed when the set of layers where the GPU part binds changes along the search. Budgets
(``max_nodes``, ``max_new_experts_per_layer``) prune infeasible branches: both only grow with S.

Unless a limit stops the search (:class:`~specfit.solvers.base.SearchLimit`), the answer is optimal.
``tests/solvers/test_solvers.py`` checks it against brute force and CP-SAT on hypothesis-generated host-regime instances, and
``tests/solvers/test_host_regime.py`` checks the search alone from the trivial incumbent {root}, where
every pruning decision of the bound matters.

References
----------
W. Dinkelbach, "On nonlinear fractional programming", Management Science 13(7), 1967.
SPECFIT.md §3.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specfit.core.coverage import at_least_twice
from specfit.core.instance import Instance
from specfit.core.objective import evaluate
from specfit.solvers.base import SearchLimit

_INF = float("inf")


class HostSearch:
    """Maximise F_λ(S) = A(S) - λT(S) on a host-regime instance by branch and bound (module docstring).

    Parameters
    ----------
    instance : Instance
        Its cost a :class:`~specfit.core.cost.HostProfile`.
    limit : SearchLimit, optional
        Where the search stops early (``timed_out`` is then True); shared by the solve's searches.
    """

    def __init__(self, instance: Instance, limit: SearchLimit | None = None):
        cost, items, tree = instance.cost, instance.items, instance.tree
        self.inst, self.cost, self.limit = instance, cost, limit
        self.n, self.L = instance.n, instance.num_layers
        self.par = tree.parents.tolist()
        self.children = [list(ch) for ch in tree.children]
        self.pp = tree.path_prob.tolist()
        self.need, self.items = items.need, items
        self.rows = items.rows.tolist()
        R = cost.reference_layers
        self.c = R / self.L if self.L else 0.0
        self.g0, self.dg = cost.gpu.fixed_ms / R, cost.gpu.per_node_ms / R
        self.pe, self.pr = cost.host_per_expert_ms, cost.host_per_row_ms
        _, shared = at_least_twice(items.own)
        E = instance.num_experts
        nbytes = (self.L * E + 7) // 8
        packed = np.frombuffer(b"".join((o & ~shared).to_bytes(nbytes, "little") for o in items.own), dtype=np.uint8)
        bits = np.unpackbits(packed.reshape(self.n, nbytes), axis=1, count=self.L * E, bitorder="little")
        excl = bits.reshape(self.n, self.L, E).sum(axis=2, dtype=np.float64)  # items only v owns, per layer
        #: per node and layer, the least it adds to T (ms) in a layer where the host part binds
        self.host_inc = self.c * (self.pr * items.rows + self.pe * excl)
        self.max_nodes = instance.max_nodes
        self.cap = instance.max_new_experts_per_layer if self.L else None
        self.timed_out = False
        #: every routed expert per node (the GPU side reads the resident ones), when the profile prices reads
        self.reads = tree.read_items() if instance.reads_priced else None

    # --- the bound -------------------------------------------------------------------------
    def _tables(self, pattern: int) -> tuple[list[float], list[list[float]] | None]:
        """``dp`` and (under ``max_nodes``) ``best_k`` of the node gains P_v - λ m_v for ``pattern``."""
        hit = self._memo.get(pattern)
        if hit is not None:
            return hit
        if self.L:
            gpu_layers = np.array([(pattern >> l) & 1 for l in range(self.L)], dtype=bool)
            m = self.host_inc[:, ~gpu_layers].sum(axis=1) + self.c * self.dg * int(gpu_layers.sum())
        else:
            m = np.full(self.n, self.cost.gpu.per_node_ms)
        m = m + self.cost.node_extra_ms  # outside the max: exactly what each draft node adds
        gain = (np.asarray(self.pp) - self.lam * m).tolist()
        dp = [0.0] * self.n
        for v in range(self.n - 1, 0, -1):
            s = gain[v]
            for ch in self.children[v]:
                s += dp[ch]
            dp[v] = s if s > 0.0 else 0.0
        best_k = None
        if self.max_nodes is not None:  # best_k[j][r]: the r largest positive gains among nodes j..n-1
            best_k = []
            for j in range(self.n + 1):
                acc, row = 0.0, [0.0]
                for g in sorted((g for g in gain[j:] if g > 0.0), reverse=True):
                    acc += g
                    row.append(acc)
                best_k.append(row)
        self._memo[pattern] = (dp, best_k)
        return dp, best_k

    def _frontier(self, j: int, dp: list[float]) -> float:
        """Sum of ``dp`` over the undecided nodes >= j whose parent is selected."""
        return sum(dp[v] for v in range(j, self.n) if self.in_s[self.par[v]])

    # --- the search ------------------------------------------------------------------------
    def value(self, nodes: Sequence[int]) -> float:
        """F_λ of an ancestor-closed node set, with the objective's own T (:func:`evaluate`)."""
        ev = evaluate(self.inst, nodes)
        return ev.expected_tokens - self.lam * ev.predicted_ms

    def run(self, lam: float, incumbent: Sequence[int]) -> list[int]:
        """A maximiser of F_λ (λ in tokens/ms, >= 0), no worse than ``incumbent`` (a feasible set)."""
        self.lam, self._memo = lam, {}
        self.best_nodes = sorted(incumbent)
        self.best_value = self.value(self.best_nodes)
        self.in_s = [False] * self.n
        self.in_s[0] = True
        u = self.items.per_layer(self.need[0])
        r = list(self.rows[0])
        rcov = self.reads.need[0] if self.reads is not None else 0
        ru = self.reads.per_layer(rcov) if self.reads is not None else None
        _, pattern = self.cost.layers_ms(1, u, r, None, self._resident(ru, u))
        dp, _ = self._tables(pattern)
        self._dfs(1, 1, self.need[0], u, r, 1.0, self._frontier(1, dp), pattern, rcov, ru)
        return self.best_nodes

    @staticmethod
    def _resident(ru: list[int] | None, u: list[int]) -> list[int] | None:
        """Resident experts read per layer: routed (``ru``) minus host-computed (``u``); None without reads."""
        return None if ru is None else [a - b for a, b in zip(ru, u)]

    def _dfs(self, j: int, count: int, covered: int, u: list[int], r: list[int], a: float, frontier: float,
             pattern: int, rcov: int = 0, ru: list[int] | None = None) -> None:
        n, in_s = self.n, self.in_s
        t, now = self.cost.layers_ms(count, u, r, None, self._resident(ru, u))
        value = a - self.lam * t
        if value > self.best_value + 1e-12:
            self.best_value = value
            self.best_nodes = [v for v in range(n) if in_s[v]]
        while j < n and not in_s[self.par[j]]:
            j += 1
        if j >= n:
            return
        dp, best_k = self._tables(now)
        if now != pattern:
            frontier = self._frontier(j, dp)
        room = n if self.max_nodes is None else self.max_nodes - count
        bound = frontier
        if best_k is not None:
            row = best_k[j]
            bound = min(bound, row[room] if room < len(row) else row[-1])
        if value + bound <= self.best_value + 1e-12:
            return
        if self.limit is not None and self.limit.stop():
            self.timed_out = True
            return
        v = j
        rest = frontier - dp[v]
        if room > 0:
            new = self.need[v] & ~covered
            u2 = [a_ + b_ for a_, b_ in zip(u, self.items.per_layer(new))] if new else u
            if self.cap is None or max(u2) <= self.cap:
                in_s[v] = True
                r2 = [a_ + b_ for a_, b_ in zip(r, self.rows[v])]
                rcov2, ru2 = rcov, ru
                if self.reads is not None:
                    fresh = self.reads.need[v] & ~rcov
                    rcov2 = rcov | fresh
                    ru2 = [a_ + b_ for a_, b_ in zip(ru, self.reads.per_layer(fresh))] if fresh else ru
                self._dfs(j + 1, count + 1, covered | new, u2, r2, a + self.pp[v],
                          rest + sum(dp[ch] for ch in self.children[v]), now, rcov2, ru2)
                in_s[v] = False
        self._dfs(j + 1, count, covered, u, r, a, rest, now, rcov, ru)


def select_host(instance: Instance, rate: float | None, start: Sequence[int], tol: float,
                limit: SearchLimit | None = None) -> tuple[list[int], str]:
    """The exact selection of a host-regime instance: rate mode is one :class:`HostSearch` with
    λ = rate / 1000; ratio mode runs Dinkelbach's loop over it from the feasible set ``start``.

    Returns
    -------
    nodes : list of int
        Sorted node ids, root included.
    status : str
        ``"optimal"``, or ``"feasible"`` when ``limit`` stopped a search.
    """
    search = HostSearch(instance, limit)
    if rate is not None:
        nodes = search.run(rate / 1000.0, start)
        return nodes, "feasible" if search.timed_out else "optimal"
    nodes = sorted(start)
    ev = evaluate(instance, nodes)
    lam = ev.expected_tokens / ev.predicted_ms
    while True:
        cand = search.run(lam, nodes)
        ev = evaluate(instance, cand)
        if ev.expected_tokens - lam * ev.predicted_ms <= tol or search.timed_out:
            if ev.expected_tokens / ev.predicted_ms > lam:
                nodes = cand
            return nodes, "feasible" if search.timed_out else "optimal"
        nodes, lam = cand, ev.expected_tokens / ev.predicted_ms
