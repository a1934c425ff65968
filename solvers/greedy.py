"""Greedy baselines: ``eagle`` (EAGLE-2/3 reranking), ``scan`` (best prefix of the path-probability
order under the cost model) and ``greedy`` (marginal-ratio greedy from the frontier).

None of them proves optimality (status ``heuristic``); all return ancestor-closed sets within the
instance's budgets and support rate mode (maximise ``A - (rate/1000) T``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specfit.solvers.base import Solver
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance


def path_prob_order(instance: Instance) -> list[int]:
    """Nodes in decreasing path probability, ties shallow-first then lower index; root first.

    Sorting uses the running minimum of ``P`` along each root path, which equals ``P`` when ``P``
    is non-increasing along paths and absorbs the tolerance :data:`specfit.core.tree.PROB_TOL` allows,
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

    ``covered`` marks the uncached items (layer, expert) the selection already transfers; a node
    adds one node's time plus the items it needs that are not covered. With ``track_all`` it also
    keeps ``delta_ms[v]``, that added transfer time for every node v, updated with one matrix
    product over the items each added node newly covers (O(n · U) for a whole run, U distinct
    uncached items), for the greedy's per-step scan of the frontier.
    """

    def __init__(self, instance: Instance, track_all: bool = False):
        self.inst = instance
        self.items = instance.node_items
        self.w = instance.item_weight
        self.L, self.E = instance.num_layers, max(instance.num_experts, 1)
        self.cap = instance.max_new_experts_per_layer if self.L else None
        self.covered = np.zeros(self.L * self.E, dtype=bool)
        self.layer_new = np.zeros(self.L, dtype=np.int64)
        self.in_set = np.zeros(instance.n, dtype=bool)
        self.size, self.a, self.t = 0, 0.0, instance.cost.fixed_ms
        self.universe = None
        if track_all:
            self.universe = np.unique(np.concatenate(self.items))
            self.need = np.zeros((instance.n, self.universe.shape[0]))
            for v in range(instance.n):
                self.need[v, np.searchsorted(self.universe, self.items[v])] = 1.0
            self.delta_ms = self.need @ self.w[self.universe]
        self.add(0)

    def new_items(self, v: int) -> np.ndarray:
        """Item ids node v needs that the selection does not cover yet."""
        it = self.items[v]
        return it[~self.covered[it]]

    def fits(self, v: int) -> bool:
        """True iff adding v keeps the selection within ``max_nodes`` and the expert budget."""
        if self.inst.max_nodes is not None and self.size + 1 > self.inst.max_nodes:
            return False
        if self.cap is None:
            return True
        counts = np.bincount(self.new_items(v) // self.E, minlength=self.L)
        return bool((self.layer_new + counts).max() <= self.cap)

    def step_ms(self, v: int) -> float:
        """Time (ms) adding v would add: one node plus the experts it newly needs."""
        extra = max(float(self.delta_ms[v]), 0.0) if self.universe is not None else float(self.w[self.new_items(v)].sum())
        return self.inst.cost.per_node_ms + extra

    def add(self, v: int) -> None:
        """Add node v (its parent must already be in the selection)."""
        new = self.new_items(v)
        self.a += 1.0 if v == 0 else float(self.inst.tree.path_prob[v])
        self.t += self.inst.cost.per_node_ms + float(self.w[new].sum())
        if new.size:
            self.layer_new += np.bincount(new // self.E, minlength=self.L)
            self.covered[new] = True
            if self.universe is not None:
                self.delta_ms -= self.need[:, np.searchsorted(self.universe, new)] @ self.w[new]
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
        cov = _Coverage(instance, track_all=True)
        prob = instance.tree.path_prob
        children = instance.tree.children
        frontier = set(children[0])
        while frontier:
            cand = np.array(sorted(v for v in frontier if cov.fits(v)), dtype=np.int64)
            if not cand.size:
                break
            d = instance.cost.per_node_ms + np.maximum(cov.delta_ms[cand], 0.0)
            p = prob[cand]
            with np.errstate(over="ignore"):  # a denormal d gives an infinite ratio, which is right
                r = np.where(d > 0, p / np.where(d > 0, d, 1.0), np.where(p > 0, np.inf, 0.0))
            i = int(np.argmax(r))  # first maximum: the lowest index among ties
            threshold = cov.a / cov.t if lam is None else lam
            if not r[i] > threshold:
                break
            v = int(cand[i])
            cov.add(v)
            frontier.remove(v)
            frontier.update(children[v])
        return np.flatnonzero(cov.in_set).tolist(), "heuristic"
