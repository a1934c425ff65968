"""Compiled kernels of the engine's per-cycle host work (numba).

A drafted cycle runs its host work between the device's forwards, a few dozen small numpy calls per draft
level. On the 2-vCPU VM this project is measured on, each such call costs several times more there than
in a loop: one level's calibrated path probabilities,
:meth:`specfit.core.acceptance.AcceptanceCalibrator.level_probs`, are about fifty numpy calls, or one
compiled call. The kernel
performs the same floating-point operations in the same order as the numpy reference
(:meth:`~specfit.core.acceptance.AcceptanceCalibrator.level` then ``path_prob``), so the results are
bit-identical (tests/core/test_acceptance.py). The frequency predictor's top-k experts per draft node
(:meth:`specfit.models.predictors.FrequencyPredictor.predict`) are one compiled call the same way
(tests/models/test_predictors.py), and so is its recency window's update with a verify's committed
routing (``_Window.observe``: the routing's checks and the push). One calibrated draft level's host steps in
the engine (its path probabilities, the pruning test and the drafted tree's buffers, ``_draft_level``) and
one verify's acceptance learning (``AcceptanceCalibrator.learn_verify``) are one compiled call each, again operation for
operation as the numpy steps they replace (tests/engine/test_drafted.py, tests/core/test_acceptance.py).

numba compiles a kernel on its first call in a process and keeps the machine code in its on-disk cache
(``__pycache__`` beside this file, or numba's user cache directory), so later processes load it in a
fraction of a second. Each ``*_kernel()`` compiles on first use; the calibrator asks for its kernel
when it is built (the predictor and its window likewise), so no decoding cycle pays the compilation. This
module is imported on that first use, not by ``import specfit``. A call with argument types other than
the engine's (e.g. float32 or non-contiguous arrays) compiles once more, on that call.

The kernels a drafted cycle calls several times (the coverage accounting's, the frequency predictor's two,
the exact solver's three: :func:`item_words_kernel`, :func:`frequency_observe_top_k_kernel`,
:func:`frequency_predict_kernel`, :func:`specfit.solvers.exact_compiled.exact_kernel`,
:func:`~specfit.solvers.exact_compiled.exact_nodes_kernel`,
:func:`~specfit.solvers.exact_compiled.linear_prefix_kernel`) are handed out as the native entry point of
their one compiled overload (:func:`entry_point`), not as the dispatcher: a call then skips numba's type
dispatch, several µs per call on the caches a forward has just evicted. Such an entry point takes only the engine's argument types: it refuses an array
whose items have another size (TypeError), but reinterprets one of the same item size (uint64 or float64
for int64) and reads one of another dimension or layout wrongly, so its callers pass arrays of fixed
dimensions through :func:`kernel_array` (or build them C-contiguous of the right dtype). The engine's
predictor and solver kernels write their arrays into ones the caller made rather than return new ones:
after a forward, boxing a compiled call's own array costs more than making it in Python.
"""

from __future__ import annotations

import functools

import numba
import numpy as np


@numba.njit(cache=True, error_model="numpy")
def _sibling_rank(par, q, nb, rank):
    """``rank[i]`` = 0 if ``q[i]`` is the largest among its siblings (ties included), else 1."""
    best = np.zeros(nb)
    for i in range(par.shape[0]):
        if q[i] > best[par[i]]:
            best[par[i]] = q[i]
    for i in range(par.shape[0]):
        rank[i] = 1 if q[i] < best[par[i]] else 0


@numba.njit(cache=True, error_model="numpy")
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


@numba.njit(cache=True, error_model="numpy")
def _draft_level(k, alpha, beta, edges, path_factor, max_depth, parents_buf, tokens_buf, depth_buf, raw_buf, q_buf,
                 cal_buf, pp_buf, tree_ids_buf, rank_buf, n, par, tok, head_pp, threshold, first_tree_id, pp_sum):
    """One drafted level of a calibrated method appended to the engine's drafted-tree buffers, in one call:
    the numpy steps ``SpecDecoder._draft_and_select`` takes for a level, operation for operation.

    ``raw = min(head_pp, raw[parent])`` (the head's path probabilities kept non-increasing), ``q = raw /
    max(raw[parent], 1e-300)``, depth = parent's + 1, :func:`_level_probs` (``P̂`` and the objective's
    ``pp``), kept = parent priced and ``pp >= threshold`` (``specfit.solvers.stop.selectable``'s test;
    ``-inf`` keeps every node of a priced parent), then the level written at ``n:n + m`` of the buffers
    (capacity checked by the caller) and the kept nodes given priced ids ``first_tree_id, ...`` in order.

    ``par``, ``tok`` (m,) int64, parents ``< n``; ``head_pp`` (m,) float64. Returns ``(ok, kept, kept_parents,
    kept_pp, pp_sum, p_f)``: ``ok`` False (nothing written) if a head path probability is NaN or negative;
    ``kept`` the kept nodes' indices in the level, ``kept_parents`` their parents' priced ids, ``kept_pp``
    their ``pp``; ``pp_sum`` the argument plus the kept ``pp`` added in order; ``p_f`` the largest kept
    ``pp`` (0 if none)."""
    m = par.shape[0]
    raw = np.empty(m)
    q = np.empty(m)
    depth = np.empty(m, np.int64)
    for i in range(m):
        h = head_pp[i]
        if not h >= 0.0:  # NaN or negative: the drafter's contract
            return False, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), pp_sum, 0.0
        up = raw_buf[par[i]]
        r = h if h < up else up
        raw[i] = r
        q[i] = r / (up if up > 1e-300 else 1e-300)
        depth[i] = depth_buf[par[i]] + 1
    c, pp, rank, ranked = _level_probs(k, alpha, beta, edges, path_factor, max_depth, cal_buf, pp_buf, par, q, depth)
    kept = np.empty(m, np.int64)
    nk = 0
    for i in range(m):
        if tree_ids_buf[par[i]] >= 0 and pp[i] >= threshold:
            kept[nk] = i
            nk += 1
    kept = kept[:nk]
    kept_parents = np.empty(nk, np.int64)
    kept_pp = np.empty(nk)
    p_f = 0.0
    for j in range(nk):
        i = kept[j]
        kept_parents[j] = tree_ids_buf[par[i]]
        kept_pp[j] = pp[i]
        pp_sum += pp[i]
        if pp[i] > p_f:
            p_f = pp[i]
    for i in range(m):
        v = n + i
        parents_buf[v], tokens_buf[v], depth_buf[v] = par[i], tok[i], depth[i]
        rank_buf[v] = rank[i] if ranked else 0
        raw_buf[v], q_buf[v], cal_buf[v], pp_buf[v] = raw[i], q[i], c[i], pp[i]
        tree_ids_buf[v] = -1
    for j in range(nk):
        tree_ids_buf[n + kept[j]] = first_tree_id + j
    return True, kept, kept_parents, kept_pp, pp_sum, p_f


@numba.njit(cache=True, error_model="numpy")
def _learn_verify(trials, accepted, edges, k, max_depth, s, q, depth, ok, rank, path_predicted, path_accepted, cal,
                  cal_depth, n_accepted):
    """One verify taught to an :class:`~specfit.core.acceptance.AcceptanceCalibrator` in one call: its
    Bernoulli trials (``update``: ``q``, ``depth``, ``ok``, ``rank`` (m,)) and its path outcome
    (``_observe_paths``: ``cal``, ``cal_depth`` (p,), ``n_accepted`` draft nodes accepted), with
    ``refresh``, operation for operation as those numpy methods do them (counts are whole numbers, so every
    sum is exact).

    ``trials``, ``accepted`` (max_depth, k, bins); ``edges`` (bins - 1,); ``path_predicted``,
    ``path_accepted`` (max_depth + 1,). Nothing is changed in place: returns new ``(trials, accepted, alpha,
    beta, path_predicted, path_accepted, path_factor)`` (alpha and beta flat), as the methods assign new
    arrays (``mass_bound`` keys its kept answer on them)."""
    D, K, B = trials.shape
    n = trials.copy()
    a = accepted.copy()
    for i in range(q.shape[0]):
        x = q[i]
        if x == x:  # _unit: clipped to [0, 1], NaN kept (its bin is the last, as np.searchsorted's)
            x = 0.0 if x < 0.0 else (1.0 if x > 1.0 else x)
        d = depth[i]
        d = 1 if d < 1 else (max_depth if d > max_depth else d)
        r = 0
        if K == 2:
            r = rank[i]
            r = 0 if r < 0 else (K - 1 if r > K - 1 else r)
        b = 0
        if x != x:
            b = B - 1
        else:
            while b < B - 1 and edges[b] < x:
                b += 1
        n[d - 1, r, b] += 1.0
        a[d - 1, r, b] += 1.0 if ok[i] else 0.0
    sum_n = np.zeros((K, B))
    sum_a = np.zeros((K, B))
    for d in range(D):
        for r in range(K):
            for b in range(B):
                sum_n[r, b] += n[d, r, b]
                sum_a[r, b] += a[d, r, b]
    alpha = np.empty(D * K * B)
    beta = np.empty(D * K * B)
    for d in range(D):
        for r in range(K):
            for b in range(B):
                other_n = sum_n[r, b] - n[d, r, b]
                other_a = sum_a[r, b] - a[d, r, b]
                j = (d * K + r) * B + b
                alpha[j] = s * s / ((s + other_n) * (s + n[d, r, b]))
                beta[j] = (s * other_a / (s + other_n) + a[d, r, b]) / (s + n[d, r, b])
    pred = path_predicted.copy()
    acc = path_accepted.copy()
    if cal.shape[0]:
        add = np.zeros(max_depth + 1)
        for i in range(cal.shape[0]):
            d = cal_depth[i]
            add[d if d < max_depth else max_depth] += cal[i]
        for d in range(max_depth + 1):
            pred[d] += add[d]
        top = n_accepted if n_accepted < max_depth else max_depth
        for d in range(1, top + 1):
            acc[d] += 1.0
        if n_accepted > max_depth:
            acc[max_depth] += n_accepted - max_depth
    factor = np.empty(max_depth + 1)
    for d in range(max_depth + 1):
        factor[d] = (acc[d] + s) / (pred[d] + s)
    factor[0] = 1.0
    return n, a, alpha, beta, pred, acc, factor


@numba.njit(cache=True)
def _top_k_row(s, k, vals, ids):
    """The k largest of the scores ``s`` (E,), 1 <= k <= E, best first with ties to the lower id, into
    ``ids[:k]`` (``vals[:k]`` their scores): ``np.argsort(-s, kind="stable")[:k]`` for scores without NaN
    (±inf allowed). The first k are insertion-sorted; a later score enters only if it beats the k-th
    kept one (an equal score has a higher id and loses), which few of E = 128 do."""
    E = s.shape[0]
    for e in range(k):
        v, j = s[e], e
        while j > 0 and v > vals[j - 1]:  # an equal score stays after the lower id
            vals[j], ids[j] = vals[j - 1], ids[j - 1]
            j -= 1
        vals[j], ids[j] = v, e
    for e in range(k, E):
        v = s[e]
        if v > vals[k - 1]:
            j = k - 1
            while j > 0 and v > vals[j - 1]:
                vals[j], ids[j] = vals[j - 1], ids[j - 1]
                j -= 1
            vals[j], ids[j] = v, e


@numba.njit(cache=True)
def _top_k_row_nan(s, k, vals, ids):
    """:func:`_top_k_row` for scores that hold NaN, which rank after every number (as in the stable sort)."""
    E = s.shape[0]
    filled = 0  # ids[:filled] best first; a later id goes after every score it does not beat
    for e in range(E):
        v = s[e]
        if filled == k and not (v == v and (vals[k - 1] != vals[k - 1] or v > vals[k - 1])):
            continue  # beats no kept score: it does not beat the worst, so none better either
        at = filled
        for j in range(filled):
            if v == v and (vals[j] != vals[j] or v > vals[j]):  # NaN after every number
                at = j
                break
        if at >= k:
            continue
        for j in range(min(filled, k - 1), at, -1):
            vals[j] = vals[j - 1]
            ids[j] = ids[j - 1]
        vals[at] = v
        ids[at] = e
        if filled < k:
            filled += 1


@numba.njit(cache=True, error_model="numpy")
def _frequency_context(g, tiebreak, counts, slots, beta, blend, unseen, bounds):
    """The token-independent terms of ``FrequencyPredictor.scores``, written into ``blend`` and ``unseen``
    (L, E) float64: the recency blend ``beta * (counts / slots)`` (0 when ``slots`` is 0: an empty window;
    left untouched when ``beta`` is 0) and an unseen token's scores ``(g + blend) + tiebreak`` (``g +
    tiebreak`` when ``beta`` is 0). ``g``, ``tiebreak`` (L, E) float64, ``counts`` (L, E) int64 (the recency
    window's uses per expert), ``slots`` the window's token slots (tokens x k). ``bounds[0, l]`` becomes the
    layer's largest blend (0 when ``beta`` is 0), the bound :func:`_frequency_rank`'s early stop reads."""
    L, E = g.shape
    has_blend = beta != 0.0
    for l in range(L):
        top = 0.0
        for e in range(E):
            if has_blend:
                blend[l, e] = beta * (counts[l, e] / slots if slots else 0.0)
                unseen[l, e] = g[l, e] + blend[l, e]
                top = max(top, blend[l, e])
            else:
                unseen[l, e] = g[l, e]
            unseen[l, e] += tiebreak[l, e]
        bounds[0, l] = top


@numba.njit(cache=True, error_model="numpy")
def _frequency_rank(table, row_of, n, a, k, pseudo, tiebreak, blend, has_blend, unseen, tokens, out, order, bounds):
    """For each token (m,) and layer, the k experts of the largest scores, best first, ties to the lower id
    (``np.argsort(-scores, kind="stable")[..., :k]``), from the scores ``FrequencyPredictor.scores``
    computes, operation for operation: ``(table[row] / k + pseudo) / (n[row] + a) + blend + tiebreak``
    (float32 division, then float64; the blend left out unless ``has_blend``) for a token with a table row,
    ``unseen`` for one without (:func:`_frequency_context` makes ``blend`` and ``unseen``). ``table`` (rows,
    L, E) float32, ``row_of`` (V,) int64 (-1: no row), ``n`` (rows,), ``pseudo``, ``tiebreak`` (L, E)
    float64. Writes them into ``out`` (m, L, k) int64, made by the caller: a kernel that returns an array it
    made costs its boxing, whose code a forward has evicted. A
    token that appeared earlier in ``tokens`` gets that one's experts, copied.

    A token with a table row and ``n[row] + a > 0`` is ranked by the threshold algorithm (Fagin, Lotem and
    Naor 2003) when ``order`` has rows (:func:`frequency_order`: each row's experts by ``table[row] / k +
    pseudo``, largest first, which for a positive divisor is the order of the static part ``st = (table[row]
    / k + pseudo) / (n[row] + a)``): it visits the experts in that order and stops once ``(st + bounds[0, l])
    + bounds[1, l]`` (the layer's largest blend and tie-break; rounding is monotone, so no later expert's
    score exceeds it) is below the k-th score kept, so a later expert can neither beat nor tie it. The same
    floats are compared, ties to the lower id, so the experts are those of the full scan; on the proxy's
    table about a tenth of the experts are visited. Every other row of scores (no table row, no ``order``,
    a divisor of 0) is scanned whole: :func:`_top_k_row`, or :func:`_top_k_row_nan` if it holds NaN."""
    m = tokens.shape[0]
    L, E = pseudo.shape
    s = np.empty(E)
    vals = np.empty(k)
    ids = np.empty(k, np.int64)
    kf = np.float32(k)
    threshold = order.shape[0] > 0
    for i in range(m):
        t = tokens[i]
        seen = -1  # a draft tree repeats tokens across its branches (a third of the nodes on the proxy)
        for j in range(i):
            if tokens[j] == t:
                seen = j
                break
        if seen >= 0:  # the same scores: the same experts
            for l in range(L):
                for j in range(k):
                    out[i, l, j] = out[seen, l, j]
            continue
        r = row_of[t] if 0 <= t < row_of.shape[0] else -1
        den = n[r] + a if r >= 0 else 0.0
        for l in range(L):
            if r >= 0 and threshold and den > 0.0:
                _threshold_top_k(table, r, l, kf, pseudo, den, tiebreak, blend, has_blend, order,
                                 bounds[0, l] if has_blend else 0.0, bounds[1, l], k, vals, ids)
            else:
                if r >= 0:
                    for e in range(E):
                        v = np.float64(table[r, l, e] / kf) + pseudo[l, e]
                        v /= den
                        if has_blend:
                            v += blend[l, e]
                        v += tiebreak[l, e]
                        s[e] = v
                else:
                    for e in range(E):
                        s[e] = unseen[l, e]
                nan = False
                for e in range(E):
                    nan |= s[e] != s[e]
                if nan:
                    _top_k_row_nan(s, k, vals, ids)
                else:
                    _top_k_row(s, k, vals, ids)
            for j in range(k):
                out[i, l, j] = ids[j]


@numba.njit(cache=True, error_model="numpy")
def _threshold_top_k(table, r, l, kf, pseudo, den, tiebreak, blend, has_blend, order, blend_max, tie_max, k, vals,
                     ids):
    """:func:`_frequency_rank`'s threshold algorithm for table row ``r``, layer ``l`` (divisor ``den`` > 0):
    the k best experts into ``ids[:k]`` (``vals[:k]`` their scores), best first, ties to the lower id."""
    filled = 0
    for q in range(order.shape[2]):
        e = np.int64(order[r, l, q])
        st = (np.float64(table[r, l, e] / kf) + pseudo[l, e]) / den
        if filled == k and (st + blend_max) + tie_max < vals[k - 1]:
            break  # every later expert scores at most this bound: below the k-th kept
        v = st
        if has_blend:
            v += blend[l, e]
        v += tiebreak[l, e]
        if filled < k:
            j = filled
            filled += 1
        elif v > vals[k - 1] or (v == vals[k - 1] and e < ids[k - 1]):
            j = k - 1
        else:
            continue
        while j > 0 and (v > vals[j - 1] or (v == vals[j - 1] and e < ids[j - 1])):
            vals[j], ids[j] = vals[j - 1], ids[j - 1]
            j -= 1
        vals[j], ids[j] = v, e


def frequency_order(table: np.ndarray, pseudo: np.ndarray, k: int) -> np.ndarray:
    """The experts of each table row and layer by ``table / k + pseudo`` (the float32 division, then float64,
    as :func:`_frequency_rank` computes it), largest first: (rows, L, E) uint8, the order its threshold
    algorithm visits them in; a (0, L, E) array (the full scan) when E > 256 (ids do not fit a uint8) or
    the table or ``pseudo`` holds a value that is not finite (the order would not bound the scores).
    ``table`` (rows, L, E) float32 counts, ``pseudo`` (L, E) float64, ``k`` the experts per token. Raises
    nothing. Source: the sorted access of the threshold algorithm (R. Fagin, A. Lotem, M. Naor, "Optimal
    aggregation algorithms for middleware", J. Comput. Syst. Sci. 66(4), 2003)."""
    rows, L, E = table.shape
    if E > 256 or not (np.isfinite(table).all() and np.isfinite(pseudo).all()):
        return np.zeros((0, L, E), np.uint8)
    order = np.empty((rows, L, E), np.uint8)
    for lo in range(0, rows, 4096):  # a float64 key and int64 ids per chunk of rows, not per table
        key = (table[lo:lo + 4096] / np.float32(k)).astype(np.float64)
        key += pseudo
        order[lo:lo + 4096] = np.argsort(-key, axis=2, kind="stable")
    return order


@numba.njit(cache=True, error_model="numpy")
def _frequency_predict(table, row_of, n, a, k, terms, counts, slots, beta, fresh, tokens, out, order, bounds):
    """``FrequencyPredictor.predict`` in one call: checks that every token id is >= 0, then, unless ``fresh``
    (``blend`` and ``unseen`` already hold this window's context, :func:`_frequency_context`), makes the
    context in place, and ranks (:func:`_frequency_rank`) into ``out`` (m, L, k) int64. Returns the error: 0,
    or 4 (a negative token: nothing is changed). ``terms`` (5, L, E) float64 holds ``pseudo``, ``g``,
    ``tiebreak``, ``blend`` and ``unseen`` (one argument for five: each array argument of a compiled call costs
    its unboxing on the caches a forward has evicted)."""
    for i in range(tokens.shape[0]):
        if tokens[i] < 0:
            return 4
    pseudo, g, tiebreak, blend, unseen = terms[0], terms[1], terms[2], terms[3], terms[4]
    if not fresh:
        _frequency_context(g, tiebreak, counts, slots, beta, blend, unseen, bounds)
    _frequency_rank(table, row_of, n, a, k, pseudo, tiebreak, blend, beta != 0.0, unseen, tokens, out, order, bounds)
    return 0


@numba.njit(cache=True, error_model="numpy")
def _window_push(counts, last, ring, size, head, step, routing, num_experts):
    """Push routing rows (T, L, k) into a recency window (``_Window`` of :mod:`specfit.models.predictors`):
    ``last[l, e]`` the step of the expert's last use, ``counts[l, e]`` its uses over the ring's rows
    (``ring`` (W, L, k), ``size`` rows from ``head``, oldest first). Checks every id first and changes
    nothing unless all lie in ``[0, num_experts)`` and each (token, layer) row is distinct. Returns
    ``(size, head, step, error)``: error 0, 1 (an id out of range) or 2 (a repeated id)."""
    T, L, k = routing.shape
    for t in range(T):
        for l in range(L):
            for j in range(k):
                e = routing[t, l, j]
                if e < 0 or e >= num_experts:
                    return size, head, step, 1
                for i in range(j):
                    if routing[t, l, i] == e:
                        return size, head, step, 2
    W = ring.shape[0]
    for t in range(T):
        if size == W:  # the oldest row leaves the window
            for l in range(L):
                for j in range(k):
                    counts[l, ring[head, l, j]] -= 1
            head = (head + 1) % W
            size -= 1
        at = (head + size) % W
        for l in range(L):
            for j in range(k):
                e = routing[t, l, j]
                last[l, e] = step
                counts[l, e] += 1
                ring[at, l, j] = e
        size += 1
        step += 1
    return size, head, step, 0


@numba.njit(cache=True, error_model="numpy")
def _frequency_observe_top_k(counts, last, ring, size, head, step, routing, num_experts, observed, table, row_of, n, a,
                             k, terms, beta, tokens, out, order, bounds):
    """``FrequencyPredictor.observe_and_predict``: :func:`_window_push` of the committed tokens' routing
    (``observed`` (T,) their ids, ``routing`` (T, L, k)), then the window's new context into ``blend`` and
    ``unseen`` (:func:`_frequency_context`) and :func:`_frequency_rank` of ``tokens`` (m,) into ``out`` (m, L,
    k) int64, in one call. Checks first and changes nothing unless the routing has the window's (L, k) and one
    row per observed token, every token id (both arrays) is >= 0 and the routing passes the push's checks.
    Returns ``(size, head, step, error)``: error 0, 5 (the routing's (L, k) is not the window's), 6 (not one
    observed token per routing row), 3 (a negative observed token), 4 (a negative token to predict), 1 or 2
    (the push's: an id out of range, a repeated id); on an error ``out`` is left as it was. ``terms`` as in
    :func:`_frequency_predict`."""
    if routing.shape[1] != counts.shape[0] or routing.shape[2] != ring.shape[2]:
        return size, head, step, 5
    if observed.shape[0] != routing.shape[0]:
        return size, head, step, 6
    for i in range(observed.shape[0]):
        if observed[i] < 0:
            return size, head, step, 3
    for i in range(tokens.shape[0]):
        if tokens[i] < 0:
            return size, head, step, 4
    size, head, step, error = _window_push(counts, last, ring, size, head, step, routing, num_experts)
    if error:
        return size, head, step, error
    pseudo, g, tiebreak, blend, unseen = terms[0], terms[1], terms[2], terms[3], terms[4]
    _frequency_context(g, tiebreak, counts, size * routing.shape[2], beta, blend, unseen, bounds)
    _frequency_rank(table, row_of, n, a, k, pseudo, tiebreak, blend, beta != 0.0, unseen, tokens, out, order, bounds)
    return size, head, step, 0


@numba.njit(cache=True, error_model="numpy")
def _ratio_bound(path_prob, root_ms, min_node_ms):
    """:func:`specfit.solvers.stop.ratio_upper_bound` of checked arguments (``path_prob`` (m,) float64 in
    [0, 1], ``root_ms`` > 0) as one compiled call, the numpy formula's float bit for bit: the
    probabilities sorted largest first (an insertion sort: m is a draft tree's size), their sums taken in
    that order (as ``np.cumsum``), ``max(1 / root_ms, max_k (1 + P_(1) + ... + P_(k)) / (root_ms + k
    min_node_ms))`` times 1000."""
    m = path_prob.shape[0]
    p = path_prob.copy()
    for i in range(1, m):
        v = p[i]
        j = i
        while j > 0 and p[j - 1] < v:
            p[j] = p[j - 1]
            j -= 1
        p[j] = v
    best = 1.0 / root_ms
    c = 0.0
    for i in range(m):
        c += p[i]
        r = (1.0 + c) / (root_ms + min_node_ms * (i + 1))
        if r > best:
            best = r
    return 1000.0 * best


def entry_point(kernel, *args):
    """Call ``kernel`` (a numba dispatcher) on ``args``, compiling or loading it for their types, and return
    the native entry point of that overload (numba's ``Dispatcher.overloads[types].entry_point``): the same
    function and results, without the per-call type dispatch (each argument's ``typeof``, the overload
    lookup). The dispatcher itself if this numba keeps no such entry point.

    Parameters
    ----------
    kernel : numba dispatcher (or any callable)
        A ``numba.njit`` function.
    *args
        Example arguments of the types every later call passes (arrays of fixed dtype, dimensions and C
        layout, as :func:`kernel_array` makes them; Python ints and floats).

    Returns
    -------
    callable
        The entry point: ``kernel``'s results for arguments of those types; ``kernel`` itself when it has no
        ``overloads`` entry for them (not a numba dispatcher, or a numba without it).

    Raises
    ------
    Whatever ``kernel(*args)`` raises. The entry point unboxes each later argument as the overload's type:
    an array whose items have another size raises TypeError, but one of another dtype of the same item
    size (uint64 or float64 for int64) is reinterpreted, and one of another number of dimensions, or not
    C-contiguous, is read wrongly.

    References
    ----------
    numba, ``Dispatcher.overloads`` (compile results by argument types) and ``CompileResult.entry_point``.
    """
    kernel(*args)
    overload = getattr(kernel, "overloads", {}).get(tuple(numba.typeof(a) for a in args))
    return getattr(overload, "entry_point", kernel)


def kernel_array(a, dtype) -> np.ndarray:
    """``a`` as a writable C-contiguous array of ``dtype``: itself when it is one, else a copy. Every kernel
    is compiled for such arrays; another layout or a read-only array would compile it again, on that call."""
    if type(a) is np.ndarray and a.dtype == dtype:  # the engine's every solve and prediction: no conversion
        flags = a.flags
        if flags.c_contiguous and flags.writeable:
            return a
    return np.array(a, dtype=dtype, order="C")


@numba.njit(cache=True)
def _item_words(experts, cache, parents, start, need, above, own, words, rows):
    """For ``ItemSets.extend``: fill rows ``start + i`` (i < m) of the item words and rows per layer.

    ``experts`` (m, L, k) int64 and ``cache`` (L, E) bool; ``parents`` (m,) int64, each an earlier node
    (< start + i) or -1 (the root); ``need``, ``above``, ``own`` (capacity, W) uint64 with item ``l * E + e``
    as bit ``(l * E + e) % 64`` of word ``(l * E + e) // 64``; ``rows`` (capacity, L) int64. Node v's need
    bits are the items ``l * E + e`` with e among its experts of layer l and ``not cache[l, e]`` (a repeated
    id once: ``np.packbits`` of ``ItemSets.need_mask``); ``rows[v, l]`` their count in layer l;
    ``above[v] = above[p] | need[p]`` (0 for the root); ``own[v] = need[v] & ~above[v]`` (0 for the root);
    ``words[v]`` the compiled solver's row: ``own[v]``, the root's ``need[0]``.
    Returns ``(status, uncached)``: status 0, or 1 if an expert id lies outside [0, E), 2 if a parent is not
    an earlier node (rows from ``start`` on are then partly written: the caller does not count them);
    ``uncached`` True iff a new node needs an item (False on an error)."""
    m, L, k = experts.shape
    E = cache.shape[1]
    W = need.shape[1]
    one = np.uint64(1)
    uncached = False
    for i in range(m):
        v = start + i
        p = parents[i]
        if p >= v or p < -1 or (p == -1) != (v == 0):
            return 2, False
        for w in range(W):
            need[v, w] = 0
        for l in range(L):
            rows[v, l] = 0
            for j in range(k):
                e = experts[i, l, j]
                if e < 0 or e >= E:
                    return 1, False
                if not cache[l, e]:
                    uncached = True
                    b = l * E + e
                    bit = one << np.uint64(b & 63)
                    if not need[v, b >> 6] & bit:  # a repeated id counts once, as in the mask
                        need[v, b >> 6] |= bit
                        rows[v, l] += 1
        for w in range(W):
            if p < 0:
                above[v, w] = 0
                own[v, w] = 0
                words[v, w] = need[v, w]
            else:
                a = above[p, w] | need[p, w]
                above[v, w] = a
                own[v, w] = need[v, w] & ~a
                words[v, w] = own[v, w]
    return 0, uncached


@functools.cache
def item_words_kernel():
    """The compiled :func:`_item_words` (its :func:`entry_point`; arguments, shapes and return value as
    there), compiled or loaded from numba's cache on the first call in a process."""
    w = np.zeros((1, 1), np.uint64)
    return entry_point(_item_words, np.zeros((1, 1, 1), np.int64), np.zeros((1, 1), np.bool_),
                       np.full(1, -1, np.int64), 0, w, w.copy(), w.copy(), w.copy(), np.zeros((1, 1), np.int64))


@functools.cache
def window_push_kernel():
    """The compiled :func:`_window_push` (a numba dispatcher; arguments, shapes and return value as there),
    compiled or loaded from numba's cache on the first call in a process."""
    le = np.zeros((1, 1), np.int64)
    _window_push(le, le.copy(), np.zeros((1, 1, 1), np.int64), 0, 0, 0, np.zeros((1, 1, 1), np.int64), 1)
    return _window_push


@functools.cache
def frequency_observe_top_k_kernel():
    """The compiled :func:`_frequency_observe_top_k` (its :func:`entry_point`; arguments, shapes and return
    value as there), compiled or loaded from numba's cache for the predictor's argument types on the first
    call in a process."""
    table, ids = np.zeros((1, 1, 2), np.float32), np.zeros(1, np.int64)
    c = np.zeros((1, 2), np.int64)
    return entry_point(_frequency_observe_top_k, c, c.copy(), np.zeros((1, 1, 1), np.int64), 0, 0, 0,
                       np.zeros((1, 1, 1), np.int64), 2, ids, table, ids, np.ones(1), 1.0, 1, np.zeros((5, 1, 2)), 0.5,
                       ids, np.zeros((1, 1, 1), np.int64), np.zeros((1, 1, 2), np.uint8), np.zeros((2, 1)))


@functools.cache
def frequency_predict_kernel():
    """The compiled :func:`_frequency_predict` (its :func:`entry_point`; arguments, shapes and return value
    as there), compiled or loaded from numba's cache for the predictor's argument types on the first call in
    a process."""
    table = np.zeros((1, 1, 2), np.float32)
    for fresh in (False, True):
        kernel = entry_point(_frequency_predict, table, np.zeros(1, np.int64), np.ones(1), 1.0, 1, np.zeros((5, 1, 2)),
                             np.zeros((1, 2), np.int64), 0, 0.5, fresh, np.zeros(1, np.int64),
                             np.zeros((1, 1, 1), np.int64), np.zeros((1, 1, 2), np.uint8), np.zeros((2, 1)))
    return kernel


@functools.cache
def ratio_bound_kernel():
    """The compiled :func:`_ratio_bound` (a numba dispatcher), compiled or loaded from numba's cache on the
    first call in a process."""
    _ratio_bound(np.array([0.5, 0.25]), 1.0, 0.1)
    return _ratio_bound


@functools.cache
def level_probs_kernel():
    """The compiled :func:`_level_probs` (a numba dispatcher; arguments, shapes and return value as there),
    compiled or loaded from numba's cache for the engine's argument types on the first call in a process."""
    one, ids = np.ones(1), np.zeros(1, np.int64)
    for k in (1, 2):  # the compilation is paid here, not in a decoding cycle
        _level_probs(k, np.zeros(4 * k), np.zeros(4 * k), np.array([0.5]), np.ones(3), 2, one, one, ids, one, ids + 1)
    return _level_probs


@functools.cache
def draft_level_kernel():
    """The compiled :func:`_draft_level` (a numba dispatcher; arguments, shapes and return value as there),
    compiled or loaded from numba's cache for the engine's argument types on the first call in a process."""
    f, i = np.ones(3), np.zeros(3, np.int64)
    for k in (1, 2):  # the compilation is paid here, not in a decoding cycle
        _draft_level(k, np.zeros(4 * k), np.zeros(4 * k), np.array([0.5]), np.ones(3), 2, i, i.copy(), i.copy(),
                     f, f.copy(), f.copy(), f.copy(), i.copy(), i.copy(), 1, np.zeros(1, np.int64),
                     np.zeros(1, np.int64), np.ones(1), 0.0, 1, 0.0)
    return _draft_level


@functools.cache
def learn_verify_kernel():
    """The compiled :func:`_learn_verify` (a numba dispatcher; arguments, shapes and return value as there),
    compiled or loaded from numba's cache for the engine's argument types on the first call in a process."""
    t, f, i = np.zeros((2, 1, 2)), np.ones(1), np.ones(1, np.int64)
    _learn_verify(t, t.copy(), np.array([0.5]), 1, 2, 4.0, f, i, np.ones(1, np.bool_), i, np.zeros(3), np.zeros(3),
                  f, i, 1)
    return _learn_verify
