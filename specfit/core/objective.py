"""The throughput objective of SPECFIT.md §3 evaluated on a node set.

    A(S) = 1 + sum_{v in S, v != root} P_v                      expected committed tokens
    T(S) = fixed_ms + per_node_ms |S| + sum_l [per_expert_ms[l] |U_l(S) \\ C[l]| + read_ms |U_l(S)|],
    U_l(S) = U_{v in S} E[v][l]
    throughput = 1000 * A(S) / T(S)                             tokens/s

In the host-compute regime (the instance's cost a :class:`specfit.core.cost.HostProfile`),
T(S) = extra_ms + (R / L) sum_l [max(g(|S|), h_l(S)) + sync_ms [u_l(S) > 0]] with u_l(S) the union
above, r_l(S) = sum_{v in S} |E[v][l] \\ C[l]| and h_l = host_per_expert_ms u_l + host_per_row_ms r_l
(:meth:`HostProfile.cycle_ms`).

A(S) is the expected number of committed tokens (accepted draft tokens + the bonus token) by
linearity of expectation over the nodes of S, assuming Pr[v accepted] = P_v (the calibration
assumption of EAGLE-2, Li et al. 2024, §3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance


@dataclass(frozen=True)
class Evaluation:
    """The objective's terms for one node set.

    ``expected_tokens`` (tokens per cycle), ``predicted_ms`` (ms per cycle), ``throughput``
    (tokens/s), ``new_experts`` (uncached experts per layer, int array of shape (L,)),
    ``rate_value`` (``A - rate * T``, only meaningful in rate mode).
    """

    nodes: tuple[int, ...]
    expected_tokens: float
    predicted_ms: float
    throughput: float
    new_experts: np.ndarray

    def rate_value(self, rate: float) -> float:
        """``A(S) - rate * T(S)`` with ``rate`` in tokens per ms."""
        return self.expected_tokens - rate * self.predicted_ms


def _check_nodes(instance: Instance, nodes: Iterable[int]) -> tuple[int, ...]:
    s = set(map(int, nodes))
    if not instance.tree.is_ancestor_closed(s):
        raise SpecFitInputError("nodes", "must be ancestor-closed: contain the root and every node's parent")
    return tuple(sorted(s))


def expected_tokens(instance: Instance, nodes: Iterable[int]) -> float:
    """A(S): expected committed tokens per cycle, ``1 + sum of P_v over non-root v in S``."""
    s = _check_nodes(instance, nodes)
    return 1.0 + float(instance.tree.path_prob[list(s[1:])].sum()) if len(s) > 1 else 1.0


def _cycle_ms(instance: Instance, s: tuple[int, ...], new: np.ndarray) -> float:
    """T(S) from the uncached experts per layer ``new``; the host regime also reads the rows."""
    if instance.cost.regime == "host":
        resident = instance.read_per_layer(s) - new if instance.reads_priced else None  # |U_l ∩ C_l|
        return instance.cost.cycle_ms(len(s), new, instance.items.rows_per_layer(s), None, resident)
    if instance.reads_priced:
        return instance.cost.cycle_ms(len(s), new, None, instance.read_per_layer(s))
    return instance.cost.cycle_ms(len(s), new)


def predicted_ms(instance: Instance, nodes: Iterable[int]) -> float:
    """T(S): predicted cycle time in ms, counting each uncached expert once per layer (host
    regime: SPECFIT.md §3, "Host-compute regime")."""
    s = _check_nodes(instance, nodes)
    return _cycle_ms(instance, s, instance.items.new_per_layer(s))


def evaluate(instance: Instance, nodes: Iterable[int]) -> Evaluation:
    """Evaluate A(S), T(S) and the throughput ``1000 * A / T`` (tokens/s) of node set S.

    Raises
    ------
    SpecFitInputError
        If ``nodes`` is not ancestor-closed (root and every node's parent included).
    """
    s = _check_nodes(instance, nodes)
    return _evaluation(instance, s, instance.items.new_per_layer(s))


def evaluate_uncovered(instance: Instance, nodes: Sequence[int]) -> Evaluation:
    """:func:`evaluate` of a node set that the caller knows to be sorted, ancestor-closed and free of
    uncached experts (no node of ``instance`` needs one, transfer regime): the same floats, without the
    closure check and the coverage count (a solver's best prefix, per solve in the engine).

    Parameters
    ----------
    instance : Instance
        Cost a :class:`~specfit.core.cost.CostModel` (not checked).
    nodes : sequence of int
        Increasing node ids, root first (not checked).

    Returns
    -------
    Evaluation
        ``expected_tokens`` A(S) (tokens), ``predicted_ms`` T(S) (ms), ``throughput`` (tokens/s);
        ``new_experts`` all zero, shape (L,). Nothing is raised: the caller vouches for ``nodes``.

    References
    ----------
    SPECFIT.md §3: A(S) = 1 + Σ P_v, and T(S) = fixed_ms + per_node_ms |S| when S brings no uncached expert.
    """
    idx = np.asarray(nodes, dtype=np.int64)
    a = 1.0 + float(instance.tree.path_prob[idx[1:]].sum()) if len(idx) > 1 else 1.0  # as _evaluation
    cost = instance.cost  # cycle_ms with no uncached expert: fixed_ms + per_node_ms |S| (+ 0.0, the same float)
    return _finish(tuple(idx.tolist()), a, cost.fixed_ms + cost.per_node_ms * len(idx),
                   np.zeros(instance.num_layers, dtype=np.int64))


def evaluation(nodes: np.ndarray, a: float, t: float, new: np.ndarray) -> Evaluation:
    """The :class:`Evaluation` of a solver's selection whose A, T and uncached experts per layer the solver
    computed as :func:`evaluate` does (the compiled exact solver: the same floats, bit for bit, without the
    closure check and the coverage count).

    Parameters
    ----------
    nodes : numpy.ndarray of int64, shape (|S|,)
        Increasing node ids, root first, ancestor-closed (not checked).
    a : float
        A(S), tokens.
    t : float
        T(S), ms.
    new : numpy.ndarray of int64, shape (L,)
        ``|(U_{v in S} E[v][l]) \\ C[l]|`` per layer (not checked).

    Returns
    -------
    Evaluation
        Throughput ``1000 A / T`` tokens/s. Nothing is raised: the caller vouches for the values.

    References
    ----------
    SPECFIT.md §3: A(S) = 1 + Σ_{v in S, v != root} P_v, T(S) the cycle time of S's node count and uncached experts.
    """
    return _finish(tuple(nodes.tolist()), a, t, new)


def _evaluation(instance: Instance, s: tuple[int, ...], new: np.ndarray) -> Evaluation:
    """The :class:`Evaluation` of the sorted, checked node tuple ``s`` with ``new`` uncached experts per layer."""
    a = 1.0 + float(instance.tree.path_prob[list(s[1:])].sum()) if len(s) > 1 else 1.0
    return _finish(s, a, _cycle_ms(instance, s, new), new)


def _finish(s: tuple[int, ...], a: float, t: float, new: np.ndarray) -> Evaluation:
    """The :class:`Evaluation` of node tuple ``s`` from A (tokens) and T (ms): throughput ``1000 A / T``."""
    return Evaluation(s, a, t, 1000.0 * a / t if t > 0 else float("inf"), new)


def within_budget(instance: Instance, nodes: Iterable[int]) -> bool:
    """True iff S respects ``max_nodes`` and ``max_new_experts_per_layer``."""
    s = _check_nodes(instance, nodes)
    if instance.max_nodes is not None and len(s) > instance.max_nodes:
        return False
    if instance.max_new_experts_per_layer is not None and instance.num_layers:
        return bool(instance.items.new_per_layer(s).max() <= instance.max_new_experts_per_layer)
    return True
