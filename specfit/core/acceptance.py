"""Calibrated acceptance: draft probabilities mapped to acceptance probabilities learned from verifies.

A draft tree's path probability ``P_v`` (the product of the draft's conditional probabilities q
along the root → v path) is EAGLE-2's stand-in for ``Pr[v accepted]`` (Li et al. 2024, §3). Measured
on the shipped proxy it is not calibrated (issue 9: A(S) = 2.84 predicted against 4.87 committed).
:class:`AcceptanceCalibrator` learns the *conditional* acceptance ``Pr[v accepted | parent accepted]``
per (depth, confidence bin of q) online:

    c(q, d) = (s * q + a[d, b]) / (s + n[d, b])        b = bin of q,  d = min(depth, max_depth)

a Beta-binomial posterior mean whose prior is ``Beta(s q, s (1 - q))`` (centred on the draft's own
q, worth ``s`` pseudo-trials), updated by ``n`` trials of which ``a`` were accepted. The calibrated
path probability is the product along the path, ``P̂_v = P̂_parent(v) * c(q_v, depth_v)``; since every
c <= 1, P̂ is non-increasing along every path (what the solvers and the stop rule rely on). Siblings
are mutually exclusive (at most one child of a node is accepted, greedy or sampling verification), so
the calibrated conditionals of one node's children are scaled down to sum to at most 1.

Trials (SPECFIT.md §3, "Calibrated acceptance"): after a verify, every verified draft node whose
parent lies on the accepted path is one Bernoulli trial, a success iff the node is on it
(:func:`verify_trials`). Under greedy verification the target's next token after every accepted node
is known (the next accepted token, or the bonus token), so every *drafted* child of an accepted node,
verified or not, is a trial, a success iff it carries that token (:func:`greedy_trials`): a selection
that verifies few nodes still learns how often the nodes it left out would have been accepted.
"""

from __future__ import annotations

import numpy as np

from specfit.core.errors import SpecFitInputError, check_positive_int

#: Default upper edges of the confidence bins of q (the last bin ends at 1).
DEFAULT_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


class AcceptanceCalibrator:
    """Online Beta-binomial calibration of conditional acceptance per depth × confidence bin.

    Parameters
    ----------
    max_depth : int
        Depths beyond it share the last depth's counts.
    prior_strength : float
        ``s``, pseudo-trials of the prior centred on the draft's own q (> 0).
    edges : sequence of float
        Increasing upper edges of the q bins in (0, 1).

    Raises
    ------
    SpecFitInputError
        On a non-positive ``max_depth`` or ``prior_strength`` or bad edges.
    """

    def __init__(self, max_depth: int = 8, prior_strength: float = 4.0, edges=DEFAULT_EDGES):
        check_positive_int("max_depth", max_depth)
        if not (prior_strength > 0 and np.isfinite(prior_strength)):
            raise SpecFitInputError("prior_strength", f"must be a finite number > 0, got {prior_strength!r}")
        e = np.asarray(edges, dtype=np.float64)
        if e.ndim != 1 or np.any(np.diff(e) <= 0) or (e.size and (e[0] <= 0 or e[-1] >= 1)):
            raise SpecFitInputError("edges", "must be increasing numbers in (0, 1)")
        self.max_depth, self.prior_strength, self.edges = int(max_depth), float(prior_strength), e
        self.trials = np.zeros((self.max_depth, e.size + 1))
        self.accepted = np.zeros((self.max_depth, e.size + 1))

    def _cell(self, q: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """Flat index ``d * bins + b`` of each node's (depth, q bin) cell in :attr:`trials` (q clipped)."""
        d = np.minimum(np.maximum(np.asarray(depth, dtype=np.int64), 1), self.max_depth) - 1
        return d * self.trials.shape[1] + np.searchsorted(self.edges, q, side="left")

    def conditional(self, q, depth) -> np.ndarray:
        """Calibrated ``Pr[accepted | parent accepted]`` of nodes with draft probability q at a depth.

        Parameters
        ----------
        q : array-like of float, shape (m,)
            The nodes' conditional draft probabilities, in [0, 1].
        depth : array-like of int, shape (m,)
            Their depths (root 0, so >= 1 for draft nodes).

        Returns
        -------
        numpy.ndarray of float64, shape (m,), values in [0, 1]
        """
        q = _unit(q)
        cell = self._cell(q, depth)
        s = self.prior_strength
        return (s * q + self.accepted.ravel()[cell]) / (s + self.trials.ravel()[cell])

    def level_path_prob(self, parent_cal, parents, q, depth) -> np.ndarray:
        """Calibrated path probabilities of one draft level, ``P̂_parent * c`` (module docstring).

        Parameters
        ----------
        parent_cal : numpy.ndarray of float64, shape (n,)
            Calibrated path probabilities of the nodes already in the tree.
        parents : array-like of int, shape (m,)
            The new nodes' parents (ids into ``parent_cal``).
        q, depth : array-like, shape (m,)
            The new nodes' conditional draft probabilities and depths.

        Returns
        -------
        numpy.ndarray of float64, shape (m,)
            Each at most its parent's; each parent's children's conditionals sum to at most 1.
        """
        par = np.asarray(parents, dtype=np.int64)
        c = self.conditional(q, depth)
        total = np.bincount(par, weights=c, minlength=len(parent_cal))  # each parent's children's sum
        if (total > 1.0).any():  # else every scale is 1 and c * 1 = c
            c = c * np.where(total > 1.0, 1.0 / np.maximum(total, 1e-300), 1.0)[par]
        return np.asarray(parent_cal)[par] * np.minimum(c, 1.0)

    def max_conditional(self, depth: int) -> float:
        """The largest calibrated conditional acceptance any node at ``depth`` can get (q in [0, 1])."""
        d = min(max(int(depth), 1), self.max_depth) - 1
        s = self.prior_strength
        upper = np.concatenate([self.edges, [1.0]])  # c grows with q inside a bin: take each bin's top
        return float(min(1.0, np.max((s * upper + self.accepted[d]) / (s + self.trials[d]))))

    def update(self, q, depth, accepted) -> None:
        """Record Bernoulli trials: nodes (q, depth) whose parent was accepted, and whether each was.

        Parameters
        ----------
        q, depth : array-like, shape (m,)
        accepted : array-like of bool, shape (m,)
        """
        q = _unit(q)
        if q.size == 0:
            return
        cell = self._cell(q, depth)
        # 1-D add.at (numpy's fast path) into ravel() views: contiguous tables (no copy when they already are)
        self.trials, self.accepted = np.ascontiguousarray(self.trials), np.ascontiguousarray(self.accepted)
        np.add.at(self.trials.ravel(), cell, 1.0)
        np.add.at(self.accepted.ravel(), cell, np.asarray(accepted, dtype=np.float64))


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
    for i, v in enumerate(nodes.tolist()):
        if ok[i]:
            key = (int(par[v]), int(tok[v]))
            ok[i] = key not in seen
            seen.add(key)
    return nodes, ok
