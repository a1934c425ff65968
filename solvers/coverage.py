"""Coverage accounting: which uncached experts each draft node adds to a selection.

An *item* is a pair (layer, expert) that some node needs and the expert cache lacks
(SPECFIT.md §2); item id ``l * num_experts + e``. Because selections are ancestor-closed, when node
v joins a selection all of its ancestors are already in it, so v adds only the items it *owns*:
those no proper ancestor of v needs. The root is always verified, so its items are paid once, up
front, and owned by nobody else.

Sets of items are Python ints used as bitsets (bit i = item i): union, difference and popcount
are single C-level operations on a few hundred machine words, which keeps the per-instance
preprocessing of a 48-layer, 128-expert, 64-node tree well under a millisecond.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specfit.core.instance import Instance


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
        T of the root alone: ``fixed_ms + per_node_ms + cost of the root's items`` (ms).
    per_node_ms : float
    own_bits : list of int
        ``own_bits[v]``: bitset of the items v owns (needed by v, by no proper ancestor, not by the
        root, not cached); ``own_bits[0] == 0``.
    shared_bits : int
        Items owned by two or more nodes (the only ones that couple nodes).
    exclusive_ms : list of float
        Cost (ms) of the items owned by v and by no other node.
    root_new_per_layer : list of int
        Uncached experts the root alone needs, per layer.
    num_experts : int
    layer_ms : list of float
        Transfer time (ms) of one item of each layer (``per_expert_ms[l]``).
    uniform_ms : float or None
        The per-item time when every layer's is the same, else None.
    """

    n: int
    parents: list
    children: list
    path_prob: list
    base_ms: float
    per_node_ms: float
    own_bits: list
    shared_bits: int
    exclusive_ms: list
    root_new_per_layer: list
    num_experts: int
    layer_ms: list
    uniform_ms: float | None

    @property
    def num_items(self) -> int:
        """Bits in an item set: ``L * num_experts``."""
        return len(self.layer_ms) * self.num_experts

    def bits_per_layer(self, bits: int) -> list[int]:
        """Number of items of bitset ``bits`` in each layer."""
        E, mask = self.num_experts, (1 << self.num_experts) - 1
        return [((bits >> (l * E)) & mask).bit_count() for l in range(len(self.layer_ms))]

    def bits_ms(self, bits: int) -> float:
        """Transfer time (ms) of the items in bitset ``bits``."""
        if not bits:
            return 0.0
        if self.uniform_ms is not None:
            return self.uniform_ms * bits.bit_count()
        return sum(w * c for w, c in zip(self.layer_ms, self.bits_per_layer(bits)))

    def item_ms(self, item_ids: np.ndarray) -> np.ndarray:
        """Transfer time (ms) of each item id, float64 array shaped like ``item_ids``."""
        return np.asarray(self.layer_ms, dtype=np.float64)[item_ids // self.num_experts]

    def unpack(self, bit_rows: list[int]) -> np.ndarray:
        """Bitsets as a bool matrix of shape (len(bit_rows), num_items)."""
        nbytes = (self.num_items + 7) // 8
        buf = b"".join(r.to_bytes(nbytes, "little") for r in bit_rows)
        packed = np.frombuffer(buf, dtype=np.uint8).reshape(len(bit_rows), nbytes)
        return np.unpackbits(packed, axis=1, count=self.num_items, bitorder="little").astype(bool)

    def value(self, nodes) -> tuple[float, float]:
        """``(A(S), T(S))`` of an ancestor-closed node set: tokens and ms (SPECFIT.md §3)."""
        a, bits, count = 1.0, 0, 0
        for v in nodes:
            if v:
                a += self.path_prob[v]
                bits |= self.own_bits[v]
                count += 1
        return a, self.base_ms + self.per_node_ms * count + self.bits_ms(bits)


def at_least_twice(rows) -> tuple[int, int]:
    """``(once, twice)``: the bits set in at least one / at least two of the bitsets ``rows``."""
    once = twice = 0
    for r in rows:
        twice |= once & r
        once |= r
    return once, twice


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
    O(n) bitset operations on ``L * num_experts``-bit integers after one ``packbits`` of the
    instance's (n, L * num_experts) need mask.
    """
    tree = instance.tree
    n = tree.n
    parents = tree.parents.tolist()
    cost = instance.cost
    L, E = instance.num_layers, instance.num_experts
    layer_ms = cost.per_expert_array(L).tolist()
    uniform = 0.0 if L == 0 else (layer_ms[0] if all(w == layer_ms[0] for w in layer_ms) else None)
    packed = np.packbits(instance.need_mask, axis=1, bitorder="little")
    need = [int.from_bytes(row.tobytes(), "little") for row in packed]
    root = need[0]
    root_new = [((root >> (l * E)) & ((1 << E) - 1)).bit_count() for l in range(L)]
    base_ms = cost.fixed_ms + cost.per_node_ms + sum(w * c for w, c in zip(layer_ms, root_new))
    anc = [0] * n  # items needed by a proper ancestor (the root's included)
    own = [0] * n
    for v in range(1, n):
        p = parents[v]
        anc[v] = anc[p] | need[p]
        own[v] = need[v] & ~anc[v]
    _, shared = at_least_twice(own)
    cov = Coverage(n, parents, [list(c) for c in tree.children], tree.path_prob.tolist(), base_ms, cost.per_node_ms,
                   own, shared, [], root_new, E, layer_ms, uniform)
    cov.exclusive_ms.extend(cov.bits_ms(o & ~shared) for o in own)
    return cov
