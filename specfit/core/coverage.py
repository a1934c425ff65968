"""Coverage accounting: which uncached experts the nodes of a draft tree need, against the expert cache.

An *item* is a pair (layer, expert) that some node needs and the expert cache lacks (SPECFIT.md §2);
item id ``l * num_experts + e``. Sets of items are Python ints used as bitsets (bit i = item i):
union, difference and popcount are single C-level operations on a few hundred machine words.

Three views, one source:

* :class:`ItemSets` — per-node item bitsets of a draft tree against one cache, grown level by level
  with the tree (:meth:`specfit.core.tree.DraftTree.items`). Because selections are ancestor-closed,
  when node v joins a selection all of its ancestors are already in it, so v adds only the items it
  *owns*: those no proper ancestor of v needs (``own[v]``). The root is always verified, so its items
  are paid once, up front, and owned by nobody else.
* :class:`PricedItems` — the items T(S) prices when resident experts cost their read (``read_ms > 0``):
  the uncached items (segment l: an expert of layer l copied and read) and, shifted by ``L * num_experts``
  bits, the resident routed items (segment L + l: an expert of layer l the cache holds, read only). The
  two sets are disjoint; T(S) stays a coverage function with one cost per segment, so the solvers price it
  as before over 2L segments.
* :class:`Coverage` — the same accounting priced by a cost model (ms per item, the root's cost, the
  items that couple nodes), read by the exact solver.
* :class:`GrowingSelection` — the items an ancestor-closed selection covers as it grows node by
  node, read by the greedy baselines, the best-prefix scan and the engine's stop-rule bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from specfit.core.errors import SpecFitInputError, as_int_array

if TYPE_CHECKING:  # pragma: no cover
    from specfit.core.instance import Instance


def at_least_twice(rows) -> tuple[int, int]:
    """``(once, twice)``: the bits set in at least one / at least two of the bitsets ``rows``."""
    once = twice = 0
    for r in rows:
        twice |= once & r
        once |= r
    return once, twice


def item_ids(bits: int, num_items: int) -> np.ndarray:
    """The item ids in bitset ``bits`` (of ``num_items`` bits), sorted, int64."""
    raw = np.frombuffer(bits.to_bytes((num_items + 7) // 8, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, count=num_items, bitorder="little")).astype(np.int64)


class ItemSets:
    """Per-node bitsets of the uncached items of a draft tree, grown level by level.

    The bitsets are kept as rows of 64-bit words (item i is bit ``i % 64`` of word ``i // 64``), filled by
    one compiled pass per :meth:`extend`; :attr:`need`, :attr:`above` and :attr:`own` give them as Python
    ints (converted when first read), for the bitset code of the Python solvers.

    Parameters
    ----------
    cache : numpy.ndarray of bool, shape (L, num_experts)
        ``cache[l, e]`` is True iff expert e of MoE layer l is resident on the device.

    Attributes
    ----------
    need : list of int
        ``need[v]``: the items node v needs (bitset over ``L * num_experts`` bits).
    above : list of int
        ``above[v]``: the items a proper ancestor of v needs (the root's included); ``above[0] = 0``.
    own : list of int
        ``own[v] = need[v] & ~above[v]``; ``own[0] = 0`` (the root's items are paid up front).
    rows : numpy.ndarray of int64, shape (n, L)
        ``rows[v, l] = |E[v][l] \\ C[l]|``: node v's (token, uncached expert) rows in layer l, the
        per-node term of the host-compute regime (:class:`specfit.core.cost.HostProfile`); row 0 is
        also the root's uncached experts per layer.

    Notes
    -----
    :meth:`extend` costs one compiled pass over the new nodes' (m, L, k) experts
    (:func:`specfit.core.kernels.item_words_kernel`: need, above and own words, rows per layer), so a tree
    grown level by level is accounted for once, not once per level, and no Python int is built unless a
    Python solver reads one.
    """

    def __init__(self, cache: np.ndarray):
        if np.ndim(cache) != 2:
            raise SpecFitInputError("cache", f"must be a (layers, num_experts) array; got shape {np.shape(cache)}")
        self.cache = cache
        self.num_layers, self.num_experts = (int(x) for x in cache.shape)
        self._num_words = (self.num_layers * self.num_experts + 63) // 64
        self._n = 0
        self._uncached = False  # some node needs an item (any_uncached)
        # need, above, own words and rows per layer; rows [0, _n) are valid, capacity grows by doubling
        self._need_w = self._above_w = self._own_w = self._words_w = np.zeros((0, self._num_words), dtype=np.uint64)
        self._rows = np.zeros((0, self.num_layers), dtype=np.int64)
        self._ints = {"need": [], "above": [], "own": []}  # Python-int views, converted when first read
        self._cache_c = None  # the kernel's cache argument, made at the first extend

    def __len__(self) -> int:
        return self._n

    @property
    def rows(self) -> np.ndarray:
        return self._rows[:self._n]

    def _bits(self, name: str) -> list[int]:
        out, words = self._ints[name], getattr(self, f"_{name}_w")
        for v in range(len(out), self._n):
            out.append(int.from_bytes(words[v].tobytes(), "little"))
        return out

    need = property(lambda self: self._bits("need"), doc="``need[v]``: the items node v needs (Python ints).")
    above = property(lambda self: self._bits("above"), doc="``above[v]``: the items a proper ancestor of v needs.")
    own = property(lambda self: self._bits("own"), doc="``own[v] = need[v] & ~above[v]``; ``own[0] = 0``.")

    def need_mask(self, experts: np.ndarray) -> np.ndarray:
        """Bool array of shape (m, L * num_experts): True where a node of ``experts`` (shape (m, L, k))
        routes to an uncached expert (:meth:`extend` packs the same bits in one compiled call,
        :func:`specfit.core.kernels.item_words_kernel`)."""
        m, L, E = experts.shape[0], self.num_layers, self.num_experts
        mask = np.zeros((m, L * E), dtype=bool)
        if L and m:
            ids = experts + (np.arange(L, dtype=np.int64) * E)[None, :, None]
            mask[np.repeat(np.arange(m), ids.shape[1] * ids.shape[2]), ids.reshape(-1)] = True
            mask &= ~self.cache.reshape(1, -1)
        return mask

    def _reserve(self, size: int) -> None:
        """Grow the word and row arrays to hold ``size`` nodes (capacity doubles)."""
        cap = self._rows.shape[0]
        if size <= cap:
            return
        cap = max(size, 2 * cap, 8)
        for name in ("_need_w", "_above_w", "_own_w", "_words_w", "_rows"):
            old = getattr(self, name)
            new = np.zeros((cap,) + old.shape[1:], dtype=old.dtype)
            new[:self._n] = old[:self._n]
            setattr(self, name, new)

    def extend(self, parents: Sequence[int], experts: np.ndarray) -> None:
        """Account for new nodes, appended after the existing ones.

        Parameters
        ----------
        parents : sequence of int, shape (m,)
            Parent of each new node (an existing node, or an earlier new one; -1 for the root).
        experts : numpy.ndarray of int, shape (m, L, k)
            Predicted experts of each new node.

        Raises
        ------
        SpecFitInputError
            If ``experts`` does not have one row per layer of the cache (field ``cache``), is not an
            (m, L, k) integer array or an expert id lies outside [0, num_experts) (``experts``), or
            ``parents`` is not a 1-D integer array of earlier nodes, the first node's -1 (``parents``);
            nothing is appended then.
        """
        from specfit.core.kernels import item_words_kernel, kernel_array

        parents, experts = as_int_array(parents, "parents", 1, False), as_int_array(experts, "experts", 3, False)
        m = len(parents)
        if not m:
            return
        if experts.shape[0] != m:
            raise SpecFitInputError("experts", f"must have shape (m={m}, L, k), one row per new node; got {experts.shape}")
        if experts.shape[2] and experts.shape[1] != self.num_layers:
            raise SpecFitInputError("cache", f"must have one row per MoE layer of the experts: experts have shape "
                                    f"{experts.shape} (m, L, k), the cache {self.num_layers} layers")
        self._reserve(self._n + m)
        if self._cache_c is None:
            self._cache_c = kernel_array(self.cache, np.bool_)
        if experts.shape[2] == 0:  # no expert term: every item set is empty
            experts = np.zeros((m, self.num_layers, 0), dtype=np.int64)
        status, uncached = item_words_kernel()(kernel_array(experts, np.int64), self._cache_c,
                                               kernel_array(parents, np.int64), self._n, self._need_w,
                                               self._above_w, self._own_w, self._words_w, self._rows)
        if status == 1:
            raise SpecFitInputError("experts", f"expert ids must lie in [0, {self.num_experts})")
        if status == 2:
            raise SpecFitInputError("parents", f"each parent must be an earlier node in [0, {self._n + m}) or -1 "
                                    "for the root")
        self._n += m
        self._uncached |= uncached

    def words(self, copy: bool = True) -> np.ndarray:
        """The root's items and the items each other node owns as 64-bit words, for compiled code.

        Parameters
        ----------
        copy : bool
            True (default): a new array on each call (changing it changes nothing here). False: a view of
            the words :meth:`extend` keeps, for a compiled call that only reads it (the exact solver's, once
            per selection); it must not be changed, and the next :meth:`extend` may replace it.

        Returns
        -------
        numpy.ndarray of uint64, shape (n, ceil(L * num_experts / 64))
            Row 0: ``need[0]``; row v > 0: ``own[v]``; item i is bit ``i % 64`` of word ``i // 64``.
        """
        view = self._words_w[:self._n]
        return view.copy() if copy else view

    def any_uncached(self) -> bool:
        """True iff some node needs an uncached item (``any(need)``, without building the Python ints)."""
        return self._uncached  # kept by extend (the kernel reports it): no array pass per solve

    def per_layer(self, bits: int) -> list[int]:
        """Number of items of bitset ``bits`` in each layer."""
        return _segment_counts(bits, self.num_experts, self.num_layers)

    def union(self, nodes: Iterable[int]) -> int:
        """Bitset of the items any node of ``nodes`` needs."""
        return _union(self.need, nodes)

    def new_per_layer(self, nodes: Iterable[int]) -> np.ndarray:
        """``|(union_{v in nodes} E[v][l]) \\ C[l]|`` for each layer l; int64 of shape (L,)."""
        return np.asarray(self.per_layer(self.union(nodes)), dtype=np.int64).reshape(self.num_layers)

    def rows_per_layer(self, nodes: Iterable[int]) -> np.ndarray:
        """``r_l = sum_{v in nodes} |E[v][l] \\ C[l]|``, the (token, uncached expert) rows per layer;
        int64 of shape (L,)."""
        idx = np.fromiter(nodes, dtype=np.int64)
        return self.rows[idx].sum(axis=0, dtype=np.int64).reshape(self.num_layers)

    @property
    def root_new_per_layer(self) -> list[int]:
        """Uncached experts the root alone needs, per layer (its row of :attr:`rows`)."""
        return self._rows[0].tolist() if self._n else [0] * self.num_layers



def _union(need: list[int], nodes: Iterable[int]) -> int:
    """OR of ``need[v]`` over ``nodes``: the bitset of the items any of them needs."""
    out = 0
    for v in nodes:
        out |= need[v]
    return out


def _segment_counts(bits: int, num_experts: int, segments: int) -> list[int]:
    """Set bits of ``bits`` in each of ``segments`` consecutive ``num_experts``-bit segments."""
    mask = (1 << num_experts) - 1
    return [((bits >> (s * num_experts)) & mask).bit_count() for s in range(segments)]

def _concat_words(a: np.ndarray, a_bits: int, b: np.ndarray, b_bits: int) -> np.ndarray:
    """Rows of 64-bit words ``a`` (``a_bits`` bits used) followed by ``b``'s bits: bit i of b becomes bit
    ``a_bits + i``; uint64 of shape (n, ceil((a_bits + b_bits) / 64))."""
    if a_bits % 64 == 0:
        return np.ascontiguousarray(np.concatenate([a, b], axis=1))
    n, total = a.shape[0], a_bits + b_bits
    bits = np.concatenate([np.unpackbits(a.view(np.uint8), axis=1, bitorder="little", count=a_bits),
                           np.unpackbits(b.view(np.uint8), axis=1, bitorder="little", count=b_bits)], axis=1)
    words = (total + 63) // 64
    out = np.zeros((n, words * 8), dtype=np.uint8)
    packed = np.packbits(bits, axis=1, bitorder="little")
    out[:, :packed.shape[1]] = packed
    return out.view(np.uint64).reshape(n, words)


class PricedItems:
    """The items of T(S) with resident reads priced (module docstring): segment l < L holds the uncached
    experts of layer l (an H2D copy and a read each), segment L + l the resident experts of layer l a node
    routes to (a read each from device memory). Item ``s * num_experts + e`` of segment s; the bitsets are
    the two :class:`ItemSets` side by side, the resident items shifted by ``L * num_experts`` bits.

    Parameters
    ----------
    uncached : ItemSets
        ``tree.items(cache)``.
    reads : ItemSets
        ``tree.resident_items(cache)`` (the same tree's routed experts the cache holds).

    Attributes
    ----------
    num_layers : int
        L, the MoE layers.
    num_segments : int
        2L: the per-segment costs are ``CostModel.segment_ms(L)``.
    need, above, own : list of int
        As :class:`ItemSets`, over ``2 L num_experts`` bits.
    """

    def __init__(self, uncached: ItemSets, reads: ItemSets):
        self.uncached, self.reads = uncached, reads
        self.num_layers, self.num_experts = uncached.num_layers, uncached.num_experts
        self.num_segments = 2 * self.num_layers
        self._shift = self.num_layers * self.num_experts

    def _joined(self, name: str) -> list[int]:
        got = self.__dict__.get(name)
        if got is None or len(got) != len(self.uncached):
            got = [u | (r << self._shift) for u, r in zip(getattr(self.uncached, name), getattr(self.reads, name))]
            self.__dict__[name] = got
        return got

    need = property(lambda self: self._joined("need"), doc="``need[v]``: copies and reads node v needs.")
    above = property(lambda self: self._joined("above"), doc="``above[v]``: those a proper ancestor needs.")
    own = property(lambda self: self._joined("own"), doc="``own[v] = need[v] & ~above[v]``; ``own[0] = 0``.")

    @property
    def rows(self) -> np.ndarray:
        """The uncached (token, expert) rows per node and layer (:attr:`ItemSets.rows`)."""
        return self.uncached.rows

    def __len__(self) -> int:
        return len(self.uncached)

    def words(self, copy: bool = True) -> np.ndarray:
        """:meth:`ItemSets.words` of both item sets side by side: uint64 of shape (n, ceil(2 L E / 64)), a new
        array (``copy`` is accepted for the interface of :class:`ItemSets`)."""
        return _concat_words(self.uncached.words(copy=False), self._shift, self.reads.words(copy=False), self._shift)

    def any_uncached(self) -> bool:
        """True iff some node needs an item (an uncached expert or a resident one: a read)."""
        return self.reads.any_uncached() or self.uncached.any_uncached()

    def per_layer(self, bits: int) -> list[int]:
        """Items of bitset ``bits`` per segment: the uncached counts of the L layers, then the routed ones."""
        return _segment_counts(bits, self.num_experts, self.num_segments)

    def union(self, nodes: Iterable[int]) -> int:
        """Bitset of the items any node of ``nodes`` needs."""
        return _union(self.need, nodes)

    def new_per_layer(self, nodes: Iterable[int]) -> np.ndarray:
        """Uncached experts per layer, ``|U_l \\ C_l|``; int64 of shape (L,)."""
        return self.uncached.new_per_layer(nodes)

    def read_per_layer(self, nodes: Iterable[int]) -> np.ndarray:
        """Every routed expert per layer, ``|U_l|`` (uncached + resident); int64 of shape (L,)."""
        return self.uncached.new_per_layer(nodes) + self.reads.new_per_layer(nodes)

    @property
    def root_new_per_layer(self) -> list[int]:
        """The root's items per segment (2L)."""
        return self.uncached.root_new_per_layer + self.reads.root_new_per_layer


def priced_items(tree, cache: np.ndarray, cost) -> "ItemSets | PricedItems":
    """The items T(S) of ``cost`` prices for ``tree`` against ``cache``: ``tree.items(cache)`` when the cost
    has no resident-read term (``read_ms`` 0, or the host regime), else :class:`PricedItems`. Their
    per-segment costs are ``cost.segment_ms(L)``."""
    items = tree.items(cache)
    if getattr(cost, "regime", "transfer") != "transfer" or not getattr(cost, "read_ms", 0.0) or not items.num_layers:
        return items
    return PricedItems(items, tree.resident_items(cache))


@dataclass(frozen=True, eq=False)
class Coverage:
    """Coverage accounting of one instance priced by its cost model (computed by :func:`coverage`).

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
        ``own_bits[v]``: bitset of the items v owns (:attr:`ItemSets.own`); ``own_bits[0] == 0``.
    shared_bits : int
        Items owned by two or more nodes (the only ones that couple nodes).
    exclusive_ms : list of float
        Cost (ms) of the items owned by v and by no other node.
    root_new_per_layer : list of int
        Uncached experts the root alone needs, per layer.
    num_experts : int
    layer_ms : list of float
        Time (ms) of one item of each segment (``CostModel.segment_ms``: ``per_expert_ms[l]`` for the
        copies, then ``read_ms`` for the reads when that term is priced, :class:`PricedItems`).
    uniform_ms : float or None
        The per-item time when every segment's is the same, else None.
    num_layers : int
        L: the first L segments are the uncached experts, the ones an expert budget counts.
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
    num_layers: int = 0

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


def _layer_ms(instance: "Instance") -> tuple[list[float], float | None]:
    """Per-segment item ms (``cost.segment_ms(L)``: L copies, then L reads when ``read_ms > 0``) and the
    common value when all are equal."""
    L = instance.num_layers
    layer_ms = instance.cost.segment_ms(L).tolist()
    uniform = 0.0 if L == 0 else (layer_ms[0] if all(w == layer_ms[0] for w in layer_ms) else None)
    return layer_ms, uniform


def coverage(instance: "Instance") -> Coverage:
    """Price the item accounting of ``instance`` (:attr:`Instance.items`) with its cost model.

    Parameters
    ----------
    instance : Instance

    Returns
    -------
    Coverage

    Notes
    -----
    O(n) bitset operations on ``L * num_experts``-bit integers; the per-node bitsets come from the
    tree's accounting, computed once as the tree grew.
    """
    tree, cost, items = instance.tree, instance.cost, instance.priced_items
    layer_ms, uniform = _layer_ms(instance)
    root_new = items.root_new_per_layer
    base_ms = cost.fixed_ms + cost.per_node_ms + sum(w * c for w, c in zip(layer_ms, root_new))
    own = list(items.own)
    _, shared = at_least_twice(own)
    cov = Coverage(tree.n, tree.parents.tolist(), [list(c) for c in tree.children], tree.path_prob.tolist(), base_ms,
                   cost.per_node_ms, own, shared, [], root_new, instance.num_experts, layer_ms, uniform,
                   instance.num_layers)
    cov.exclusive_ms.extend(cov.bits_ms(o & ~shared) for o in own)
    return cov


class GrowingSelection:
    """The coverage of an ancestor-closed selection that grows one node at a time.

    The selection starts as the root; :meth:`add` adds a node whose parent is in it. ``covered``
    is the bitset of the uncached items the selection transfers; a node adds one node's time plus
    the items it needs that are not covered yet (SPECFIT.md §3, T(S)). In the host-compute regime
    (a :class:`specfit.core.cost.HostProfile` cost) T is the profile's per-layer maximum, recomputed
    from the covered items and the selection's rows as it grows.

    Parameters
    ----------
    instance : Instance

    Attributes
    ----------
    size : int
        |S|, root included.
    a : float
        A(S), tokens.
    t : float
        T(S), ms.
    in_set : numpy.ndarray of bool, shape (n,)
    """

    def __init__(self, instance: "Instance"):
        self.inst = instance
        self.host = instance.cost.regime == "host"
        self.items = instance.items if self.host else instance.priced_items
        self.num_layers = instance.num_layers
        self.layer_ms, self.uniform_ms = ([], None) if self.host else _layer_ms(instance)
        self.cap = instance.max_new_experts_per_layer if instance.num_layers else None
        self.max_nodes = instance.max_nodes
        self.cost = instance.cost
        # host regime: the selection's host experts and rows per layer, and every node's rows
        self.host_u, self.host_r = [0] * instance.num_layers, [0] * instance.num_layers
        self.host_rows = self.items.rows.tolist() if self.host else None
        # host regime with GPU reads: every routed expert covered so far (resident = routed - host)
        self.reads = instance.tree.read_items() if self.host and instance.reads_priced else None
        self.read_covered, self.host_read = 0, [0] * instance.num_layers
        self.prob = instance.tree.path_prob
        self.covered = 0
        self.in_set = np.zeros(instance.n, dtype=bool)
        self.size, self.a = 0, 0.0
        self.t = 0.0 if self.host else instance.cost.fixed_ms
        self.add(0)

    def bits_ms(self, bits: int) -> float:
        """Transfer time (ms) of the items in bitset ``bits``."""
        if not bits:
            return 0.0
        if self.uniform_ms is not None:
            return self.uniform_ms * bits.bit_count()
        return sum(w * c for w, c in zip(self.layer_ms, self.items.per_layer(bits)))

    def new_bits(self, v: int) -> int:
        """Items node v needs that the selection does not cover yet."""
        return self.items.need[v] & ~self.covered

    def fits(self, v: int) -> bool:
        """True iff adding v keeps the selection within ``max_nodes`` and the expert budget."""
        if self.max_nodes is not None and self.size + 1 > self.max_nodes:
            return False
        if self.cap is None:
            return True
        return max(self.items.per_layer(self.covered | self.items.need[v])[:self.num_layers], default=0) <= self.cap

    def _host_step(self, v: int) -> tuple[list[int], list[int], float]:
        """Host regime: the per-layer host experts and rows, and T, of the selection with v added."""
        u = [a + b for a, b in zip(self.host_u, self.items.per_layer(self.new_bits(v)))]
        r = [a + b for a, b in zip(self.host_r, self.host_rows[v])]
        resident = None
        if self.reads is not None:
            read = [a + b for a, b in zip(self.host_read, self.reads.per_layer(self.reads.need[v] & ~self.read_covered))]
            resident = [a - b for a, b in zip(read, u)]
        return u, r, self.cost.layers_ms(self.size + 1, u, r, None, resident)[0]

    def step_ms(self, v: int) -> float:
        """Time (ms) adding v would add: one node plus the experts it newly needs (host regime:
        T(S + v) - T(S))."""
        if self.host:
            return self._host_step(v)[2] - self.t
        return self.cost.per_node_ms + self.bits_ms(self.new_bits(v))

    def add(self, v: int) -> None:
        """Add node v (its parent must already be in the selection)."""
        new = self.new_bits(v)
        self.a += 1.0 if v == 0 else float(self.prob[v])
        if self.host:
            self.host_u, self.host_r, self.t = self._host_step(v)
            if self.reads is not None:
                fresh = self.reads.need[v] & ~self.read_covered
                self.host_read = [a + b for a, b in zip(self.host_read, self.reads.per_layer(fresh))]
                self.read_covered |= fresh
        else:
            self.t += self.cost.per_node_ms + self.bits_ms(new)
        self.covered |= new
        self.in_set[v] = True
        self.size += 1

    def value(self, lam: float | None) -> float:
        """The objective of the current selection: ``A / T`` or ``A - lam * T`` (lam in tokens/ms)."""
        return self.a / self.t if lam is None else self.a - lam * self.t

    def nodes(self) -> list[int]:
        """The selected node ids, sorted."""
        return np.flatnonzero(self.in_set).tolist()
