"""The sound stop rule for level-by-level drafting (SPECFIT.md §3).

After each draft level the engine solves the selection problem on the tree drafted so far and asks
:func:`should_stop` whether drafting deeper could still pay (only when :func:`ratio_upper_bound`, an
upper bound on the solve's answer, says the rule can fire at all). Before drafting, :func:`draft_can_beat_ar`
asks whether any draft can beat the plain AR step at all (the AR gate), and :func:`selectable`
which drafted nodes can belong to an optimal selection at all (the others need no expert prediction,
no coverage accounting and no place in the solver's instance).
"""

from __future__ import annotations

import math

import numpy as np

from specfit.core.cost import CostModel, HostProfile, check_ms
from specfit.core.errors import SpecFitInputError, check_positive_int
from specfit.core.tree import check_probabilities


def should_stop(best_throughput_tok_s: float, frontier_max_path_prob: float, cost: CostModel | HostProfile,
                rate: float | None = None, *, level_ms: float = 0.0, level_width: int | None = None,
                min_node_ms: float | None = None) -> bool:
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
    cost : CostModel or HostProfile
        Only ``min_node_ms`` is used: a lower bound on what one more verified node adds to T(S) for
        any S (transfer regime: ``per_node_ms``; host-compute regime: 0, see below).
    rate : float, optional
        Rate mode: the long-run rate λ in tokens/s; the objective is ``A - (λ/1000) T``.
    level_ms : float
        Whole-cycle objective: ms every further draft level costs (head forward + predictor + solve,
        :attr:`CostModel.level_ms`); 0 when drafting is free.
    level_width : int, optional
        Most nodes one further draft level can add (EAGLE: ``top_k ** 2``); None: unbounded, and
        the level cost cannot be spread over the nodes (it is then not used).
    min_node_ms : float, optional
        A per-node lower bound of T that holds for this cycle (e.g. ``cost.min_node_ms_for(cache)``,
        which knows the cycle's expert cache); default ``cost.min_node_ms``.

    Returns
    -------
    bool
        Ratio mode: ``P_f <= (min_node_ms + level_ms / level_width) * R*/1000``. Rate mode: the
        same with λ for R*.

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

    The proof needs of T only that each new node adds at least ``per_node_ms`` whatever the
    selection it joins; it reads that bound from ``cost.min_node_ms``. Host-compute regime
    (:class:`~specfit.core.cost.HostProfile`, T = Σ_l max(g, h_l) + sync): a node adds to each layer
    at least the smaller of the GPU part's increment and its own host rows' time, which is 0 for a
    node whose experts are all cached where the host part binds, so ``min_node_ms`` = 0 and the rule
    becomes ``P_f <= (level_ms / w) * R*`` (with no level cost: stop only when P_f = 0). The proof
    holds with per_node_ms replaced by 0 (T is monotone in S: new nodes add >= 0). Given the
    cycle's cache the bound can be positive: a layer whose every expert is cached never computes
    on the host, so there each node adds the GPU part's increment (``HostProfile.min_node_ms_for``).

    Whole-cycle objective (SPECFIT.md §3). T(S) above is then the whole cycle: it includes the D ms of
    the levels drafted so far (a constant of the cycle, in R*'s denominator too), and a tree k >= 1
    levels deeper pays k * level_ms more. Its new nodes lie in those k levels, so |N| <= k w
    (w = ``level_width``) and its extra time is at least |N| per_node_ms + k level_ms >=
    |N| (per_node_ms + level_ms / w). The argument above with per_node_ms replaced by
    per_node_ms + level_ms / w gives the rule; a deeper tree with N empty is S_0 at a higher cost.

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
    return p_f <= stop_node_ms(cost, level_ms=level_ms, level_width=level_width, min_node_ms=min_node_ms) * r / 1000.0


def stop_node_ms(cost: CostModel | HostProfile, *, level_ms: float = 0.0, level_width: int | None = None,
                 min_node_ms: float | None = None) -> float:
    """The per-node ms of the stop rule, ``min_node_ms + level_ms / level_width`` (:func:`should_stop`
    stops iff ``P_f <= stop_node_ms * R* / 1000``): constant over a cycle, so the engine computes it
    once per cycle and compares each level's ``P_f`` with the same float :func:`should_stop` would.

    Parameters
    ----------
    cost, level_ms, level_width, min_node_ms
        As :func:`should_stop`.

    Returns
    -------
    float
        ms, >= 0.

    Raises
    ------
    SpecFitInputError
        If ``min_node_ms`` or ``level_ms`` is negative or not finite, or ``level_width`` not an
        integer >= 1.

    References
    ----------
    SPECFIT.md §3, "Stop rule (sound)" and "Whole-cycle objective" (the level term); the proof is in
    :func:`should_stop`.
    """
    per_node = cost.min_node_ms if min_node_ms is None else check_ms("min_node_ms", min_node_ms)
    if level_width is not None:
        check_positive_int("level_width", level_width)
        per_node += check_ms("level_ms", level_ms) / level_width
    return per_node


def ratio_upper_bound(path_prob, root_ms: float, min_node_ms: float) -> float:
    """An upper bound on R*, the best ratio ``1000 A(S) / T(S)`` over the selections of a draft tree,
    from its path probabilities and two lower bounds of T alone (no solve, no experts).

    Parameters
    ----------
    path_prob : array-like of float, shape (m,)
        P_v of the tree's draft nodes (the root excluded; the objective's, calibrated where the
        engine calibrates), in [0, 1].
    root_ms : float
        T({root}), ms (> 0): the root alone, with every cost of the cycle that does not depend on
        the selection (e.g. the draft levels paid).
    min_node_ms : float
        A per-node lower bound of T (``cost.min_node_ms_for(cache)``): every draft node a selection
        holds adds at least this many ms.

    Returns
    -------
    float
        tokens/s: ``max_k 1000 (1 + P_(1) + ... + P_(k)) / (root_ms + k min_node_ms)`` over k = 0..m,
        with P_(1) >= P_(2) >= ... the path probabilities sorted.

    Raises
    ------
    SpecFitInputError
        If ``path_prob`` is not a sequence of probabilities in [0, 1] (field ``path_prob`` or
        ``path_prob[i]``), ``root_ms`` is not a finite number > 0, or ``min_node_ms`` is negative or not
        finite.

    Notes
    -----
    Proof. A selection S with k draft nodes has A(S) = 1 + ΣP over them <= 1 + P_(1) + ... + P_(k),
    and T(S) >= root_ms + k min_node_ms (S holds the root; adding its k nodes one leaf at a time
    adds at least ``min_node_ms`` each, the bound :func:`selectable` uses), so A(S)/T(S) is at most
    the k-th term. It ignores the tree's shape and the experts' cost, so it is loose where those
    bind; it is never above ``1000 (1 + ΣP) / root_ms`` (k = m with the node cost dropped). The
    engine asks it before it predicts and solves in the middle of drafting: when even this bound
    cannot make the stop rule fire, the solve would not stop drafting (SPECFIT.md §3, "Stop rule").
    """
    try:
        n = len(path_prob)
    except TypeError:
        raise SpecFitInputError("path_prob", "must be a sequence of probabilities") from None
    p = check_probabilities(path_prob, "path_prob", n)
    t = check_ms("root_ms", root_ms)
    if t <= 0:
        raise SpecFitInputError("root_ms", f"must be > 0 (ms), got {t}")
    return ratio_upper_bound_unchecked(np.ascontiguousarray(p, dtype=np.float64), t, check_ms("min_node_ms", min_node_ms))


def ratio_upper_bound_unchecked(path_prob: np.ndarray, root_ms: float, min_node_ms: float) -> float:
    """:func:`ratio_upper_bound` of checked arguments (a C-contiguous float64 array of probabilities,
    ``root_ms`` > 0): the engine's, whose path probabilities come from its own levels and whose T(root alone)
    is a cost model's; one compiled call (:func:`specfit.core.kernels.ratio_bound_kernel`)."""
    from specfit.core.kernels import ratio_bound_kernel

    return ratio_bound_kernel()(path_prob, float(root_ms), float(min_node_ms))


def draft_can_beat_ar(ar_ms: float, level_mass, level_ms: float, per_node_ms: float,
                      min_expert_ms: float) -> bool:
    """False iff no draft tree the model admits beats the plain AR step this cycle (the AR gate).

    Parameters
    ----------
    ar_ms : float
        T(AR): predicted ms of verifying the root alone (fixed + one node + the root's uncached
        predicted experts). The AR step commits 1 token in ``ar_ms``.
    level_mass : sequence of float, shape (D,)
        ``a_j``: an upper bound on the sum of the (calibrated) path probabilities of the nodes at
        depth j of any tree the drafter can draft this cycle, j = 1..D.
    level_ms : float
        ms of drafting one level (:attr:`CostModel.level_ms`).
    per_node_ms : float
        A lower bound on what each draft node adds (the cost's ``min_node_ms``: ``per_node_ms`` in
        the transfer regime, ``node_extra_ms`` in the host-compute regime).
    min_expert_ms : float
        A lower bound on the ms that any non-empty set N of draft nodes adds to T(AR) beyond
        ``|N| per_node_ms``. Transfer regime: the transfer of experts neither cached nor the root's.
        Host-compute regime: ``min_v T({root, v}) - T({root}) - node_extra_ms`` over the nodes v that
        can be drafted (``HostProfile.node_added_ms``).

    Returns
    -------
    bool
        True iff ``max_J [ar_ms * sum_{j<=J} a_j - J (level_ms + per_node_ms)] > min_expert_ms``.

    Raises
    ------
    SpecFitInputError
        If ``ar_ms`` is not > 0 or a bound is negative or not finite.

    Notes
    -----
    Proof. A drafted cycle whose selection S has draft nodes N of depth at most J (J >= 1) has drafted
    at least J levels and verifies at least one node per depth 1..J, so its whole-cycle time is
    T >= ar_ms + J level_ms + |N| per_node_ms + X with X >= ``min_expert_ms`` the experts N adds, and
    A = 1 + sum_N P <= 1 + sum_{j<=J} a_j. It beats AR iff A / T > 1 / ar_ms, i.e.
    ar_ms (A - 1) > T - ar_ms, which needs ar_ms sum_{j<=J} a_j - J (level_ms + per_node_ms) > X >=
    min_expert_ms. A cycle that drafts but selects the root alone (N empty) has A = 1 and
    T >= ar_ms + level_ms: never better. So when the function returns False no drafted cycle beats
    AR within the model (SPECFIT.md §3, "The AR step as a candidate").

    Host-compute regime: T is monotone in S, so for any v in N the verify costs at least
    T({root, v}) = ar_ms + (T({root, v}) - T({root})) >= ar_ms + X with X the smallest such increment,
    and ``per_node_ms`` is the profile's ``node_extra_ms`` (>= 0, added per node outside the per-layer max):
    T >= ar_ms + J (level_ms + per_node_ms) + X, and the argument above goes through.
    """
    t = float(ar_ms)
    if not (t > 0 and math.isfinite(t)):
        raise SpecFitInputError("ar_ms", f"must be a finite number > 0 (ms), got {ar_ms!r}")
    for name, v in (("level_ms", level_ms), ("per_node_ms", per_node_ms), ("min_expert_ms", min_expert_ms)):
        check_ms(name, v)
    gain, best = 0.0, -math.inf
    for j, a in enumerate(level_mass, 1):
        if not (float(a) >= 0 and math.isfinite(float(a))):
            raise SpecFitInputError(f"level_mass[{j - 1}]", f"must be a finite number >= 0, got {a!r}")
        gain += t * float(a)
        best = max(best, gain - j * (float(level_ms) + float(per_node_ms)))
    return best > float(min_expert_ms)


def selectable(path_prob, min_node_ms: float, rate_lo: float) -> np.ndarray:
    """Which nodes can belong to an optimal selection: those with ``P_v >= (rate_lo/1000) * min_node_ms``.

    Parameters
    ----------
    path_prob : array-like of float, shape (m,)
        Path probabilities P_v of draft nodes (the objective's, calibrated where the engine
        calibrates); the root is in every selection and is not asked about.
    min_node_ms : float
        A per-node lower bound of T for this cycle (``cost.min_node_ms_for(cache)``): removing a leaf
        from any selection saves at least this many ms.
    rate_lo : float
        Ratio mode: a lower bound (tokens/s) on R*, the best ratio ``1000 A(S)/T(S)`` over the
        subtrees of every tree the cycle can still draft, e.g. ``1000 / (T(root alone) + every
        level's cost)``; rate mode: the rate λ itself.

    Returns
    -------
    numpy.ndarray of bool, shape (m,)
        False for a node in no optimal selection (nor, as path probabilities do not increase along
        paths, any of its descendants).

    Raises
    ------
    SpecFitInputError
        If ``min_node_ms`` or ``rate_lo`` is negative or not finite.

    Notes
    -----
    Proof (ratio mode). Let S* be optimal, R* = A(S*)/T(S*) in tokens/ms, and suppose some v in S*
    has P_v < R* min_node_ms. Its descendants in S* have P <= P_v, so S* has a leaf u with
    P_u < R* min_node_ms. S* \\ {u} is ancestor-closed and within every budget, and
    t_u = T(S*) - T(S* \\ {u}) >= min_node_ms, so
    A(S* \\ {u}) / T(S* \\ {u}) = (R* T(S*) - P_u) / (T(S*) - t_u) > R*  (as P_u < R* t_u):
    S* was not optimal. Hence no optimal S* holds a node with P_v < R* min_node_ms, and a fortiori
    none with P_v < R_lo min_node_ms for R_lo <= R*. Rate mode: removing u changes A - λT by
    λ t_u - P_u > 0. The same per-node bound gives the stop rule its proof (:func:`should_stop`).
    """
    return np.asarray(path_prob, dtype=np.float64) >= selectable_threshold(min_node_ms, rate_lo)


def selectable_threshold(min_node_ms: float, rate_lo: float) -> float:
    """The path probability below which :func:`selectable` rules a node out: ``(rate_lo / 1000) * min_node_ms``.

    Parameters and errors as :func:`selectable`'s (``min_node_ms`` in ms, ``rate_lo`` in tokens/s).

    Returns
    -------
    float
        The threshold (a path probability); a node with ``P_v >= threshold`` is kept.
    """
    m = check_ms("min_node_ms", min_node_ms)
    r = float(rate_lo)
    if not (r >= 0.0 and math.isfinite(r)):
        raise SpecFitInputError("rate_lo", f"must be a finite number >= 0 (tokens/s), got {rate_lo!r}")
    return r / 1000.0 * m
