"""Calibrated acceptance: draft probabilities mapped to acceptance probabilities learned from verifies.

A draft tree's path probability ``P_v`` (the product of the draft's conditional probabilities q
along the root → v path) is EAGLE-2's stand-in for ``Pr[v accepted]`` (Li et al. 2024, §3). Measured
on the shipped proxy it is not calibrated: it under-predicts the tokens a verify commits (BENCHMARKS.md,
"Transfer regime: the four grids": raw predicted A against τ).
:class:`AcceptanceCalibrator` learns the *conditional* acceptance ``Pr[v accepted | parent accepted]``
per (depth, confidence bin of q) online, optionally split by sibling-rank class:

    π(q, r, b, d) = (s * q + a'[d, r, b]) / (s + n'[d, r, b])     a', n': cell (r, b) at the other depths
    c(q, d, r)    = (s * π + a[d, r, b]) / (s + n[d, r, b])        b = bin of q,  d = min(depth, max_depth)

a Beta-binomial posterior mean whose prior (worth ``s`` pseudo-trials) is the same rank class and bin
pooled over the other depths, itself with a prior ``Beta(s q, s (1 - q))`` centred on the draft's own
q; ``n`` trials of which ``a`` were accepted. With ``rank_classes=2`` the rank class r is 0 for the
most likely child of its parent (the largest q among its siblings, :func:`sibling_rank`) and 1 for the
others (an EAGLE head's q is under-confident for its top child and not for the others); the default,
one class (r = 0 for every node), learns from twice the trials per cell and measured better on runs of
a few hundred cycles (SPECFIT.md §3). c is linear in q within
a cell, ``α q + β``; both are recomputed after each update. The calibrated path probability is the
product along the path, ``P̂_v = P̂_parent(v) * c``; since every c <= 1, P̂ is non-increasing along
every path (what the solvers and the stop rule rely on). Siblings are mutually exclusive (at most one
child of a node is accepted, greedy or sampling verification), so one node's children's calibrated
conditionals are capped to sum to at most 1: the most likely children's first, then the others' to
what those leave.

Trials (SPECFIT.md §3, "Calibrated acceptance"): after a verify, every verified draft node whose
parent lies on the accepted path is one Bernoulli trial, a success iff the node is on it
(:func:`verify_trials`). Under greedy verification the target's next token after every accepted node
is known (the next accepted token, or the bonus token), so every *drafted* child of an accepted node,
verified or not, is a trial, a success iff it carries that token (:func:`greedy_trials`): a selection
that verifies few nodes still learns how often the nodes it left out would have been accepted.
"""

from __future__ import annotations

import numpy as np

from specfit.core.errors import SpecFitInputError, check_nonnegative_int, check_positive_int
from specfit.core.tree import check_probabilities

#: Default upper edges of the confidence bins of q (the last bin ends at 1).
DEFAULT_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


class AcceptanceCalibrator:
    """Online Beta-binomial calibration of conditional acceptance per depth × confidence bin, optionally
    × sibling-rank class (module docstring).

    Parameters
    ----------
    max_depth : int
        Depths beyond it share the last depth's counts.
    prior_strength : float
        ``s``, pseudo-trials of each prior: the depth-pooled one, and its own centred on the draft's q (> 0).
    edges : sequence of float
        Increasing upper edges of the q bins in (0, 1).
    rank_classes : int
        1 (default): one table per depth; 2: the most likely child of its parent and the others
        apart (:func:`sibling_rank`). Caps use the sibling ranks either way.

    Raises
    ------
    SpecFitInputError
        On a non-positive ``max_depth`` or ``prior_strength``, bad edges or ``rank_classes`` not 1 or 2.
    """

    def __init__(self, max_depth: int = 8, prior_strength: float = 4.0, edges=DEFAULT_EDGES, rank_classes: int = 1):
        check_positive_int("max_depth", max_depth)
        if not (prior_strength > 0 and np.isfinite(prior_strength)):
            raise SpecFitInputError("prior_strength", f"must be a finite number > 0, got {prior_strength!r}")
        e = np.asarray(edges, dtype=np.float64)
        if e.ndim != 1 or np.any(np.diff(e) <= 0) or (e.size and (e[0] <= 0 or e[-1] >= 1)):
            raise SpecFitInputError("edges", "must be increasing numbers in (0, 1)")
        if rank_classes not in (1, 2):
            raise SpecFitInputError("rank_classes", f"must be 1 or 2, got {rank_classes!r}")
        self.rank_classes = int(rank_classes)
        self.max_depth, self.prior_strength, self.edges = int(max_depth), float(prior_strength), e
        self.trials = np.zeros((self.max_depth, self.rank_classes, e.size + 1))
        self.accepted = np.zeros((self.max_depth, self.rank_classes, e.size + 1))
        #: Per depth (index d: depth d; index 0, the root, unused): calibrated path probabilities of the
        #: verified nodes, summed over verifies, and how many of those verifies accepted a node at that
        #: depth (:meth:`observe_paths`); the path correction f_d (:meth:`path_prob`).
        self.path_predicted = np.zeros(self.max_depth + 1)
        self.path_accepted = np.zeros(self.max_depth + 1)
        self.path_factor = np.ones(self.max_depth + 1)
        #: (max_depth + 1,) int64: depth d's first cell in the flat tables with one rank class (d >= 1)
        self._depth_offset = (np.arange(self.max_depth + 1) - 1) * (e.size + 1)
        self.refresh()
        from specfit.core.kernels import draft_level_kernel, learn_verify_kernel, level_probs_kernel

        level_probs_kernel()  # compiled (or loaded from numba's cache) here: no decoding cycle pays them
        draft_level_kernel()
        learn_verify_kernel()

    def _cell(self, q: np.ndarray, depth: np.ndarray, rank) -> np.ndarray:
        """Flat index of each node's (depth, rank class, q bin) cell in :attr:`trials` (q clipped; rank
        classes past the last, and every rank with one class, count as the last)."""
        d = np.minimum(np.maximum(np.asarray(depth, dtype=np.int64), 1), self.max_depth)
        k = self.rank_classes
        r = 0 if rank is None or k == 1 else np.minimum(np.maximum(np.asarray(rank, dtype=np.int64), 0), k - 1)
        return (d * k + (r - k)) * self.trials.shape[2] + np.searchsorted(self.edges, q, side="left")

    def refresh(self) -> None:
        """Recompute every cell's ``α``, ``β`` (``c = α q + β``, module docstring) from :attr:`trials` and
        :attr:`accepted`; :meth:`update` calls it, a caller that changes the tables directly must too."""
        s, n, a = self.prior_strength, self.trials, self.accepted
        other_n, other_a = n.sum(axis=0) - n, a.sum(axis=0) - a  # the same rank class and bin at the other depths
        self._alpha = (s * s / ((s + other_n) * (s + n))).ravel()
        self._beta = ((s * other_a / (s + other_n) + a) / (s + n)).ravel()

    def _rate(self, q, cell) -> np.ndarray:
        """The posterior mean of cells ``cell`` (flat ids) at draft probabilities q."""
        return self._alpha[cell] * q + self._beta[cell]

    def conditional(self, q, depth, rank=None) -> np.ndarray:
        """Calibrated ``Pr[accepted | parent accepted]`` of nodes with draft probability q at a depth.

        Parameters
        ----------
        q : array-like of float, shape (m,)
            The nodes' conditional draft probabilities, in [0, 1].
        depth : array-like of int, shape (m,)
            Their depths (root 0, so >= 1 for draft nodes).
        rank : array-like of int, shape (m,), optional
            Their sibling-rank classes (:func:`sibling_rank`: 0 for the most likely child, 1 for
            the others; ignored with one rank class); default 0.

        Returns
        -------
        numpy.ndarray of float64, shape (m,), values in [0, 1]
        """
        q = _unit(q)
        return self._rate(q, self._cell(q, depth, rank))

    def level_path_prob(self, parent_cal, parents, q, depth) -> np.ndarray:
        """Calibrated path probabilities of one draft level, ``P̂_parent * c`` (module docstring).

        Parameters
        ----------
        parent_cal : numpy.ndarray of float64, shape (n,)
            Calibrated path probabilities of the nodes already in the tree.
        parents : array-like of int, shape (m,)
            The new nodes' parents (ids into ``parent_cal``); all children of a node are in one level.
        q, depth : array-like, shape (m,)
            The new nodes' conditional draft probabilities and depths.

        Returns
        -------
        numpy.ndarray of float64, shape (m,)
            Each at most its parent's; each parent's children's conditionals sum to at most 1 (at most
            one child is accepted): the most likely children's (:func:`sibling_rank`) are scaled to sum
            to at most 1, then the others' to at most what those leave.
        """
        return self.level(parent_cal, parents, q, depth)[0]

    def level(self, parent_cal, parents, q, depth) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`level_path_prob` and the nodes' sibling-rank classes (:func:`sibling_rank`), both shape (m,)."""
        par, q = np.asarray(parents, dtype=np.int64), _unit(q)
        if not q.size:
            return np.zeros(0), np.zeros(0, dtype=np.int64)
        nb = int(par.max()) + 1
        d = np.minimum(np.maximum(np.asarray(depth, dtype=np.int64), 1), self.max_depth)  # _cell's clip
        p_hat, rank = self._level(np.asarray(parent_cal), par, q, d, nb)
        return p_hat, _sibling_rank(par, q, nb) if rank is None else rank

    def _level(self, parent_cal: np.ndarray, par: np.ndarray, q: np.ndarray, depth, nb: int):
        """:meth:`level` of a non-empty level with q in [0, 1], parents ``< nb`` and depths (an int, or
        int64 of shape (m,)) in [1, max_depth]; the rank classes only where they were needed (two rank
        classes, or a cap), else None."""
        if self.rank_classes == 2:
            rank = _sibling_rank(par, q, nb)
            cell = self._cell(q, depth, rank)
        else:  # one rank class: _cell's index of depth d in [1, max_depth] is (d - 1) * bins + bin
            rank = None
            cell = np.searchsorted(self.edges, q, side="left")
            cell += self._depth_offset[depth]
        c = self._alpha[cell] * q
        c += self._beta[cell]
        np.minimum(c, 1.0, out=c)
        if np.bincount(par, weights=c, minlength=nb).max() > 1.0:  # else nothing to cap
            if rank is None:
                rank = _sibling_rank(par, q, nb)
            # per parent p: its most likely children's conditionals summed at 2p, the others' at 2p + 1
            key = 2 * par + rank
            sums = np.bincount(key, weights=c, minlength=2 * nb)
            top, rest = sums[0::2], sums[1::2]
            scale = np.empty(2 * nb)
            top_scale = scale[0::2]
            np.minimum(1.0, 1.0 / np.maximum(top, 1e-300), out=top_scale)  # tied most likely children share 1
            np.minimum(1.0, (1.0 - top * top_scale) / np.maximum(rest, 1e-300), out=scale[1::2])
            c *= scale[key]
        c *= parent_cal[par]
        return c, rank

    def level_probs(self, parent_cal: np.ndarray, parent_pp: np.ndarray, parents: np.ndarray, q: np.ndarray,
                    depth) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """:meth:`level` and :meth:`path_prob` of one draft level in one call, for the engine's own arrays:
        one compiled call (:func:`specfit.core.kernels.level_probs_kernel`, numba) doing the same floating-point
        operations in the same order, so the results are bit-identical to those two methods'. Nothing is
        checked: a depth below 1, q outside [0, 1] or a parent id >= n gives undefined results (:meth:`level`
        and :meth:`path_prob` check them), and arrays of other dtypes or layouts than below compile the
        kernel once more (about a second) or fail numba's typing (lists).

        Parameters
        ----------
        parent_cal, parent_pp : numpy.ndarray of float64, shape (n,)
            The tree's calibrated (``P̂``) and corrected path probabilities so far.
        parents : numpy.ndarray of int64, shape (m,), m >= 1
            The level's parents, ids ``< n``.
        q : numpy.ndarray of float64, shape (m,)
            Their conditional draft probabilities, already in [0, 1] (not checked).
        depth : numpy.ndarray of int64, shape (m,), or int
            The nodes' depths (>= 1); an int is every node's.

        Returns
        -------
        p_hat, pp : numpy.ndarray of float64, shape (m,)
            As :meth:`level` and :meth:`path_prob` return them.
        rank : numpy.ndarray of int64, shape (m,), or None
            The sibling-rank classes where they were computed (two rank classes, or a cap); None where
            every node's class is irrelevant (one rank class, no cap).
        """
        from specfit.core.kernels import level_probs_kernel  # numba: imported on first use, not by `import specfit`

        if not isinstance(depth, np.ndarray):
            depth = np.full(parents.shape[0], depth, dtype=np.int64)
        p_hat, pp, rank, ranked = level_probs_kernel()(*self.kernel_tables(), parent_cal, parent_pp, parents, q, depth)
        return p_hat, pp, rank if ranked else None

    def kernel_tables(self) -> tuple:
        """The calibrator's state as its kernels take it (:func:`specfit.core.kernels._level_probs`' first
        six arguments): rank classes, the flat ``alpha`` and ``beta`` tables, the q bins' edges, the
        per-depth path factors and the largest depth."""
        return self.rank_classes, self._alpha, self._beta, self.edges, self.path_factor, self.max_depth

    def path_prob(self, parent_pp, parents, cal, depth) -> np.ndarray:
        """One level's path probabilities with the per-depth path correction: ``f_d * P̂_v``, each
        parent's children scaled to sum to at most the parent's (at most one child is accepted).

        ``P̂`` multiplies conditionals learned per cell; a verify's acceptances at successive depths
        are positively correlated (an easy stretch of text is easy at every depth), so the product
        under-counts (measured on the proxy, most with the strong head). Over
        the verified nodes at depth d, ``E[Σ 1{v accepted}] = Pr[τ - 1 >= d]``; the correction

            f_d = (A_d + s) / (P_d + s)

        is the ratio of the verifies that accepted a node at depth d (``A_d``) to the verified nodes'
        summed ``P̂`` at that depth (``P_d``), shrunk to 1 by ``s`` pseudo-verifies (:meth:`observe_paths`).

        Parameters
        ----------
        parent_pp : numpy.ndarray of float64, shape (n,)
            Corrected path probabilities of the nodes already in the tree (the root's is 1).
        parents : array-like of int, shape (m,)
            The level's parents (ids into ``parent_pp``).
        cal : numpy.ndarray of float64, shape (m,)
            The level's calibrated path probabilities ``P̂`` (:meth:`level`).
        depth : array-like of int, shape (m,)
            Their depths (>= 1).

        Returns
        -------
        numpy.ndarray of float64, shape (m,)
            Non-increasing along every path, each parent's children summing to at most it.

        Raises
        ------
        SpecFitInputError
            ``parent_pp`` or ``cal`` not in [0, 1], a parent outside ``parent_pp``, a depth below 1, or
            ``cal`` and ``depth`` not of the parents' length.
        """
        top = check_probabilities(parent_pp, "parent_pp", np.size(parent_pp))
        par = np.asarray(parents, dtype=np.int64)
        if par.ndim != 1 or (par.size and (par.min() < 0 or par.max() >= top.size)):
            raise SpecFitInputError("parents", f"must be ids of parent_pp's {top.size} nodes, shape (m,)")
        cal, d = check_probabilities(cal, "cal", par.size), _depths(depth, par.size)
        if not par.size:
            return np.zeros(0)
        return self._path_prob(top, par, cal, self.path_factor[np.minimum(d, self.max_depth)], int(par.max()) + 1)

    @staticmethod
    def _path_prob(parent_pp: np.ndarray, par: np.ndarray, cal: np.ndarray, factor, nb: int) -> np.ndarray:
        """:meth:`path_prob` of a non-empty level with parents ``< nb`` and ``factor`` each node's ``f_d``."""
        pp = cal * factor
        top = parent_pp[:nb]
        sums = np.bincount(par, weights=pp, minlength=nb)
        if (sums > top).any():
            pp *= np.minimum(1.0, top / np.maximum(sums, 1e-300))[par]
        return pp

    def observe_paths(self, cal, depth, accepted: int) -> None:
        """Record one verify for the path correction (:meth:`path_prob`).

        Parameters
        ----------
        cal : array-like of float, shape (m,)
            Calibrated path probabilities ``P̂`` (:meth:`level`) of the verified draft nodes.
        depth : array-like of int, shape (m,)
            Their depths (>= 1).
        accepted : int
            Draft nodes accepted (τ - 1): depths 1..accepted held an accepted node.

        Raises
        ------
        SpecFitInputError
            ``cal`` not in [0, 1], a depth below 1, ``depth`` not of ``cal``'s length, or ``accepted``
            not an integer >= 0 (nothing is recorded then).
        """
        cal = check_probabilities(cal, "cal", np.size(cal))
        d = _depths(depth, cal.size)
        self._observe_paths(cal, d, check_nonnegative_int("accepted", accepted))

    def learn_verify(self, q: np.ndarray, depth: np.ndarray, ok: np.ndarray, rank: np.ndarray, cal: np.ndarray,
                     cal_depth: np.ndarray, accepted: int) -> None:
        """:meth:`update` ``(q, depth, ok, rank)`` then :meth:`_observe_paths` ``(cal, cal_depth, accepted)`` in one
        compiled call (:func:`specfit.core.kernels.learn_verify_kernel`), the same floats as those methods
        give: the engine's learning of one verify. Unchecked, for the engine's own arrays: ``q`` float64,
        ``depth``, ``rank`` int64 and ``ok`` bool of one length m, ``cal`` float64 in [0, 1] and ``cal_depth``
        int64 >= 1 of one length."""
        from specfit.core.kernels import learn_verify_kernel

        if not q.size and not cal.size:
            return
        trials, acc, alpha, beta, pred, path_acc, factor = learn_verify_kernel()(
            self.trials, self.accepted, self.edges, self.rank_classes, self.max_depth, self.prior_strength,
            q, depth, ok, rank, self.path_predicted, self.path_accepted, cal, cal_depth, int(accepted))
        if q.size:  # as update: nothing changes without a trial
            self.trials, self.accepted, self._alpha, self._beta = trials, acc, alpha, beta
        if cal.size:  # as _observe_paths: nothing changes without a verified draft node
            self.path_predicted, self.path_accepted, self.path_factor = pred, path_acc, factor

    def _observe_paths(self, cal: np.ndarray, depth: np.ndarray, accepted: int) -> None:
        """:meth:`observe_paths` of checked arrays (float64 ``cal`` in [0, 1], int64 depths >= 1 of its
        length): the engine's path, whose arrays come from its own levels."""
        if not depth.size:
            return
        d = np.minimum(depth, self.max_depth)
        self.path_predicted += np.bincount(d, weights=cal, minlength=self.max_depth + 1)
        self.path_accepted[1: min(int(accepted), self.max_depth) + 1] += 1.0
        if accepted > self.max_depth:  # deeper depths share the last one's counts, as the cells do
            self.path_accepted[self.max_depth] += accepted - self.max_depth
        s = self.prior_strength
        self.path_factor = (self.path_accepted + s) / (self.path_predicted + s)
        self.path_factor[0] = 1.0

    def mass_bound(self, widths) -> list[float]:
        """Upper bounds on the summed path probabilities of each depth of a draft tree built by
        :meth:`level_probs` (or :meth:`level` then :meth:`path_prob`) from the root (P = 1):

            a_j = min(a_{j-1}, f_j w_j u_j),   a_0 = 1

        with ``u_j`` the product of :meth:`max_conditional` over depths 1..j (no ``P̂`` at depth j
        exceeds it), ``f_j`` the depth's path correction and ``w_j`` the most nodes at depth j;
        ``a_{j-1}`` because one node's children's path probabilities sum to at most the node's.

        Parameters
        ----------
        widths : sequence of int
            ``w_1, w_2, ...``: the most nodes the drafter adds at each depth.

        Returns
        -------
        list of float
            ``a_1, a_2, ...``, non-increasing, in [0, 1].

        Raises
        ------
        SpecFitInputError
            A width that is not an integer >= 0.
        """
        widths = tuple(check_nonnegative_int(f"widths[{j}]", w) for j, w in enumerate(widths))
        # The AR gate asks every cycle, the tables change at most once per verify: kept for the same widths,
        # cells (refresh makes new arrays), path factors and bin edges
        memo = self.__dict__.get("_mass_memo")
        if (memo is not None and memo[0] == widths and memo[1] is self._alpha and memo[2] is self._beta
                and np.array_equal(memo[3], self.path_factor) and np.array_equal(memo[4], self.edges)):
            return list(memo[5])
        top = self._max_conditionals().tolist()  # one vector pass
        mass, a, u = [], 1.0, 1.0
        for j, w in enumerate(widths, start=1):
            u *= top[min(j, self.max_depth) - 1]
            a = min(a, w * u * float(self.path_factor[min(j, self.max_depth)]))
            mass.append(a)
        self._mass_memo = (widths, self._alpha, self._beta, self.path_factor.copy(), np.array(self.edges), tuple(mass))
        return mass

    def _max_conditionals(self) -> np.ndarray:
        """:meth:`max_conditional` of depths 1..max_depth, shape (max_depth,)."""
        upper = np.concatenate([self.edges, [1.0]])  # c grows with q inside a bin: each bin's top
        shape = (self.max_depth, -1)
        top = (self._alpha.reshape(self.trials.shape) * upper + self._beta.reshape(self.trials.shape)).reshape(shape)
        return np.minimum(1.0, top.max(axis=1))  # over every rank class and bin

    def max_conditional(self, depth: int) -> float:
        """The largest calibrated conditional acceptance any node at ``depth`` can get (q in [0, 1])."""
        return float(self._max_conditionals()[min(max(int(depth), 1), self.max_depth) - 1])

    def update(self, q, depth, accepted, rank=None) -> None:
        """Record Bernoulli trials: nodes (q, depth) whose parent was accepted, and whether each was.

        Parameters
        ----------
        q, depth : array-like, shape (m,)
        accepted : array-like of bool, shape (m,)
        rank : array-like of int, shape (m,), optional
            Their sibling-rank classes (:func:`sibling_rank`); default 0.
        """
        q = _unit(q)
        if q.size == 0:
            return
        cell = self._cell(q, depth, rank)
        size = self.trials.size  # counts per cell by bincount (cheaper than ufunc.at on a few dozen trials)
        self.trials = self.trials + np.bincount(cell, minlength=size).reshape(self.trials.shape)
        outcome = np.broadcast_to(np.asarray(accepted, dtype=np.float64), cell.shape)  # as ufunc.at broadcast it
        self.accepted = self.accepted + np.bincount(cell, weights=outcome, minlength=size).reshape(self.trials.shape)
        self.refresh()


def sibling_rank(parents, q) -> np.ndarray:
    """Each node's sibling-rank class: 0 if its q is the largest among its parent's children (ties
    included), else 1.

    Parameters
    ----------
    parents : array-like of int, shape (m,)
        One draft level's parents (all children of a node are drafted in the same level).
    q : array-like of float, shape (m,)
        Their conditional draft probabilities (clipped to [0, 1]).

    Returns
    -------
    numpy.ndarray of int64, shape (m,), values in {0, 1}
    """
    par, q = np.asarray(parents, dtype=np.int64), _unit(q)
    if not q.size:
        return np.zeros(0, dtype=np.int64)
    return _sibling_rank(par, q, int(par.max()) + 1)


def _sibling_rank(par: np.ndarray, q: np.ndarray, nb: int) -> np.ndarray:
    """:func:`sibling_rank` of a non-empty level whose parents are ``< nb``."""
    best = np.zeros(nb)  # q in [0, 1] or NaN (which propagates): as an initial -inf would
    np.maximum.at(best, par, q)
    return (q < best[par]).astype(np.int64)


def _depths(depth, n: int) -> np.ndarray:
    """Depths as int64 of shape (n,), each >= 1; else the error of the field ``depth``."""
    d = np.asarray(depth, dtype=np.int64)
    if d.shape != (n,):
        raise SpecFitInputError("depth", f"must have shape ({n},), got {d.shape}")
    if d.size and d.min() < 1:
        raise SpecFitInputError("depth", "draft nodes' depths must be >= 1 (the root is depth 0)")
    return d


def _unit(q) -> np.ndarray:
    """q as float64, clipped to [0, 1] (NaN stays NaN, as with ``np.clip``)."""
    return np.minimum(np.maximum(np.asarray(q, dtype=np.float64), 0.0), 1.0)


def verify_trials(parents, path) -> tuple[np.ndarray, np.ndarray]:
    """The Bernoulli trials of one verify (module docstring).

    Parameters
    ----------
    parents : array-like of int, shape (n,)
        Parents of the verified subtree (``parents[0] = -1``).
    path : sequence of int
        The accepted root path (node ids of the subtree, starting at the root 0).

    Returns
    -------
    nodes : numpy.ndarray of int64
        Verified draft nodes whose parent is on the accepted path.
    accepted : numpy.ndarray of bool
        Whether each is on the accepted path.
    """
    par = np.asarray(parents, dtype=np.int64)
    on = np.zeros(par.shape[0], dtype=bool)
    on[list(path)] = True
    nodes = np.flatnonzero((par >= 0) & on[np.maximum(par, 0)])
    return nodes, on[nodes]


def greedy_trials(parents, tokens, path, bonus_token: int) -> tuple[np.ndarray, np.ndarray]:
    """The Bernoulli trials of one greedy verify over the whole drafted tree (module docstring).

    Parameters
    ----------
    parents, tokens : array-like of int, shape (n,)
        The drafted tree (``parents[0] = -1``), verified or not.
    path : sequence of int
        The accepted root path as node ids of that tree (starting at the root 0).
    bonus_token : int
        The target's greedy token after the last accepted node.

    Returns
    -------
    nodes : numpy.ndarray of int64
        Every drafted child of an accepted node.
    accepted : numpy.ndarray of bool
        Whether it carries the target's greedy next token there (the first such sibling only).
    """
    par = np.asarray(parents, dtype=np.int64)
    tok = np.asarray(tokens, dtype=np.int64)
    path = [int(v) for v in path]
    nxt = np.full(par.shape[0], -1, dtype=np.int64)  # the target's next token after each accepted node
    nxt[path] = [int(tok[v]) for v in path[1:]] + [int(bonus_token)]
    nodes = np.flatnonzero((par >= 0) & (nxt[np.maximum(par, 0)] >= 0))
    ok = tok[nodes] == nxt[par[nodes]]
    # equal sibling tokens: only the first is the one verification takes (specfit.engine.verify)
    seen: set = set()
    for i in np.flatnonzero(ok).tolist():  # in node order: the first of equal siblings stays a success
        v = int(nodes[i])
        key = (int(par[v]), int(tok[v]))
        ok[i] = key not in seen
        seen.add(key)
    return nodes, ok
