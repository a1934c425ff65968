"""Greedy baselines: ``eagle`` (EAGLE-2/3 reranking), ``scan`` (best prefix of the path-probability
order under the cost model) and ``greedy`` (marginal-ratio greedy from the frontier).

None of them proves optimality (status ``heuristic``); all return ancestor-closed sets within the
instance's budgets and support rate mode (maximise ``A - (rate/1000) T``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specfit.core.coverage import GrowingSelection
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance
from specfit.solvers.base import Solver


def path_prob_order(instance: Instance) -> list[int]:
    """Nodes in decreasing path probability, ties shallow-first then lower index; root first.

    ``P`` is non-increasing along every path (:class:`~specfit.core.tree.DraftTree` stores an admitted
    near-tie at its parent's value), so every prefix of the order is ancestor-closed (SPECFIT.md §3:
    ``{v : P_v >= t}`` is closed).

    Returns
    -------
    list of int, length n
    """
    tree = instance.tree
    return np.lexsort((np.arange(tree.n), tree.depth, -tree.path_prob)).tolist()


def _lam(rate: float | None) -> float | None:
    return None if rate is None else rate / 1000.0


def best_prefix(instance: Instance, lam: float | None = None) -> list[int]:
    """The best prefix of :func:`path_prob_order` under the cost model and budgets: a 1-D scan.

    Parameters
    ----------
    instance : Instance
    lam : float, optional
        λ in tokens per ms: maximise ``A - λT``; default: maximise ``A / T`` (SPECFIT.md §3).

    Returns
    -------
    list of int
        Sorted node ids of the best prefix, root included (ancestor-closed). The scan stops at the
        first prefix that breaks a budget (a longer prefix breaks it too).
    """
    if instance.cost.regime != "host" and not instance.priced_items.union(range(instance.n)):
        return linear_prefix(instance, lam)
    return scan_prefix(instance, lam)


def scan_prefix(instance: Instance, lam: float | None = None) -> list[int]:
    """:func:`best_prefix` by the node-by-node scan, without its check for the closed form (for callers
    that know some node needs an uncached expert, or whose cost is a host-regime profile)."""
    order = path_prob_order(instance)
    cov = GrowingSelection(instance)
    best, best_len = cov.value(lam), 1
    for k, v in enumerate(order[1:], start=2):
        if not cov.fits(v):
            break
        cov.add(v)
        val = cov.value(lam)
        if val > best:
            best, best_len = val, k
    return sorted(order[:best_len])


def linear_prefix(instance: Instance, lam: float | None = None) -> list[int]:
    """:func:`best_prefix` of a transfer-regime instance in which no node needs an uncached expert.

    T of a k-node prefix is then ``fixed_ms + k * per_node_ms`` (ms) and A its ``1 + Σ P`` (tokens),
    so the scan is two cumulative sums and an argmax (SPECFIT.md §3: with T linear in |S| a prefix of
    the path-probability order is optimal). The sums run in the scan's order and the first maximum
    wins, as in the scan: the same floats, the same prefix. The caller checks the precondition.

    Parameters
    ----------
    instance : Instance
        Cost a :class:`~specfit.core.cost.CostModel`; ``max_nodes`` is honoured.
    lam : float, optional
        λ in tokens per ms: maximise ``A - λT``; default ``A / T``.

    Returns
    -------
    list of int
        Sorted node ids of the best prefix, root included.
    """
    order = path_prob_order(instance)
    k = len(order) if instance.max_nodes is None else min(len(order), instance.max_nodes)
    prob = instance.tree.path_prob[np.asarray(order[:k])]
    prob[0] = 1.0  # the root
    a = np.cumsum(prob)
    t = np.full(k + 1, float(instance.cost.per_node_ms))
    t[0] = instance.cost.fixed_ms
    t = np.cumsum(t)[1:]
    value = a / t if lam is None else a - lam * t
    return sorted(order[:int(np.argmax(value)) + 1])


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
    cost_aware = False

    def __init__(self, total_tokens: int = 32):
        if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 0:
            raise SpecFitInputError("total_tokens", f"must be an integer >= 0, got {total_tokens!r}")
        self.total_tokens = total_tokens

    def select(self, instance: Instance, rate: float | None) -> tuple[Sequence[int], str]:
        cov = GrowingSelection(instance)
        par = instance.tree.parents
        for v in path_prob_order(instance)[1:]:
            if cov.size >= self.total_tokens + 1:
                break
            if cov.in_set[par[v]] and cov.fits(v):
                cov.add(v)
        return cov.nodes(), "heuristic"


class ScanSolver(Solver):
    """The best prefix of the path-probability order under the cost model and budgets: a 1-D scan.

    Exact when ``per_expert_ms`` is 0 and there is no expert budget (SPECFIT.md §3: the top-m
    nodes by P then maximise A for each size m). The scan stops at the first prefix that breaks a
    budget (a longer prefix breaks it too).
    """

    name = "scan"

    def select(self, instance: Instance, rate: float | None) -> tuple[Sequence[int], str]:
        return best_prefix(instance, _lam(rate)), "heuristic"


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
        cov = GrowingSelection(instance)
        prob = instance.tree.path_prob
        children = instance.tree.children
        frontier = set(children[0])
        while frontier:
            cand = np.array(sorted(v for v in frontier if cov.fits(v)), dtype=np.int64)
            if not cand.size:
                break
            d = np.array([cov.step_ms(v) for v in cand.tolist()])
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
        return cov.nodes(), "heuristic"
