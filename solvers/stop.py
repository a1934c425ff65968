"""The sound stop rule for level-by-level drafting (SPECFIT.md §3).

After each draft level the engine solves the selection problem on the tree drafted so far and asks
:func:`should_stop` whether drafting deeper could still pay.
"""

from __future__ import annotations

import math

from specfit.core.cost import CostModel
from specfit.core.errors import SpecFitInputError


def should_stop(best_throughput_tok_s: float, frontier_max_path_prob: float, cost: CostModel,
                rate: float | None = None) -> bool:
    """True iff no deeper draft tree can beat the best selection of the tree drafted so far.

    Parameters
    ----------
    best_throughput_tok_s : float
        Ratio mode: R*, the best predicted throughput ``1000 * A(S*) / T(S*)`` (tokens/s) over the
        subtrees of the current tree (an exact solver's answer; a heuristic's lower value makes
        the rule stop later, never wrongly). Ignored in rate mode.
    frontier_max_path_prob : float
        P_f, the largest path probability among the nodes whose descendants may still be drafted
        (for EAGLE-style drafting, the nodes of the last level); 0 when none remain.
    cost : CostModel
        Only ``per_node_ms`` is used.
    rate : float, optional
        Rate mode: the long-run rate λ in tokens/s; the objective is ``A - (λ/1000) T``.

    Returns
    -------
    bool
        Ratio mode: ``P_f <= per_node_ms * R*/1000``. Rate mode: ``P_f <= per_node_ms * λ/1000``.

    Raises
    ------
    SpecFitInputError
        If a throughput, rate or probability is negative or not finite, or P_f > 1.

    Notes
    -----
    Proof (ratio mode). Let the current tree be D with best ratio R* = A(S*)/T(S*) (tokens/ms),
    and let S be any ancestor-closed subtree, within the budgets, of any tree D' ⊇ D that drafting
    can still produce. Split S = S_0 ∪ N with S_0 = S ∩ D and N the new nodes. S_0 is ancestor-
    closed (an ancestor of a node of D is in D) and within the budgets (|S| and the coverage only
    grow with S), so A(S_0) <= R* T(S_0). Every new node descends from a frontier node and path
    probabilities do not increase along paths, so each adds at most P_f to A, while it adds at least
    per_node_ms to T (coverage terms are >= 0). Hence
    A(S) <= R* T(S_0) + |N| P_f <= R* T(S_0) + |N| per_node_ms R* <= R* T(S)
    whenever P_f <= per_node_ms R*: no deeper tree beats R*.
    Rate mode: A(S) - λT(S) <= A(S_0) - λT(S_0) + |N| (P_f - λ per_node_ms) <= A(S*) - λT(S*)
    whenever P_f <= λ per_node_ms.

    References
    ----------
    SPECFIT.md §3, "Stop rule (sound)".
    """
    p_f = float(frontier_max_path_prob)
    if not (0.0 <= p_f <= 1.0):
        raise SpecFitInputError("frontier_max_path_prob", f"must lie in [0, 1], got {frontier_max_path_prob!r}")
    if rate is None:
        r = float(best_throughput_tok_s)
        if not (r >= 0.0 and math.isfinite(r)):
            raise SpecFitInputError("best_throughput_tok_s", f"must be a finite number >= 0, got {best_throughput_tok_s!r}")
    else:
        r = float(rate)
        if not (r >= 0.0 and math.isfinite(r)):
            raise SpecFitInputError("rate", f"must be a finite number >= 0 (tokens/s), got {rate!r}")
    return p_f <= cost.per_node_ms * r / 1000.0
