"""Compiled kernels of the engine's per-level host work (numba).

A drafted cycle runs its host work between the device's forwards, a few dozen small numpy calls per draft
level. On the 2-vCPU VM this project is measured on, each such call costs several times more there than
in a loop (BENCHMARKS.md, issue 9, fifteenth round): one level's calibrated path probabilities,
:meth:`specfit.core.acceptance.AcceptanceCalibrator.level_probs`, took 65 µs (median over the levels of
a run, after 1 ms of other work) as about fifty numpy calls, and 7.5 µs as one compiled call. The kernel
performs the same floating-point operations in the same order as the numpy reference
(:meth:`~specfit.core.acceptance.AcceptanceCalibrator.level` then ``path_prob``), so the results are
bit-identical (tests/core/test_acceptance.py).

numba compiles a kernel on its first call in a process and keeps the machine code in its on-disk cache
(``__pycache__`` beside this file, or numba's user cache directory), so later processes load it in a
fraction of a second. :func:`level_probs_kernel` compiles on first use; the calibrator asks for it when it
is built, so no decoding cycle pays the compilation. This module is imported on that first use, not
by ``import specfit``.
"""

from __future__ import annotations

import functools

import numba
import numpy as np


@numba.njit(cache=True)
def _sibling_rank(par, q, nb, rank):
    """``rank[i]`` = 0 if ``q[i]`` is the largest among its siblings (ties included), else 1."""
    best = np.zeros(nb)
    for i in range(par.shape[0]):
        if q[i] > best[par[i]]:
            best[par[i]] = q[i]
    for i in range(par.shape[0]):
        rank[i] = 1 if q[i] < best[par[i]] else 0


@numba.njit(cache=True)
def _level_probs(k, alpha, beta, edges, path_factor, max_depth, parent_cal, parent_pp, par, q, depth):
    """One draft level's calibrated conditionals times the parent's ``P̂`` (``p_hat``) and the objective's
    path probabilities (``pp``), as ``AcceptanceCalibrator._level`` and ``_path_prob`` compute them.

    ``k`` rank classes (1 or 2); ``alpha``, ``beta`` the flat per-cell tables; ``edges`` the q bins'
    upper edges; ``path_factor`` (max_depth + 1,); ``parent_cal``, ``parent_pp`` (n,); ``par`` (m,) int64
    parents < n; ``q`` (m,) in [0, 1]; ``depth`` (m,) int64 >= 1. Returns ``(p_hat, pp, rank, ranked)``:
    ``rank`` holds the sibling-rank classes when ``ranked`` (two classes, or a sibling cap that binds)."""
    m = par.shape[0]
    nb = 0
    for i in range(m):
        if par[i] + 1 > nb:
            nb = par[i] + 1
    bins = edges.shape[0] + 1
    d = np.empty(m, np.int64)
    for i in range(m):
        d[i] = depth[i] if depth[i] < max_depth else max_depth
    rank = np.zeros(m, np.int64)
    ranked = False
    if k == 2:
        _sibling_rank(par, q, nb, rank)
        ranked = True
    c = np.empty(m)
    for i in range(m):
        x = q[i]
        b = 0  # np.searchsorted(edges, x, side="left"): the edges below x
        if x != x:
            b = bins - 1
        else:
            while b < bins - 1 and edges[b] < x:
                b += 1
        cell = (d[i] * k + (rank[i] - k)) * bins + b
        v = alpha[cell] * x
        v += beta[cell]
        c[i] = 1.0 if v > 1.0 else v
    sums = np.zeros(nb)
    for i in range(m):
        sums[par[i]] += c[i]
    over = False
    for j in range(nb):
        if sums[j] > 1.0:
            over = True
    if over:  # per parent: the most likely children's conditionals to at most 1, the others' to what is left
        if not ranked:
            _sibling_rank(par, q, nb, rank)
            ranked = True
        split = np.zeros(2 * nb)
        for i in range(m):
            split[2 * par[i] + rank[i]] += c[i]
        scale = np.empty(2 * nb)
        for j in range(nb):
            top, rest = split[2 * j], split[2 * j + 1]
            s = 1.0 / (top if top > 1e-300 else 1e-300)
            s = 1.0 if s > 1.0 else s
            scale[2 * j] = s
            r = (1.0 - top * s) / (rest if rest > 1e-300 else 1e-300)
            scale[2 * j + 1] = 1.0 if r > 1.0 else r
        for i in range(m):
            c[i] *= scale[2 * par[i] + rank[i]]
    for i in range(m):
        c[i] *= parent_cal[par[i]]
    pp = np.empty(m)
    for i in range(m):
        pp[i] = c[i] * path_factor[d[i]]
    sums = np.zeros(nb)
    for i in range(m):
        sums[par[i]] += pp[i]
    over = False
    for j in range(nb):
        if sums[j] > parent_pp[j]:
            over = True
    if over:  # one node's children's path probabilities to at most the node's
        for j in range(nb):
            r = parent_pp[j] / (sums[j] if sums[j] > 1e-300 else 1e-300)
            sums[j] = 1.0 if r > 1.0 else r
        for i in range(m):
            pp[i] *= sums[par[i]]
    return c, pp, rank, ranked


@functools.cache
def level_probs_kernel():
    """The compiled :func:`_level_probs`, compiled (or loaded from numba's cache) for the engine's argument
    types on the first call in a process."""
    one, ids = np.ones(1), np.zeros(1, np.int64)
    for k in (1, 2):  # the compilation is paid here, not in a decoding cycle
        _level_probs(k, np.zeros(4 * k), np.zeros(4 * k), np.array([0.5]), np.ones(3), 2, one, one, ids, one, ids + 1)
    return _level_probs
