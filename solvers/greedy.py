"""Greedy baselines: ``eagle`` (EAGLE-2/3 reranking), ``scan`` (best prefix of the path-probability
order under the cost model) and ``greedy`` (marginal-ratio greedy from the frontier).

None of them proves optimality (status ``heuristic``); all return ancestor-closed sets within the
instance's budgets and support rate mode (maximise ``A - (rate/1000) T``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from solvers.base import Solver
from specfit.errors import SpecFitInputError
from specfit.instance import Instance


def path_prob_order(instance: Instance) -> list[int]:
    """Nodes in decreasing path probability, ties shallow-first then lower index; root first.

    Sorting uses the running minimum of ``P`` along each root path, which equals ``P`` when ``P``
    is non-increasing along paths and absorbs the tolerance :data:`specfit.tree.PROB_TOL` allows,
    so every prefix of the order is ancestor-closed (SPECFIT.md §3: ``{v : P_v >= t}`` is closed).

    Returns
    -------
    list of int, length n
    """
    tree = instance.tree
    eff = tree.path_prob.copy()
    for v in range(1, tree.n):
        eff[v] = min(eff[v], eff[tree.parents[v]])
    return sorted(range(tree.n), key=lambda v: (-eff[v], int(tree.depth[v]), v))


class _Coverage:
    """Incremental coverage of a growing ancestor-closed selection.

    Keeps, for every node v, ``delta_ms[v]``: the transfer time (ms) of the uncached experts v
    needs that the selection does not cover yet, and ``delta_count[v]`` of shape (L,), their count
    per layer. Adding a node updates both for all nodes with one matrix product over the items it
    newly covers, so a whole greedy run costs O(n · U) for U distinct uncached items.
    """

    def __init__(self, instance: Instance):
        self.inst = instance
        n, L, E = instance.n, instance.num_layers, max(instance.num_experts, 1)
        items = instance.node_items
        universe = np.unique(np.concatenate(items)) if n else np.zeros(0, dtype=np.int64)
        self.need = np.zeros((n, universe.shape[0]), dtype=bool)
        for v in range(n):
            self.need[v, np.searchsorted(universe, items[v])] = True
        self.item_ms = instance.item_weight[universe]
        self.item_layer = np.zeros((universe.shape[0], L))
        self.item_layer[np.arange(universe.shape[0]), universe // E] = 1.0
        needf = self.need.astype(np.float64)
        self.delta_ms = needf @ self.item_ms
        self.delta_count = needf @ self.item_layer
        self.covered = np.zeros(universe.shape[0], dtype=bool)
        self.layer_new = np.zeros(L)
        self.in_set = np.zeros(n, dtype=bool)
        self.size = 0
        self.a = 0.0
        self.t = instance.cost.fixed_ms
        self.add(0)

    def fits(self, v: int) -> bool:
        """True iff adding v keeps the selection within ``max_nodes`` and the expert budget."""
        inst = self.inst
        if inst.max_nodes is not None and self.size + 1 > inst.max_nodes:
            return False
        cap = inst.max_new_experts_per_layer
        return cap is None or not self.layer_new.size or bool((self.layer_new + self.delta_count[v]).max() <= cap + 0.5)

    def step_ms(self, v: int) -> float:
        """Time (ms) adding v would add: one node plus the experts it newly needs."""
        return self.inst.cost.per_node_ms + max(float(self.delta_ms[v]), 0.0)

    def add(self, v: int) -> None:
        """Add node v (its parent must already be in the selection)."""
        self.a += 1.0 if v == 0 else float(self.inst.tree.path_prob[v])
        self.t += self.step_ms(v)
        self.layer_new += np.rint(self.delta_count[v])
        new = np.flatnonzero(self.need[v] & ~self.covered)
        if new.size:
            cols = self.need[:, new].astype(np.float64)
            self.delta_ms -= cols @ self.item_ms[new]
            self.delta_count -= cols @ self.item_layer[new]
            self.covered[new] = True
        self.in_set[v] = True
        self.size += 1

    def value(self, lam: float | None) -> float:
        """The objective of the current selection: ``A / T`` or ``A - lam * T`` (lam in tokens/ms)."""
        return self.a / self.t if lam is None else self.a - lam * self.t


def _lam(rate: float | None) -> float | None:
    return None if rate is None else rate / 1000.0


class EagleSolver(Solver):
    """EAGLE-2/3 reranking: the root plus the ``total_tokens`` draft nodes of highest path
    probability (ties shallow-first, then lower index).

    Parameters
    ----------
    total_tokens : int
        Draft nodes to verify besides the root (EAGLE's ``total_tokens``; the verified tree has
        ``total_tokens + 1`` nodes), default 32 (the Qwen3 EAGLE-3 scripts, SPECFIT.md §5).

    Notes
    -----
    Ignores the cost model (so rate mode selects the same set) but respects the budgets: a node
    that would break one is skipped, and so are its descendants.

    References
    ----------
    Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees", 2024, §4.2
    (reranking by the path-probability score).
    """

    name = "eagle"

    def __init__(self, total_tokens: int = 32):
        if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 0:
            raise SpecFitInputError("total_tokens", f"must be an integer >= 0, got {total_tokens!r}")
        self.total_tokens = total_tokens

    def select(self, instance: Instance, rate: float | None) -> tuple[Sequence[int], str]:
        cov = _Coverage(instance)
        par = instance.tree.parents
        for v in path_prob_order(instance)[1:]:
            if cov.size >= self.total_tokens + 1:
                break
            if cov.in_set[par[v]] and cov.fits(v):
                cov.add(v)
        return np.flatnonzero(cov.in_set).tolist(), "heuristic"


class ScanSolver(Solver):
    """The best prefix of the path-probability order under the cost model and budgets: a 1-D scan.

    Exact when ``per_expert_ms`` is 0 and there is no expert budget (SPECFIT.md §3: the top-m
    nodes by P then maximise A for each size m). The scan stops at the first prefix that breaks a
    budget (a longer prefix breaks it too).
    """

    name = "scan"

    def select(self, instance: Instance, rate: float | None) -> tuple[Sequence[int], str]:
        lam = _lam(rate)
        cov = _Coverage(instance)
        order = path_prob_order(instance)
        best, best_len = cov.value(lam), 1
        for k, v in enumerate(order[1:], start=2):
            if not cov.fits(v):
                break
            cov.add(v)
            val = cov.value(lam)
            if val > best:
                best, best_len = val, k
        return sorted(order[:best_len]), "heuristic"


class GreedySolver(Solver):
    """Marginal-ratio greedy: from the frontier (children of selected nodes) repeatedly add the
    node with the largest ``P_v / ΔT_v`` (ΔT_v: one node plus the experts it newly needs, ms)
    while adding it raises the objective; nodes that would break a budget are passed over.

    Adding v raises ``A/T`` iff ``P_v / ΔT_v > A/T`` and raises ``A - λT`` iff ``P_v / ΔT_v > λ``,
    so the stopping test is the same comparison of the best marginal ratio in both modes.
    """

    name = "greedy"

    def select(self, instance: Instance, rate: float | None) -> tuple[Sequence[int], str]:
        lam = _lam(rate)
        cov = _Coverage(instance)
        prob = instance.tree.path_prob
        children = instance.tree.children
        frontier = set(children[0])
        while frontier:
            best_v, best_r = -1, -1.0
            for v in sorted(frontier):
                if cov.fits(v):
                    d = cov.step_ms(v)
                    r = prob[v] / d if d > 0 else (np.inf if prob[v] > 0 else 0.0)
                    if r > best_r:
                        best_v, best_r = v, r
            threshold = cov.a / cov.t if lam is None else lam
            if best_v < 0 or not best_r > threshold:
                break
            cov.add(best_v)
            frontier.remove(best_v)
            frontier.update(children[best_v])
        return np.flatnonzero(cov.in_set).tolist(), "heuristic"
