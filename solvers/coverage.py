"""Coverage accounting: which uncached experts each draft node adds to a selection.

An *item* is a pair (layer, expert) that some node needs and the expert cache lacks
(SPECFIT.md §2). Because selections are ancestor-closed, when node v joins a selection all of its
ancestors are already in it, so v adds only the items it *owns*: those no proper ancestor of v
needs. The root is always verified, so its items are paid once, up front.

This module turns an :class:`~specfit.instance.Instance` into that accounting, once per instance:
per-node owned-item bitsets (Python ints, one bit per item, items ordered by layer), item weights
(ms), the items owned by exactly one node (their cost folds into that node) and the shared ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specfit.instance import Instance


@dataclass(frozen=True, eq=False)
class Coverage:
    """Coverage accounting of one instance (computed by :func:`coverage`).

    Attributes
    ----------
    n : int
        Nodes, root included.
    parents : list of int
    children : list of list of int
    path_prob : list of float
        ``P_v``.
    base_ms : float
        Time of the root alone: ``fixed_ms + per_node_ms + cost of the root's items`` (ms).
    per_node_ms : float
    own_bits : list of int
        ``own_bits[v]``: bitset of the non-root items v owns (no proper ancestor needs them);
        ``own_bits[0] == 0``.
    item_ms : numpy.ndarray of float64, shape (U,)
        Transfer time of each non-root item, ordered by (layer, expert).
    item_layer : numpy.ndarray of int64, shape (U,)
    root_new_per_layer : numpy.ndarray of int64, shape (L,)
        Uncached experts the root alone needs per layer.
    exclusive_ms : numpy.ndarray of float64, shape (n,)
        Cost of the items owned by v alone (no other node owns them), ms.
    shared_own : numpy.ndarray of bool, shape (n, Us)
        Ownership of the items owned by two or more nodes (the only ones that couple nodes).
    shared_ms : numpy.ndarray of float64, shape (Us,)
        Transfer time of each of those items, ms.
    layer_slices : list of tuple(int, int)
        Bit range ``[lo, hi)`` of each layer's items.
    layer_ms : list of float
        Transfer time of one item of each layer (``per_expert_ms[l]``), ms.
    uniform_ms : float or None
        The per-item weight when all items weigh the same, else None.
    """

    n: int
    parents: list
    children: list
    path_prob: list
    base_ms: float
    per_node_ms: float
    own_bits: list
    item_ms: np.ndarray
    item_layer: np.ndarray
    root_new_per_layer: np.ndarray
    exclusive_ms: np.ndarray
    shared_own: np.ndarray
    shared_ms: np.ndarray
    layer_slices: list
    layer_ms: list
    uniform_ms: float | None

    def bits_ms(self, bits: int) -> float:
        """Transfer time (ms) of the items in bitset ``bits``."""
        if not bits:
            return 0.0
        if self.uniform_ms is not None:
            return self.uniform_ms * bits.bit_count()
        total = 0.0
        for (lo, hi), w in zip(self.layer_slices, self.layer_ms):
            if hi > lo:
                total += w * ((bits >> lo) & ((1 << (hi - lo)) - 1)).bit_count()
        return total

    def bits_per_layer(self, bits: int) -> list[int]:
        """Number of items of bitset ``bits`` in each layer."""
        return [((bits >> lo) & ((1 << (hi - lo)) - 1)).bit_count() for lo, hi in self.layer_slices]

    def value(self, nodes) -> tuple[float, float]:
        """``(A(S), T(S))`` of an ancestor-closed node set, in tokens and ms."""
        a, bits, count = 1.0, 0, 0
        for v in nodes:
            if v:
                a += self.path_prob[v]
                bits |= self.own_bits[v]
                count += 1
        return a, self.base_ms + self.per_node_ms * count + self.bits_ms(bits)


def _pack_rows(mask: np.ndarray) -> list[int]:
    """Each row of a bool matrix as a Python int bitset (bit j = column j)."""
    if mask.shape[1] == 0:
        return [0] * mask.shape[0]
    packed = np.packbits(mask, axis=1, bitorder="little")
    return [int.from_bytes(row.tobytes(), "little") for row in packed]


def coverage(instance: Instance) -> Coverage:
    """Build the coverage accounting of ``instance``.

    Parameters
    ----------
    instance : Instance

    Returns
    -------
    Coverage

    Notes
    -----
    Cost O(n · U) with U the number of distinct non-root uncached items (bool matrix ops).
    """
    tree = instance.tree
    n = tree.n
    parents = tree.parents.tolist()
    cost = instance.cost
    L, E = instance.num_layers, instance.num_experts
    need_all = instance.need_mask
    w_all = instance.item_weight
    root = need_all[0]
    root_new = need_all[0].reshape(L, E).sum(axis=1).astype(np.int64) if L else np.zeros(0, dtype=np.int64)
    base_ms = cost.fixed_ms + cost.per_node_ms + float(w_all[root].sum())
    universe = np.flatnonzero(need_all[1:].any(axis=0) & ~root) if n > 1 else np.zeros(0, dtype=np.int64)
    U = universe.shape[0]
    need = need_all[:, universe]
    need[0] = False
    # owned = needed and not needed by any proper ancestor
    anc = np.zeros((n, U), dtype=bool)
    for v in range(1, n):
        p = parents[v]
        anc[v] = anc[p] | need[p]
    own = need & ~anc
    item_ms = w_all[universe]
    owners_count = own.sum(axis=0)
    excl = owners_count == 1
    exclusive_ms = own[:, excl].astype(np.float64) @ item_ms[excl]
    shared_cols = owners_count >= 2
    item_layer = universe // E if U else np.zeros(0, dtype=np.int64)
    bounds = np.searchsorted(item_layer, np.arange(L + 1))
    slices = [(int(bounds[l]), int(bounds[l + 1])) for l in range(L)]
    per_layer = cost.per_expert_array(L)
    uniform = 0.0 if L == 0 else (float(per_layer[0]) if np.all(per_layer == per_layer[0]) else None)
    return Coverage(n, parents, [list(c) for c in tree.children], tree.path_prob.tolist(), base_ms,
                    cost.per_node_ms, _pack_rows(own), item_ms, item_layer, root_new, exclusive_ms, own[:, shared_cols],
                    item_ms[shared_cols], slices,
                    per_layer.tolist(), uniform)
