"""The exact solver's unbudgeted transfer-regime path as one compiled call (numba).

The engine solves one selection per stop-rule check, one to two per drafted cycle, each a small
instance (tens of nodes) without budgets in the transfer regime. In Python the solve is spread over a
few hundred interpreter-level steps (the coverage pricing, the best-prefix scan that starts
Dinkelbach, one maximum closure per Dinkelbach step with its tree DP, shared-item accounting and
Dinic's minimum cut, the final evaluation); on the 2-vCPU VM this project is measured on it takes
a large share of the solver + predictor host time of a drafted cycle. :func:`select_unbudgeted` runs the same algorithm
(:mod:`specfit.solvers.exact`, whose module docstring proves it) as one compiled call over the items
as ``uint64`` words, so it is exact for the same reasons.

Differences from the Python path, none of which changes the optimum:

* the items shared by two or more live nodes each get their own vertex in the minimum-cut graph
  (the Python path merges items with the same live owners into one vertex): both graphs have the
  same minimum cuts over the nodes, and the source side read from the residual graph is the unique
  smallest maximiser of F_λ in both (Picard 1976);
* sums of item costs are taken per item rather than per owner group, so selections can differ from
  the Python path's only where two of them tie to within float round-off (each is then optimal to
  round-off; a newcomer's fuzzing found about 1 such instance in 20,000 generated ratio-mode ones).

tests/solvers/test_exact_compiled.py checks it against the Python path (the same nodes and floats, or
a tie to round-off) and brute force on generated instances; tests/solvers/test_solvers.py checks the
default, compiled, solver against CP-SAT and brute force. The kernels avoid numpy array expressions and
numba's argsort, which multiply the compile time (first use in a fresh checkout: 5.5 s for both kernels
on this project's 2-vCPU VM, 7–13 s on a slower one; :func:`_select_nodes`, the engine's, adds its own; the
project's kernels then load from numba's disk cache in 0.5–2 s).

References
----------
W. Dinkelbach (1967); J.-C. Picard (1976); E. A. Dinic (1970), as in :mod:`specfit.solvers.exact`.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from specfit.core.kernels import entry_point, kernel_array

_INF = np.inf


@numba.njit(cache=True, error_model="numpy")
def _popcount(x):
    """Set bits of a uint64 (SWAR; LLVM emits popcnt where the CPU has it)."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


@numba.njit(cache=True, error_model="numpy")
def _per_layer(bits, seg_word, seg_mask, seg_layer, counts):
    """``counts[l]`` = items of the word row ``bits`` in layer l (segments: word, mask, layer)."""
    for l in range(counts.shape[0]):
        counts[l] = 0
    for s in range(seg_word.shape[0]):
        counts[seg_layer[s]] += _popcount(bits[seg_word[s]] & seg_mask[s])


@numba.njit(cache=True, error_model="numpy")
def _bits_ms(bits, uniform_ms, layer_ms, seg_word, seg_mask, seg_layer, counts):
    """Transfer ms of the items in ``bits``: as :meth:`specfit.core.coverage.Coverage.bits_ms`."""
    if uniform_ms >= 0.0:
        c = 0
        for w in range(bits.shape[0]):
            c += _popcount(bits[w])
        return uniform_ms * c if c else 0.0
    _per_layer(bits, seg_word, seg_mask, seg_layer, counts)
    total = 0.0
    for l in range(layer_ms.shape[0]):
        total += layer_ms[l] * counts[l]
    return total


@numba.njit(cache=True, error_model="numpy")
def _value(sel, pp, own, base_ms, per_node_ms, uniform_ms, layer_ms, seg_word, seg_mask, seg_layer, counts):
    """``(A, T)`` of the selection mask ``sel``: as ``Coverage.value`` over its ascending node ids."""
    W = own.shape[1]
    bits = np.zeros(W, np.uint64)
    a, count = 1.0, 0
    for v in range(1, sel.shape[0]):
        if sel[v]:
            a += pp[v]
            for w in range(W):
                bits[w] |= own[v, w]
            count += 1
    return a, base_ms + per_node_ms * count + _bits_ms(bits, uniform_ms, layer_ms, seg_word, seg_mask, seg_layer,
                                                       counts)


@numba.njit(cache=True, error_model="numpy")
def _min_cut_source_side(nv, eu, ev, ecap, eps):
    """Dinic's algorithm on edges ``(eu[i], ev[i], ecap[i])`` from source 0 to sink 1; the source side
    of a minimum cut (residual-reachable vertices), as :func:`specfit.solvers.exact.min_cut_source_side`
    (one augmenting path per search, adjacency in insertion order)."""
    m = eu.shape[0]
    to = np.empty(2 * m, np.int64)
    cap = np.empty(2 * m)
    deg = np.zeros(nv + 1, np.int64)
    for i in range(m):
        to[2 * i], cap[2 * i] = ev[i], ecap[i]
        to[2 * i + 1], cap[2 * i + 1] = eu[i], 0.0
        deg[eu[i] + 1] += 1
        deg[ev[i] + 1] += 1
    for u in range(nv):
        deg[u + 1] += deg[u]
    adj = np.empty(2 * m, np.int64)
    fill = np.empty(nv, np.int64)
    for u in range(nv):
        fill[u] = deg[u]
    for e in range(2 * m):  # edge e leaves to[e ^ 1]; ids in insertion order per vertex
        u = to[e ^ 1]
        adj[fill[u]] = e
        fill[u] += 1
    level = np.empty(nv, np.int64)
    queue = np.empty(nv, np.int64)
    nxt = np.empty(nv, np.int64)
    path = np.empty(nv, np.int64)
    while True:
        for u in range(nv):
            level[u] = -1
        level[0] = 0
        queue[0], qn = 0, 1
        qi = 0
        while qi < qn:
            u = queue[qi]
            qi += 1
            for k in range(deg[u], deg[u + 1]):
                e = adj[k]
                w = to[e]
                if level[w] < 0 and cap[e] > eps:
                    level[w] = level[u] + 1
                    queue[qn] = w
                    qn += 1
        if level[1] < 0:
            side = np.zeros(nv, np.bool_)
            for u in range(nv):
                side[u] = level[u] >= 0
            return side
        for u in range(nv):
            nxt[u] = deg[u]
        while True:  # one augmenting path per search, as the recursive push
            depth, u, d = 0, 0, 0.0
            while True:
                if u == 1:
                    d = _INF
                    for i in range(depth):
                        if cap[path[i]] < d:
                            d = cap[path[i]]
                    for i in range(depth):
                        cap[path[i]] -= d
                        cap[path[i] ^ 1] += d
                    break
                advanced = False
                while nxt[u] < deg[u + 1]:
                    e = adj[nxt[u]]
                    w = to[e]
                    if cap[e] > eps and level[w] == level[u] + 1:
                        path[depth] = e
                        depth += 1
                        u = w
                        advanced = True
                        break
                    nxt[u] += 1
                if not advanced:
                    if depth == 0:
                        d = 0.0
                        break
                    depth -= 1
                    u = to[path[depth] ^ 1]
                    nxt[u] += 1
            if not d > eps:
                break


@numba.njit(cache=True, error_model="numpy")
def _max_closure(lam, parents, pp, own, shared, per_node_ms, excl_ms, uniform_ms, layer_ms, seg_word, seg_mask,
                 seg_layer, num_experts, counts, cptr, cidx):
    """Selection mask maximising ``A - lam T`` without budgets: as :func:`specfit.solvers.exact.max_closure`."""
    n, W = pp.shape[0], own.shape[1]
    c = per_node_ms
    base = np.empty(n)
    live = np.zeros(n, np.bool_)
    for v in range(n):
        base[v] = pp[v] - lam * (c + excl_ms[v])
        live[v] = v == 0 or pp[v] > lam * c
    weight = np.empty(n)
    for v in range(n):
        weight[v] = base[v]
    fits = False
    dp = np.zeros(n)
    once = np.zeros(W, np.uint64)
    twice = np.zeros(W, np.uint64)
    row = np.zeros(W, np.uint64)
    while True:  # drop subtrees that cannot add value; fold items left with one live owner
        for v in range(n):
            dp[v] = 0.0
        for v in range(n - 1, 0, -1):
            if live[v]:
                s = weight[v]
                for k in range(cptr[v], cptr[v + 1]):
                    s += dp[cidx[k]]
                dp[v] = s if s > 0.0 else 0.0
        pruned = False
        for v in range(1, n):
            if live[v] and not (live[parents[v]] and dp[v] > 0.0):
                live[v] = False
                pruned = True
        if fits and not pruned:
            break
        any_live = False
        for v in range(1, n):
            any_live = any_live or live[v]
        if not any_live:
            out = np.zeros(n, np.bool_)
            out[0] = True
            return out
        for w in range(W):
            once[w] = 0
            twice[w] = 0
        for v in range(1, n):
            if live[v]:
                for w in range(W):
                    r = own[v, w] & shared[w]
                    twice[w] |= once[w] & r
                    once[w] |= r
        for v in range(n):
            weight[v] = base[v]
        for v in range(1, n):
            if live[v]:
                for w in range(W):
                    row[w] = own[v, w] & shared[w] & once[w] & ~twice[w]
                weight[v] -= lam * _bits_ms(row, uniform_ms, layer_ms, seg_word, seg_mask, seg_layer, counts)
        fits = True
    has_groups = False
    for w in range(W):
        has_groups = has_groups or twice[w] != 0
    if not has_groups:  # the tree DP is exact
        return live
    # minimum cut: source 0, sink 1, live nodes 2.., then one vertex per item shared by >= 2 live owners
    vid = np.empty(n, np.int64)
    nl = 0
    for v in range(1, n):
        if live[v]:
            vid[v] = nl + 2
            nl += 1
    items = np.empty(W * 64, np.int64)
    ni = 0
    for w in range(W):
        x = twice[w]
        for b in range(64):
            if (x >> np.uint64(b)) & np.uint64(1):
                items[ni] = w * 64 + b
                ni += 1
    cap_edges = 3 * nl + ni * (nl + 1)
    eu = np.empty(cap_edges, np.int64)
    ev = np.empty(cap_edges, np.int64)
    ec = np.empty(cap_edges)
    m = 0
    for v in range(1, n):
        if not live[v]:
            continue
        i = vid[v]
        if weight[v] > 0.0:
            eu[m], ev[m], ec[m] = 0, i, weight[v]
            m += 1
        elif weight[v] < 0.0:
            eu[m], ev[m], ec[m] = i, 1, -weight[v]
            m += 1
        if parents[v]:
            eu[m], ev[m], ec[m] = i, vid[parents[v]], _INF
            m += 1
    g0 = nl + 2
    for k in range(ni):
        it = items[k]
        w, b = it // 64, np.uint64(it % 64)
        eu[m], ev[m], ec[m] = g0 + k, 1, lam * layer_ms[it // num_experts]
        m += 1
        for v in range(1, n):
            if live[v] and (own[v, w] >> b) & np.uint64(1):
                eu[m], ev[m], ec[m] = vid[v], g0 + k, _INF
                m += 1
    side = _min_cut_source_side(g0 + ni, eu[:m], ev[:m], ec[:m], 1e-12)
    out = np.zeros(n, np.bool_)
    out[0] = True
    for v in range(1, n):
        if live[v] and side[vid[v]]:
            out[v] = True
    return out


@numba.njit(cache=True, error_model="numpy")
def _path_prob_order(parents, pp):
    """Nodes by decreasing P, ties shallow-first then lower index: ``np.lexsort((ids, depth, -pp))``
    (:func:`specfit.solvers.greedy.path_prob_order`), by a stable bottom-up merge sort (numba's own
    argsort takes seconds more to compile)."""
    n = pp.shape[0]
    depth = np.zeros(n, np.int64)
    for v in range(1, n):
        depth[v] = depth[parents[v]] + 1
    order = np.arange(n)
    buf = np.empty(n, np.int64)
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            mid, hi = min(lo + width, n), min(lo + 2 * width, n)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                a, b = order[i], order[j]
                if pp[b] > pp[a] or (pp[b] == pp[a] and depth[b] < depth[a]):  # b strictly first
                    buf[k] = b
                    j += 1
                else:  # ties keep the left run's (lower-index) node first: stable
                    buf[k] = a
                    i += 1
                k += 1
            while i < mid:
                buf[k] = order[i]
                i += 1
                k += 1
            while j < hi:
                buf[k] = order[j]
                j += 1
                k += 1
        order, buf = buf, order
        width *= 2
    return order


@numba.njit(cache=True, error_model="numpy")
def _linear_prefix(parents, pp, fixed_ms, per_node_ms, k_max, lam):
    """The best prefix of the path-probability order when T is linear in |S| (at most ``k_max`` nodes;
    ``lam < 0``: maximise A/T, else A - lam T): :func:`specfit.solvers.greedy.linear_prefix`, the same floats
    in the same order (its cumulative sums are sequential), the first maximum winning. Returns ``(nodes, a,
    t)``: the node ids, increasing (int64), and the prefix's A (tokens) and T (ms) as
    :func:`specfit.core.objective.evaluate_uncovered` computes them, bit for bit (A's sum in numpy's pairwise
    order over the nodes but the root in id order, :func:`_pairwise_sum`; T = ``fixed_ms + per_node_ms |S|``)."""
    n = pp.shape[0]
    order = _path_prob_order(parents, pp)
    a, t = 0.0, fixed_ms
    best, best_len = -np.inf, 1
    for i in range(min(n, k_max)):
        a += 1.0 if i == 0 else pp[order[i]]
        t += per_node_ms
        val = a / t if lam < 0.0 else a - lam * t
        if val > best or (i == 0 and val != val):  # np.argmax: the first maximum (a NaN first wins)
            best, best_len = val, i + 1
    sel = np.zeros(n, np.bool_)
    for i in range(best_len):
        sel[order[i]] = True
    nodes, a = _nodes_and_a(sel, pp, best_len)
    return nodes, a, fixed_ms + per_node_ms * best_len


@numba.njit(cache=True, error_model="numpy")
def _nodes_and_a(sel, pp, size):
    """The ids of the ``size`` nodes of the mask ``sel`` (increasing, int64) and their A = 1 + Σ P over the
    nodes but the root, summed as numpy sums ``pp[nodes[1:]]`` (:func:`_pairwise_sum`), then added to 1.0
    as :func:`specfit.core.objective.evaluate` does."""
    nodes = np.empty(size, np.int64)
    picked = np.empty(max(size - 1, 0), np.float64)
    j = 0
    for v in range(sel.shape[0]):
        if sel[v]:
            nodes[j] = v
            if j:
                picked[j - 1] = pp[v]
            j += 1
    a = 1.0 + (0.0 + _pairwise_sum(picked, 0, size - 1)) if size > 1 else 1.0
    return nodes, a


@numba.njit(cache=True, error_model="numpy")
def _pairwise_block(a, lo, n):
    """numpy's pairwise sum of ``a[lo:lo + n]`` for n <= 128: a plain loop under 8 elements, else eight
    accumulators then the rest (:func:`_pairwise_sum`)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    r = np.empty(8)
    for j in range(8):
        r[j] = a[lo + j]
    i = 8
    while i < n - (n % 8):
        for j in range(8):
            r[j] += a[lo + i + j]
        i += 8
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@numba.njit(cache=True, error_model="numpy")
def _pairwise_sum(a, lo, n):
    """``a[lo:lo + n].sum()`` as numpy sums a contiguous float64 array, bit for bit: numpy's pairwise
    summation (``pairwise_sum`` in numpy's ``loops_utils.h.src``; numpy.sum's documentation, Notes): blocks
    of at most 128 (:func:`_pairwise_block`), above that the sum of the two halves (the first a multiple of
    8 long), here with an explicit stack (numba's cache does not hold recursive functions safely). The
    caller adds it to 0.0, as numpy's reduction starts from the identity."""
    if n <= 128:
        return _pairwise_block(a, lo, n)
    los = np.empty(130, np.int64)  # pending (lo, n, halves done) ranges: 2 per level, < 64 levels
    ns = np.empty(130, np.int64)
    done = np.zeros(130, np.bool_)
    sums = np.empty(130)  # the finished ranges' sums, left before right
    los[0], ns[0], sp, rp = lo, n, 1, 0
    while sp > 0:
        sp -= 1
        l, m = los[sp], ns[sp]
        if m <= 128:
            sums[rp] = _pairwise_block(a, l, m)
            rp += 1
        elif done[sp]:  # both halves summed: left + right
            sums[rp - 2] = sums[rp - 2] + sums[rp - 1]
            rp -= 1
        else:
            n2 = m // 2
            n2 -= n2 % 8
            done[sp] = True  # back on the stack, under its halves
            los[sp + 1], ns[sp + 1], done[sp + 1] = l + n2, m - n2, False  # right, summed second
            los[sp + 2], ns[sp + 2], done[sp + 2] = l, n2, False  # left, summed first
            sp += 3
    return sums[0]


@numba.njit(cache=True, error_model="numpy")
def _select(parents, pp, own, num_experts, fixed_ms, per_node_ms, layer_ms, seg_word, seg_mask, seg_layer, lam_rate,
            tol):
    """The exact selection without budgets (its node ids, increasing, int64), the uncached experts per layer
    it needs (the root's included), and its A (tokens) and T (ms): the floats of
    :func:`specfit.core.objective.evaluate`, bit for bit (A's sum as numpy's, :func:`_pairwise_sum`; T's
    expert term as :meth:`specfit.core.cost.CostModel.cycle_ms`). ``own`` (n, words): row 0 the root's items, row v > 0 the items v owns
    (:meth:`specfit.core.coverage.ItemSets.words`).

    Ratio mode (``lam_rate < 0``): Dinkelbach from the best prefix of the path-probability order (as
    ``scan_prefix``); rate mode: one maximum closure at λ = ``lam_rate`` tokens/ms. Item costs: every
    layer's ``layer_ms`` the same (``uniform``) or per layer, as ``Coverage.bits_ms``."""
    n, W, L = pp.shape[0], own.shape[1], layer_ms.shape[0]
    uniform = layer_ms[0] if L else -1.0
    for l in range(L):
        if layer_ms[l] != uniform:
            uniform = -1.0
    root_new = np.zeros(L, np.int64)
    _per_layer(own[0], seg_word, seg_mask, seg_layer, root_new)
    root_count = 0
    root_ms = 0.0  # T's root term as Coverage.base_ms sums it: per layer, whatever the layers' costs
    for l in range(L):
        root_count += root_new[l]
        root_ms += layer_ms[l] * root_new[l]
    scan_root_ms = root_ms  # ... and as the prefix scan's bits_ms prices the root's items
    if uniform >= 0.0:
        scan_root_ms = uniform * root_count if root_count else 0.0
    counts = np.zeros(L, np.int64)
    cptr = np.zeros(n + 1, np.int64)  # children in increasing id order (CSR)
    for v in range(1, n):
        cptr[parents[v] + 1] += 1
    for v in range(n):
        cptr[v + 1] += cptr[v]
    cidx = np.empty(max(n - 1, 0), np.int64)
    fill = np.empty(n, np.int64)
    for v in range(n):
        fill[v] = cptr[v]
    for v in range(1, n):
        cidx[fill[parents[v]]] = v
        fill[parents[v]] += 1
    once = np.zeros(W, np.uint64)
    shared = np.zeros(W, np.uint64)
    for v in range(1, n):
        for w in range(W):
            shared[w] |= once[w] & own[v, w]
            once[w] |= own[v, w]
    excl = np.zeros(n)
    row = np.zeros(W, np.uint64)
    for v in range(1, n):
        for w in range(W):
            row[w] = own[v, w] & ~shared[w]
        excl[v] = _bits_ms(row, uniform, layer_ms, seg_word, seg_mask, seg_layer, counts)
    base_ms = fixed_ms + per_node_ms + root_ms
    if lam_rate >= 0.0:
        sel = _max_closure(lam_rate, parents, pp, own, shared, per_node_ms, excl, uniform, layer_ms, seg_word,
                           seg_mask, seg_layer, num_experts, counts, cptr, cidx)
    else:
        order = _path_prob_order(parents, pp)
        covered = np.zeros(W, np.uint64)  # the best prefix of the path-probability order
        a = 1.0
        t = fixed_ms + (per_node_ms + scan_root_ms)
        best, best_len = a / t, 1
        for k in range(1, n):
            v = order[k]
            for w in range(W):
                row[w] = own[v, w] & ~covered[w]
                covered[w] |= row[w]
            a += pp[v]
            t += per_node_ms + _bits_ms(row, uniform, layer_ms, seg_word, seg_mask, seg_layer, counts)
            if a / t > best:
                best, best_len = a / t, k + 1
        sel = np.zeros(n, np.bool_)
        for k in range(best_len):
            sel[order[k]] = True
        a, t = _value(sel, pp, own, base_ms, per_node_ms, uniform, layer_ms, seg_word, seg_mask, seg_layer, counts)
        lam = a / t
        while True:
            cand = _max_closure(lam, parents, pp, own, shared, per_node_ms, excl, uniform, layer_ms, seg_word,
                                seg_mask, seg_layer, num_experts, counts, cptr, cidx)
            ca, ct = _value(cand, pp, own, base_ms, per_node_ms, uniform, layer_ms, seg_word, seg_mask, seg_layer,
                            counts)
            if not ca - lam * ct > tol:  # NaN-safe: an overflowing T (inf) ends the loop
                if ca / ct > lam:
                    sel = cand
                break
            sel, lam = cand, ca / ct
    bits = np.zeros(W, np.uint64)
    size = 1
    for v in range(1, n):
        if sel[v]:
            size += 1
            for w in range(W):
                bits[w] |= own[v, w]
    _per_layer(bits, seg_word, seg_mask, seg_layer, counts)
    experts_ms = 0.0  # as CostModel.cycle_ms: layer by layer, in order
    for l in range(L):
        counts[l] += root_new[l]
        experts_ms += layer_ms[l] * np.float64(counts[l])
    nodes, a = _nodes_and_a(sel, pp, size)
    t = fixed_ms + per_node_ms * size + experts_ms if L else fixed_ms + per_node_ms * size
    return nodes, counts, a, t


@numba.njit(cache=True, error_model="numpy")
def _select_nodes(parents, pp, own, num_experts, fixed_ms, per_node_ms, layer_ms, seg_word, seg_mask, seg_layer,
                  lam_rate, tol, out):
    """:func:`_select`'s node ids written into ``out`` (n,) int64, made by the caller; returns ``(size, a,
    t)``, the ids in ``out[:size]``. A compiled call that returns arrays it made pays their boxing, whose
    code a forward has evicted."""
    nodes, _, a, t = _select(parents, pp, own, num_experts, fixed_ms, per_node_ms, layer_ms, seg_word, seg_mask,
                             seg_layer, lam_rate, tol)
    for i in range(nodes.shape[0]):
        out[i] = nodes[i]
    return nodes.shape[0], a, t


def _segments(num_layers: int, num_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (word, layer) overlap of the item ids ``l * E + e`` in 64-bit words: ``(word, mask, layer)``."""
    words, masks, layers = [], [], []
    for l in range(num_layers):
        lo, hi = l * num_experts, (l + 1) * num_experts
        for w in range(lo // 64, (hi + 63) // 64):
            a, b = max(lo, 64 * w) - 64 * w, min(hi, 64 * w + 64) - 64 * w
            words.append(w)
            masks.append(((1 << b) - 1) ^ ((1 << a) - 1))
            layers.append(l)
    return np.array(words, np.int64), np.array(masks, np.uint64), np.array(layers, np.int64)


@functools.lru_cache(maxsize=16)
def _layout(num_layers: int, num_experts: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """The item words per node and :func:`_segments`, made once per (L, E) and shared by every solve, so
    read-only (and compiled for as such: :func:`exact_kernel`)."""
    words = (num_layers * num_experts + 63) // 64
    segments = _segments(num_layers, num_experts)
    for a in segments:
        a.setflags(write=False)
    return (words,) + segments


def select_unbudgeted(tree, items, cost, rate_lam: float | None, tol: float,
                      fixed_ms: float | None = None, per_expert: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, float, float]:
    """The exact selection of a transfer-regime instance without budgets, as one compiled call.

    Parameters
    ----------
    tree : DraftTree
    items : ItemSets
        ``tree.items(cache)``: the tree's coverage accounting against the instance's cache.
    cost : CostModel
        Transfer regime (not checked); no ``max_nodes`` nor expert budget applies (not checked).
    rate_lam : float or None
        λ in tokens per ms (rate mode), or None (ratio mode: maximise A/T).
    tol : float
        Dinkelbach's stopping tolerance (tokens).
    fixed_ms : float, optional
        T's constant term in ms in place of ``cost.fixed_ms`` (the engine's: the cost's, plus the ms of the
        cycle already paid, as :meth:`~specfit.core.cost.CostModel.plus_ms` adds them).
    per_expert : numpy.ndarray, optional
        ``cost.per_expert_array(L)`` when the caller already has it (read-only float64 (L,)).

    Returns
    -------
    nodes : numpy.ndarray of int64
        Selected node ids, increasing, root first (ancestor-closed).
    new : numpy.ndarray of int64, shape (L,)
        Uncached experts per layer the selection needs (the root's included): the ``new_experts`` of
        :func:`specfit.core.objective.evaluate`.
    a, t : float
        A(S) (tokens) and T(S) (ms) of the selection: :func:`specfit.core.objective.evaluate`'s floats, bit
        for bit (SPECFIT.md §3).
    """
    return exact_kernel()(*_kernel_args(tree, items, cost, rate_lam, tol, fixed_ms, per_expert))


def _kernel_args(tree, items, cost, rate_lam, tol, fixed_ms, per_expert) -> tuple:
    """:func:`_select`'s arguments for :func:`select_unbudgeted`'s parameters (the same names)."""
    L, E = tree.num_layers, tree.num_experts or 0
    weights = cost.segment_ms(L) if per_expert is None else per_expert
    _, seg_word, seg_mask, seg_layer = _layout(weights.shape[0], E)  # L segments, or 2L with reads priced
    return (kernel_array(tree.parents, np.int64), kernel_array(tree.path_prob, np.float64), items.words(copy=False), E,
            float(cost.fixed_ms if fixed_ms is None else fixed_ms), float(cost.per_node_ms), weights,
            seg_word, seg_mask, seg_layer,
            -1.0 if rate_lam is None else float(rate_lam), float(tol))


def select_unbudgeted_nodes(tree, items, cost, rate_lam: float | None, tol: float, fixed_ms: float,
                            per_expert: np.ndarray) -> tuple[tuple, float, float]:
    """:func:`select_unbudgeted`'s nodes (a tuple of int), A and T, without the experts per layer: the
    engine's solve (:meth:`~specfit.solvers.exact.ExactSolver.solve_tree`), by one compiled call
    (:func:`_select_nodes`) that writes the ids into an array made here. ``fixed_ms`` and ``per_expert``
    as there (both required). Returns ``(nodes, a, t)``: node ids increasing, root first; A(S) in tokens and
    T(S) in ms, the floats of :func:`specfit.core.objective.evaluate` (SPECFIT.md §3). Raises nothing itself
    (the caller checks the cost and the tree's accounting)."""
    out = np.empty(tree.n, np.int64)
    size, a, t = exact_nodes_kernel()(*_kernel_args(tree, items, cost, rate_lam, tol, fixed_ms, per_expert), out)
    return tuple(out[:size].tolist()), a, t


def linear_prefix_selection(tree, fixed_ms: float, per_node_ms: float, max_nodes: int | None,
                            lam: float | None) -> tuple[np.ndarray, float, float]:
    """:func:`specfit.solvers.greedy.linear_prefix` (the same prefix, bit for bit) and its A and T, as one
    compiled call.

    Parameters
    ----------
    tree : DraftTree
    fixed_ms, per_node_ms : float
        T of a k-node prefix is ``fixed_ms + k * per_node_ms`` ms (the caller checks that no node needs an
        uncached expert).
    max_nodes : int or None
    lam : float or None
        λ in tokens per ms (maximise ``A - λT``), or None (``A / T``).

    Returns
    -------
    nodes : numpy.ndarray of int64
        Sorted node ids of the best prefix, root included.
    a, t : float
        Its A(S) (tokens) and T(S) (ms): :func:`specfit.core.objective.evaluate_uncovered`'s floats, bit for
        bit (SPECFIT.md §3).
    """
    return linear_prefix_kernel()(kernel_array(tree.parents, np.int64), kernel_array(tree.path_prob, np.float64),
                                  float(fixed_ms), float(per_node_ms), tree.n if max_nodes is None else int(max_nodes),
                                  -1.0 if lam is None else float(lam))


@functools.cache
def linear_prefix_kernel():
    """The compiled :func:`_linear_prefix` (its :func:`~specfit.core.kernels.entry_point`), compiled or
    loaded from numba's cache on the first call in a process."""
    for lam in (-1.0, 0.1):
        kernel = entry_point(_linear_prefix, np.array([-1, 0], np.int64), np.array([1.0, 0.5]), 1.0, 0.1, 2, lam)
    return kernel


@functools.cache
def exact_kernel():
    """The compiled :func:`_select` (its :func:`~specfit.core.kernels.entry_point`), compiled or loaded
    from numba's cache on the first call in a process (the exact solver asks for it when it is built)."""
    for lam in (-1.0, 0.1):
        kernel = entry_point(_select, *_example_args(lam))
    return kernel


def _example_args(lam: float) -> tuple:
    """Arguments of :func:`_select` of the types the engine passes (a 3-node tree, one 64-expert layer)."""
    parents, pp = np.array([-1, 0, 0], np.int64), np.array([1.0, 0.5, 0.4])
    own = np.array([[4], [3], [1]], np.uint64)
    seg = _layout(1, 64)[1:]  # read-only, as select_unbudgeted passes them
    layer_ms = np.ones(1)
    layer_ms.setflags(write=False)  # as CostModel.per_expert_array
    return (parents, pp, own, 64, 1.0, 0.1, layer_ms, *seg, lam, 1e-12)


@functools.cache
def exact_nodes_kernel():
    """The compiled :func:`_select_nodes` (its :func:`~specfit.core.kernels.entry_point`), compiled or loaded
    from numba's cache on the first call in a process (the exact solver asks for it when it is built)."""
    for lam in (-1.0, 0.1):
        kernel = entry_point(_select_nodes, *_example_args(lam), np.empty(3, np.int64))
    return kernel
