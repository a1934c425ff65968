"""The exact solver: the ancestor-closed subtree of maximum predicted throughput A(S)/T(S)
(or maximum A(S) - λT(S) in rate mode), with union-of-experts coverage and optional budgets.

Why it is exact
---------------
*Ratio → parametric problem.* Dinkelbach (1967): for λ = A(S_k)/T(S_k), let S_{k+1} maximise
F_λ(S) = A(S) - λ T(S) over the feasible sets. If max F_λ = 0, S_k is optimal (A(S) ≤ λT(S) for all
S, as T > 0); otherwise A(S_{k+1})/T(S_{k+1}) > λ. The ratios strictly increase over a finite set,
so the loop ends at the optimum. Rate mode is one such step with λ given.

*Unbudgeted F_λ is a maximum-weight closure.* With coverage accounting (specfit/core/coverage.py), node
v ≠ root has weight P_v - λ(per_node_ms + cost of the items only v owns) and implies its parent; an
item owned by two or more nodes costs λ·w once if any owner is chosen. Closures of this
node/item graph are exactly the feasible pairs (S, covered items), so max F_λ is a max-weight closure,
i.e. one s-t minimum cut (Picard 1976), solved here with Dinic's algorithm (Dinic 1970). Two safe
reductions come first: (i) a node with P_v ≤ λ·per_node_ms heads a subtree whose nodes all have
P ≤ P_v (P is non-increasing along paths), so no part of it can raise F_λ; (ii) the tree DP
``dp[v] = max(0, b_v + Σ dp[child])`` with shared item costs dropped is an upper bound on what v's
subtree can add, so v is dropped when ``dp[v] ≤ 0``; an item left with one live owner folds into
that owner's weight. When no item is shared by two live owners the cut is not needed: the tree DP
is then exact. When no node needs an uncached expert at all, T(S) depends on |S| alone, every size's
best subtree is its prefix of the path-probability order (SPECFIT.md §3), and the best prefix
(:func:`specfit.solvers.greedy.best_prefix`, within the node budget) is returned without search.

*Budgets.* With ``max_nodes`` or ``max_new_experts_per_layer`` the problem is NP-hard (a star with an
expert cap is set-union knapsack, SPECFIT.md §3), so F_λ is maximised by depth-first branch and
bound over the nodes in topological order (each node decided only once its parent is in). Each
node is charged only for the items it adds to the current coverage (its owned items not yet
covered). The bound adds to the current value the tree-DP value of every undecided subtree hanging
off the selection, with shared item costs dropped and budgets relaxed, capped by the sum of the
largest positive node weights that the remaining node budget admits. It never underestimates, so
pruning loses no optimum. Unless a time limit stops the search, the answer is optimal.

References
----------
W. Dinkelbach, "On nonlinear fractional programming", Management Science 13(7), 1967.
J.-C. Picard, "Maximal closure of a graph and applications to combinatorial problems",
Management Science 22(11), 1976.
E. A. Dinic, "Algorithm for solution of a problem of maximum flow in networks with power
estimation", Soviet Math. Doklady 11, 1970.
SPECFIT.md §3 (the problem and what is known about it).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import numpy as np

from specfit.core.coverage import Coverage, PricedItems, at_least_twice, coverage
from specfit.core.instance import Instance
from specfit.core.objective import evaluate_uncovered, evaluation
from specfit.core.cost import check_ms
from specfit.solvers.base import (SearchLimit, Selection, Solver, check_max_visits, check_rate, check_time_limit,
                                   selection)
from specfit.solvers.exact_host import select_host
from specfit.solvers.greedy import linear_prefix, scan_prefix

_INF = float("inf")


def min_cut_source_side(num_vertices: int, source: int, sink: int, edges: list[tuple[int, int, float]],
                        eps: float = 1e-12) -> list[bool]:
    """Minimum s-t cut by Dinic's algorithm; returns the source side.

    Parameters
    ----------
    num_vertices : int
    source, sink : int
    edges : list of (u, v, capacity)
        Directed edges; capacity may be ``float("inf")``.
    eps : float
        Residual capacities at or below ``eps`` count as saturated (float round-off).

    Returns
    -------
    list of bool, length num_vertices
        ``True`` for the vertices reachable from the source in the final residual graph.

    References
    ----------
    E. A. Dinic (1970); the source side of a minimum cut is the residual-reachable set
    (Ford & Fulkerson 1956, max-flow min-cut theorem).
    """
    head: list[list[int]] = [[] for _ in range(num_vertices)]
    to: list[int] = []
    cap: list[float] = []
    for u, v, c in edges:
        head[u].append(len(to))
        to.append(v)
        cap.append(c)
        head[v].append(len(to))
        to.append(u)
        cap.append(0.0)
    while True:
        level = [-1] * num_vertices
        level[source] = 0
        queue = [source]
        for u in queue:
            for e in head[u]:
                w = to[e]
                if level[w] < 0 and cap[e] > eps:
                    level[w] = level[u] + 1
                    queue.append(w)
        if level[sink] < 0:
            return [lv >= 0 for lv in level]
        nxt = [0] * num_vertices

        def push(u: int, f: float) -> float:
            if u == sink:
                return f
            hu = head[u]
            while nxt[u] < len(hu):
                e = hu[nxt[u]]
                w = to[e]
                if cap[e] > eps and level[w] == level[u] + 1:
                    d = push(w, f if f < cap[e] else cap[e])
                    if d > 0.0:
                        cap[e] -= d
                        cap[e ^ 1] += d
                        return d
                nxt[u] += 1
            return 0.0

        while push(source, _INF) > eps:
            pass


def _tree_dp(cov: Coverage, weight: list[float], live: list[bool]) -> list[float]:
    """``dp[v] = max(0, weight[v] + Σ dp[child])`` over live nodes (children have larger ids)."""
    dp = [0.0] * cov.n
    for v in range(cov.n - 1, 0, -1):
        if live[v]:
            s = weight[v]
            for ch in cov.children[v]:
                s += dp[ch]
            dp[v] = s if s > 0.0 else 0.0
    return dp


def _live_groups(cov: Coverage, live: list[int]) -> tuple[list[float], list[np.ndarray], np.ndarray]:
    """Shared items restricted to the live nodes ``live``.

    Returns ``(single_ms, groups, group_ms)``: ``single_ms[i]`` is the cost (ms) of the shared items
    whose only live owner is ``live[i]``; ``groups`` lists, per distinct set of >= 2 live owners,
    those owners (as positions in ``live``), and ``group_ms`` their items' total cost (ms).
    """
    rows = [cov.own_bits[v] & cov.shared_bits for v in live]
    once, twice = at_least_twice(rows)
    single = once & ~twice
    single_ms = [cov.bits_ms(r & single) for r in rows]
    if not twice:
        return single_ms, [], np.zeros(0)
    multi = np.flatnonzero(cov.unpack([twice])[0])
    sub = cov.unpack(rows)[:, multi]
    sig = np.ascontiguousarray(np.packbits(sub.T, axis=1))
    keys = sig.view(np.dtype((np.void, sig.shape[1]))).reshape(-1)
    _, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    group_ms = np.bincount(inv.reshape(-1), weights=cov.item_ms(multi), minlength=first.shape[0])
    g_idx, v_pos = np.nonzero(sub[:, first].T)
    groups = np.split(v_pos, np.searchsorted(g_idx, np.arange(1, first.shape[0])))
    return single_ms, groups, group_ms


def max_closure(cov: Coverage, lam: float) -> list[int]:
    """Maximise ``F(S) = A(S) - lam * T(S)`` over ancestor-closed S without budgets.

    Parameters
    ----------
    cov : Coverage
    lam : float
        λ in tokens per ms (>= 0).

    Returns
    -------
    list of int
        Sorted node ids of a maximiser, root included.
    """
    n, c, pp, par = cov.n, cov.per_node_ms, cov.path_prob, cov.parents
    base = [pp[v] - lam * (c + cov.exclusive_ms[v]) for v in range(n)]
    live = [v == 0 or pp[v] > lam * c for v in range(n)]
    weight, weight_fits_live = list(base), False
    while True:  # drop subtrees that cannot add value; fold items left with one live owner
        dp = _tree_dp(cov, weight, live)
        pruned = False
        for v in range(1, n):
            if live[v] and not (live[par[v]] and dp[v] > 0.0):
                live[v], pruned = False, True
        if weight_fits_live and not pruned:
            break
        live_idx = [v for v in range(1, n) if live[v]]
        if not live_idx:
            return [0]
        single_ms, groups, group_ms = _live_groups(cov, live_idx)
        weight = list(base)
        for v, extra in zip(live_idx, single_ms):
            weight[v] -= lam * extra
        weight_fits_live = True
    if not groups:  # the tree DP is exact: take v iff its parent is taken and dp[v] > 0
        return [0] + live_idx
    # minimum cut: source 0, sink 1, live nodes 2.., then one vertex per shared item group
    src, snk = 0, 1
    vid = {v: i + 2 for i, v in enumerate(live_idx)}
    edges = []
    for v, i in vid.items():
        if weight[v] > 0.0:
            edges.append((src, i, weight[v]))
        elif weight[v] < 0.0:
            edges.append((i, snk, -weight[v]))
        if par[v]:
            edges.append((i, vid[par[v]], _INF))
    g0 = len(vid) + 2
    for k, (owners, w) in enumerate(zip(groups, group_ms.tolist())):
        edges.append((g0 + k, snk, lam * w))
        for pos in owners.tolist():
            edges.append((pos + 2, g0 + k, _INF))
    side = min_cut_source_side(g0 + len(groups), src, snk, edges)
    return [0] + [v for v, i in vid.items() if side[i]]


class _BranchAndBound:
    """Maximise F_λ(S) under budgets by depth-first branch and bound (see the module docstring)."""

    def __init__(self, cov: Coverage, lam: float, max_nodes: int | None, max_new: int | None,
                 limit: SearchLimit | None):
        self.cov, self.lam, self.limit = cov, lam, limit
        n, c, pp = cov.n, cov.per_node_ms, cov.path_prob
        self.max_nodes = n if max_nodes is None else max_nodes
        self.max_new = max_new
        self.gain = [pp[v] - lam * (c + cov.exclusive_ms[v]) for v in range(n)]
        self.dp = _tree_dp(cov, self.gain, [True] * n)
        # best_k[j][r]: sum of the r largest positive gains among nodes j..n-1 (budget-aware cap)
        self.best_k = []
        for j in range(n + 1):
            tail = sorted((g for g in self.gain[j:] if g > 0.0), reverse=True)
            acc, row = 0.0, [0.0]
            for g in tail:
                acc += g
                row.append(acc)
            self.best_k.append(row)
        self.in_s = [False] * n
        self.in_s[0] = True
        self.timed_out = False
        self.best_value = -_INF
        self.best_nodes: list[int] = [0]

    def value_of(self, nodes: Sequence[int]) -> float:
        a, t = self.cov.value(nodes)
        return a - self.lam * t

    def fits(self, bits: int) -> bool:
        if self.max_new is None:
            return True
        L = self.cov.num_layers  # the copy segments: the reads (segments L..2L-1) are not budgeted
        root = self.cov.root_new_per_layer[:L]
        return all(int(r) + k <= self.max_new for r, k in zip(root, self.cov.bits_per_layer(bits)[:L]))

    def run(self, incumbent: Sequence[int]) -> list[int]:
        self.best_nodes = sorted(incumbent)
        self.best_value = self.value_of(incumbent)
        base = 1.0 - self.lam * self.cov.base_ms
        frontier = sum(self.dp[ch] for ch in self.cov.children[0])
        self._dfs(1, 0, base, 1, frontier)
        return self.best_nodes

    def _dfs(self, j: int, bits: int, value: float, count: int, frontier: float) -> None:
        cov, n = self.cov, self.cov.n
        if value > self.best_value + 1e-12:
            self.best_value = value
            self.best_nodes = [v for v in range(n) if self.in_s[v]]
        while j < n and not self.in_s[cov.parents[j]]:
            j += 1
        if j >= n:
            return
        room = self.max_nodes - count
        row = self.best_k[j]
        cap = row[room] if room < len(row) else row[-1]
        if value + min(frontier, cap) <= self.best_value + 1e-12:
            return
        if self.limit is not None and self.limit.stop():
            self.timed_out = True
            return
        v = j
        rest = frontier - self.dp[v]
        new = cov.own_bits[v] & ~bits
        if room > 0 and self.fits(bits | new):
            self.in_s[v] = True
            gain = cov.path_prob[v] - self.lam * (cov.per_node_ms + cov.bits_ms(new))
            self._dfs(j + 1, bits | new, value + gain, count + 1, rest + sum(self.dp[ch] for ch in cov.children[v]))
            self.in_s[v] = False
        self._dfs(j + 1, bits, value, count, rest)


class ExactSolver(Solver):
    """Exact maximiser of A(S)/T(S) (or A - λT) with coverage accounting and budgets.

    Parameters
    ----------
    tol : float
        Dinkelbach stops when ``max F_λ <= tol`` tokens (float round-off).
    time_limit_s : float, optional
        Only a branch and bound can be slow (under budgets, or in the host regime); past this limit it
        returns the best selection found with status ``"feasible"``. Default: no limit.
    compiled : bool
        Solve instances without budgets in the transfer regime (the engine's) by one compiled call
        (:mod:`specfit.solvers.exact_compiled`, the same algorithm; default) instead of the Python
        path below, which stays the reference.
    max_visits : int, optional
        The same, past this many search nodes over the solve (:class:`~specfit.solvers.base.SearchLimit`):
        a limit that stops every machine at the same node. Default: no limit.

    Raises
    ------
    SpecFitInputError
        If ``time_limit_s`` is not a positive number of seconds or ``max_visits`` not a positive integer.

    See the module docstring for the algorithm and why it is exact. An instance of the
    host-compute regime (cost a :class:`~specfit.core.cost.HostProfile`) is solved by
    :mod:`specfit.solvers.exact_host` (Dinkelbach over an exact branch and bound), also exact.
    """

    name = "exact"
    exact = True

    def __init__(self, tol: float = 1e-12, time_limit_s: float | None = None, compiled: bool = True,
                 max_visits: int | None = None):
        self.tol = tol
        self.time_limit_s = None if time_limit_s is None else check_time_limit(time_limit_s)
        self.max_visits = None if max_visits is None else check_max_visits(max_visits)
        self.compiled = compiled
        if compiled:  # compiled (or loaded from numba's cache) here: no solve pays it
            from specfit.core.kernels import item_words_kernel
            from specfit.solvers.exact_compiled import (exact_kernel, exact_nodes_kernel, linear_prefix_kernel,
                                                        linear_prefix_selection, select_unbudgeted,
                                                        select_unbudgeted_nodes)

            exact_kernel()
            exact_nodes_kernel()  # solve_tree's
            linear_prefix_kernel()
            item_words_kernel()  # an instance's coverage accounting (ItemSets.extend)
            # without an import per call: select's, solve_tree's
            self._compiled = (select_unbudgeted, linear_prefix_selection, select_unbudgeted_nodes)

    def solve_tree(self, tree, cost, cache=None, *, rate: float | None = None, sunk_ms: float = 0.0,
                   max_nodes: int | None = None) -> Selection:
        """:meth:`Solver.solve_tree`: the same selection and floats as ``solve(Instance(tree,
        cost.plus_ms(sunk_ms), cache, max_nodes=max_nodes), rate)``. A transfer-regime ``cost`` with a
        ``cache`` and no ``max_nodes`` (the engine's every solve by default) is answered by one compiled
        call on the tree's coverage accounting, without building the instance, its cost model and the evaluation around it: a drafted cycle's solve runs right after
        a forward has evicted the host's caches, where each of those Python-level steps costs several
        times its warm time. Other calls go through
        :meth:`solve`.

        Raises
        ------
        SpecFitInputError
            As :meth:`Solver.solve_tree`.
        """
        L, E = tree.num_layers, tree.num_experts or 0
        if (not self.compiled or cost.regime != "transfer" or max_nodes is not None or cache is None
                or cache.shape != (L, E)):  # the instance's path (and its errors)
            return super().solve_tree(tree, cost, cache, rate=rate, sunk_ms=sunk_ms, max_nodes=max_nodes)
        if rate is not None:
            rate = check_rate(rate)
        fixed_ms = cost.fixed_ms + check_ms("ms", sunk_ms) if sunk_ms else cost.fixed_ms  # as cost.plus_ms
        per_expert = cost.segment_ms(L)  # checks the layers (cost.check_layers); copies, then reads if priced
        t0 = time.perf_counter()
        items = tree.items(cache)
        if L and cost.read_ms:  # resident reads priced: the copies and the reads side by side (PricedItems)
            items = PricedItems(items, tree.resident_items(cache))
        lam = None if rate is None else rate / 1000.0
        if L and items.any_uncached():
            nodes, a, t = self._compiled[2](tree, items, cost, lam, self.tol, fixed_ms, per_expert)
        else:  # no uncached expert: T linear in |S|, a prefix is optimal (select)
            nodes, a, t = self._compiled[1](tree, fixed_ms, cost.per_node_ms, None, lam)
            nodes = tuple(nodes.tolist())
        solve_ms = (time.perf_counter() - t0) * 1e3
        return selection(self.name, nodes, a, t, solve_ms, rate)

    def select(self, instance: Instance, rate: float | None):
        limit = None if self.time_limit_s is None and self.max_visits is None else SearchLimit(self.time_limit_s,
                                                                                             self.max_visits)
        host = instance.cost.regime == "host"
        linear = not host or instance.cost.node_extra_ms <= instance.cost.gpu.fixed_ms + instance.cost.extra_ms
        items = instance.items if host else instance.priced_items
        linear = linear and not (host and instance.reads_priced)  # GPU reads of resident experts: not linear
        if linear and not items.any_uncached():  # no priced item: T linear in |S|, a prefix is optimal
            lam = None if rate is None else rate / 1000.0
            cost = instance.cost.gpu_only() if host else instance.cost  # host: nothing on the host, the GPU part
            if self.compiled:  # the same prefix and its A and T, one compiled call
                linear_prefix_selection = self._compiled[1]
                nodes, a, t = linear_prefix_selection(instance.tree, cost.fixed_ms, cost.per_node_ms,
                                                      instance.max_nodes, lam)
                if host:  # nothing on the host: the GPU part prices it (solve evaluates it on the profile)
                    return nodes.tolist(), "optimal"
                return nodes, "optimal", evaluation(nodes, a, t, np.zeros(instance.num_layers, dtype=np.int64))
            nodes = linear_prefix(replace(instance, cost=cost), lam)
            if host:
                return nodes, "optimal"
            return nodes, "optimal", evaluate_uncovered(instance, nodes)  # a prefix: closed, sorted, no expert
        if host:  # per-layer max: branch and bound (specfit.solvers.exact_host)
            return select_host(instance, rate, [0], self.tol, limit)  # {root}: cheaper than a prefix scan here
        budgeted = instance.has_budget
        if self.compiled and not budgeted:
            select_unbudgeted = self._compiled[0]
            nodes, new, a, t = select_unbudgeted(instance.tree, items, instance.cost,
                                                 None if rate is None else rate / 1000.0, self.tol)
            new = new[:instance.num_layers]  # the copy segments: uncached experts per layer
            ev = evaluation(nodes, a, t, new)  # the kernel's A and T: evaluate's floats
            return ev.nodes, "optimal", ev
        cov = coverage(instance)
        status = "optimal"

        def best_for(lam: float, incumbent: list[int]) -> list[int]:
            nonlocal status
            if not budgeted:
                return max_closure(cov, lam)
            bb = _BranchAndBound(cov, lam, instance.max_nodes, instance.max_new_experts_per_layer, limit)
            nodes = bb.run(incumbent)
            if bb.timed_out:
                status = "feasible"
            return nodes

        start = scan_prefix(instance)  # a cheap feasible starting point for Dinkelbach (best_prefix; the union is known non-empty)
        if rate is not None:
            return best_for(rate / 1000.0, start), status
        nodes = start
        a, t = cov.value(nodes)
        lam = a / t
        while True:
            cand = best_for(lam, nodes)
            ca, ct = cov.value(cand)
            if not ca - lam * ct > self.tol or status != "optimal":  # NaN-safe (an overflowing T)
                if ca / ct > lam:
                    nodes = cand
                return nodes, status
            nodes, lam = cand, ca / ct
