"""Draft trees: the rooted trees of candidate tokens that speculative decoding verifies.

A :class:`DraftTree` stores the tree as numpy arrays indexed by node id (parents, path
probabilities, tokens, predicted experts), grows level by level as the drafter drafts
(:meth:`DraftTree.add_level`), owns the coverage accounting of its nodes against the expert cache
(:meth:`DraftTree.items`, :mod:`specfit.core.coverage`) and exposes derived views (depth, children,
ancestor mask) computed once per size. networkx is the interchange format, not the storage:
:meth:`DraftTree.from_networkx` / :meth:`DraftTree.to_networkx` convert from and to a ``DiGraph``
(edges parent → child, node attributes ``token``, ``path_prob``, ``experts``).

Conventions (SPECFIT.md §2): node 0 is the root, the last committed token, always verified;
nodes are numbered in topological order, ``parents[i] < i`` and ``parents[0] = -1``.
The path probability of node v is the product of the draft probabilities q along the root → v
path, ``P_root = 1`` (EAGLE-2, Li et al. 2024, §4 keeps ``log P`` as the node "score").
"""

from __future__ import annotations

from functools import cached_property
import re
from typing import Iterable, Sequence

import networkx as nx
import numpy as np

from specfit.core.coverage import ItemSets
from specfit.core.errors import MAX_EXPERTS, MAX_LAYERS, SpecFitInputError, has_bool, as_int_array, check_int

#: Slack allowed when checking that path probabilities do not increase along a path.
PROB_TOL = 1e-9


def check_probabilities(values, field: str, n: int) -> np.ndarray:
    """``values`` as float64 of shape (n,), each a probability in [0, 1] (e.g. path probabilities).

    Raises
    ------
    SpecFitInputError
        Naming ``field`` (or ``field[i]``): not numbers, not n of them, not finite, or outside [0, 1].
    """
    if not (isinstance(values, np.ndarray) and values.dtype == np.float64):
        try:
            raw = np.asarray(values)
        except (TypeError, ValueError):
            raise SpecFitInputError(field, "must be a list of numbers") from None
        if raw.size and (raw.dtype.kind not in "fiu" or (not isinstance(values, np.ndarray) and has_bool(values))):
            raise SpecFitInputError(field, "must be a list of numbers (not strings or booleans)")
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise SpecFitInputError(field, "must be a list of numbers") from None
    if arr.shape != (n,):
        raise SpecFitInputError(field, f"must have one entry per node ({n}), got shape {arr.shape}")
    if ((arr >= 0.0) & (arr <= 1.0)).all():  # the common case: one pass (NaN fails both comparisons)
        return arr + 0.0  # -0.0 -> 0.0
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise SpecFitInputError(f"{field}[{bad[0]}]", "must be finite (got NaN or infinity)")
    bad = np.flatnonzero((arr < 0.0) | (arr > 1.0))
    if bad.size:
        raise SpecFitInputError(f"{field}[{bad[0]}]", f"must lie in [0, 1], got {float(arr[bad[0]])!r}")
    return arr


def validate_parents(parents) -> np.ndarray:
    """Check a parents array and return it as ``int64`` of shape (n,).

    Raises
    ------
    SpecFitInputError
        If the tree has no node, node 0 is not the single root (``parents[0] != -1``), or some
        ``parents[i]`` is not in ``[0, i)`` (parents must precede children, which also rules
        out cycles and second roots).
    """
    arr = as_int_array(parents, "parents", 1)
    if arr.shape[0] == 0:
        raise SpecFitInputError("parents", "must contain at least the root")
    if arr[0] != -1:
        raise SpecFitInputError("parents[0]", f"must be -1 (node 0 is the root), got {arr[0]}")
    idx = np.arange(arr.shape[0])
    bad = np.flatnonzero((arr[1:] < 0) | (arr[1:] >= idx[1:])) + 1
    if bad.size:
        i = int(bad[0])
        rule = ("must be >= 0: only node 0 may be a root" if arr[i] < 0 else
                f"must be < {i}: parents precede children (this also rules out cycles), got {arr[i]}")
        raise SpecFitInputError(f"parents[{i}]", rule)
    return arr


def _check_path_prob(child: np.ndarray, parent: np.ndarray, first_id: int) -> None:
    """Path probabilities ``child`` (nodes ``first_id..``) must not exceed their parents' ``parent``
    (same shape) by more than :data:`PROB_TOL`."""
    up = np.flatnonzero(child > parent + PROB_TOL)
    if up.size:
        i = int(up[0])
        raise SpecFitInputError(f"path_prob[{first_id + i}]", f"must not exceed its parent's ({parent[i]}), "
                                f"got {child[i]}: path probabilities are products of q <= 1")


def check_experts(experts, n: int, num_experts, start: int = 0, copy: bool = True) -> np.ndarray:
    """Experts of n nodes as int64 (n, L, k), ids in ``[0, num_experts)``, k >= 1 when L >= 1 (``experts``
    itself if it is such an int64 array and ``copy`` is False).

    Raises
    ------
    SpecFitInputError
        Naming ``experts`` (or ``experts[i][l]``, i counted from ``start``) or ``num_experts``.
    """
    exp = as_int_array(experts, "experts", 3, copy)
    if exp.shape[0] != n:
        raise SpecFitInputError("experts", f"must have one entry per node ({n}), got {exp.shape[0]}")
    if num_experts is None:
        raise SpecFitInputError("num_experts", "is required when experts are given")
    check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    if exp.shape[1] > MAX_LAYERS:
        raise SpecFitInputError("experts", f"must have at most {MAX_LAYERS} MoE layers (MAX_LAYERS), got {exp.shape[1]}")
    if exp.shape[1] and not exp.shape[2]:
        raise SpecFitInputError("experts", "each node routes to at least one expert per MoE layer; "
                                "got empty expert lists")
    if exp.size and (exp.min() < 0 or exp.max() >= num_experts):  # two reductions; argwhere only on error
        bad = np.argwhere((exp < 0) | (exp >= num_experts))
        v, l, j = (int(x) for x in bad[0])
        raise SpecFitInputError(f"experts[{v + start}][{l}]", f"expert id {exp[v, l, j]} is out of range [0, {num_experts})")
    return exp


def check_distinct_experts(exp: np.ndarray, field: str = "experts") -> None:
    """Refuse a node that names one expert twice in a layer: the input forms (instance JSON,
    :func:`~specfit.solvers.select`'s graph) state a node's experts in a layer as a set. (A
    :class:`DraftTree` built from arrays counts a repeated id once.)

    Raises
    ------
    SpecFitInputError
        On ``experts[v][l]`` (or ``field`` of a graph node), naming the repeated id.
    """
    if exp.ndim != 3 or exp.shape[2] < 2:
        return
    srt = np.sort(exp, axis=2)
    dup = srt[..., 1:] == srt[..., :-1]
    if dup.any():
        v, l, j = (int(x) for x in np.argwhere(dup)[0])
        raise SpecFitInputError(f"{field}[{v}][{l}]", f"names expert id {srt[v, l, j]} twice; a node's experts in "
                                "one layer are a set")


class DraftTree:
    """A draft tree of candidate tokens, stored as numpy arrays indexed by node id.

    Parameters
    ----------
    parents : sequence of int, shape (n,)
        ``parents[0] = -1``, ``0 <= parents[i] < i``.
    path_prob : sequence of float, shape (n,), optional
        Path probability ``P_v`` in [0, 1], ``P_0 = 1``, non-increasing along every path.
    q : sequence of float, shape (n,), optional
        Draft probability of each node's token given its parent path; ``q[0]`` is ignored.
        Give exactly one of ``path_prob`` and ``q``.
    tokens : sequence of int, shape (n,), optional
        Token id of each node (the root's is the last committed token).
    experts : array-like of int, shape (n, L, k), optional
        Predicted target experts of each node in each of the L MoE layers (k ids per layer,
        the same k for every node and layer).
    num_experts : int, optional
        Experts per MoE layer; required with ``experts``; ids must lie in ``[0, num_experts)``.

    Raises
    ------
    SpecFitInputError
        On any broken rule: one root, parents precede children (so acyclic), probabilities
        finite and in [0, 1], ``path_prob[0] == 1`` and non-increasing along paths (a child may
        exceed its parent by at most :data:`PROB_TOL`; it is then lowered to its parent's value),
        expert ids in range, the same k >= 1 in every layer (no ragged or empty lists).

    Notes
    -----
    The tree is mutable in one way only: :meth:`add_level` appends nodes (the engine grows the tree
    one draft level at a time). Derived views and the coverage accounting follow the growth; an
    :class:`~specfit.core.instance.Instance` built on the tree sees the tree as it is when read, so
    do not grow a tree under an instance that is still in use.
    """

    def __init__(self, parents: Sequence[int], *, path_prob=None, q=None, tokens=None,
                 experts=None, num_experts: int | None = None):
        par = validate_parents(parents)
        n = par.shape[0]
        if (path_prob is None) == (q is None):
            raise SpecFitInputError("path_prob", "give exactly one of path_prob and q")
        if q is not None:
            q_arr = check_probabilities(q, "q", n)
            q_arr[0] = 1.0
            pp = np.empty(n)
            pp[0] = 1.0
            for i in range(1, n):
                pp[i] = pp[par[i]] * q_arr[i]
        else:
            pp = check_probabilities(path_prob, "path_prob", n)
            if pp[0] != 1.0:
                raise SpecFitInputError("path_prob[0]", f"must be 1.0 (the root is always committed), got {pp[0]}")
            _check_path_prob(pp[1:], pp[par[1:]], 1)
            # Admitted within PROB_TOL of the parent: clamp to the running minimum so that every
            # consumer (solvers, stop rule, orders by P) sees P non-increasing along paths and any
            # {v : P_v >= t} stays ancestor-closed (SPECFIT.md §3).
            if np.any(pp[1:] > pp[par[1:]]):
                for i in range(1, n):  # parents precede children: one pass
                    pp[i] = min(pp[i], pp[par[i]])
        tok = None
        if tokens is not None:
            tok = as_int_array(tokens, "tokens", 1)
            if tok.shape != (n,):
                raise SpecFitInputError("tokens", f"must have one entry per node ({n}), got {tok.shape[0]}")
        exp = None if experts is None else check_experts(experts, n, num_experts)
        self._parents = par
        self._path_prob = pp
        self._tokens = tok
        self._experts = exp
        self.num_experts = None if num_experts is None else int(num_experts)
        self._items: ItemSets | None = None
        self._read_items: ItemSets | None = None
        self._resident_items: tuple | None = None  # (cache, ItemSets of the routed experts it holds)
        #: Node ids added by the last :meth:`add_level` (empty for a tree built in one go).
        self.last_level: np.ndarray = np.zeros(0, dtype=np.int64)
        #: The caller's node labels, ``labels[v]`` for node v, when built by :meth:`from_networkx`.
        self.labels: list | None = None

    # --- growth -----------------------------------------------------------------------------
    def add_level(self, parents, path_prob, tokens=None, experts=None) -> np.ndarray:
        """Append one draft level: m new nodes whose parents are already in the tree.

        Parameters
        ----------
        parents : sequence of int, shape (m,)
            Parent ids, each in ``[0, n)`` (n: nodes before the call).
        path_prob : sequence of float, shape (m,)
            ``P_v`` of the new nodes, in [0, 1] and at most the parent's.
        tokens : sequence of int, shape (m,), optional
            Required iff the tree has tokens.
        experts : array-like of int, shape (m, L, k), optional
            Required iff the tree has experts; same L and k, ids in ``[0, num_experts)``.

        Returns
        -------
        numpy.ndarray of int64, shape (m,)
            The new node ids (``n .. n + m - 1``), also :attr:`last_level`.

        Raises
        ------
        SpecFitInputError
            Naming the field (``parents[i]``, ``path_prob[i]``, ``tokens``, ``experts[i][l]`` with i a
            new node id) and the rule broken.
        """
        n = self.n
        par = as_int_array(parents, "parents", 1, copy=False)  # concatenated below: a copy anyway
        m = par.shape[0]
        if m and (par.min() < 0 or par.max() >= n):
            i = int(np.flatnonzero((par < 0) | (par >= n))[0])
            raise SpecFitInputError(f"parents[{n + i}]", f"must be an existing node in [0, {n}), got {par[i]}")
        pp_new = check_probabilities(path_prob, "path_prob", m)
        parent_pp = self._path_prob[par]  # parents are existing nodes
        _check_path_prob(pp_new, parent_pp, n)
        pp_new = np.minimum(pp_new, parent_pp)  # admitted near-ties: as in __init__
        if (tokens is None) != (self._tokens is None):
            raise SpecFitInputError("tokens", "give tokens for a level iff the tree has tokens")
        if (experts is None) != (self._experts is None):
            raise SpecFitInputError("experts", "give experts for a level iff the tree has experts")
        tok = None
        if tokens is not None:
            tok = as_int_array(tokens, "tokens", 1, copy=False)
            if tok.shape != (m,):
                raise SpecFitInputError("tokens", f"must have one entry per new node ({m}), got {tok.shape[0]}")
        exp = None
        if experts is not None:
            exp = check_experts(experts, m, self.num_experts, start=n) if m else self._experts[:0]
            if exp.shape[1:] != self._experts.shape[1:]:
                raise SpecFitInputError("experts", f"new nodes must have shape (L, k) = {self._experts.shape[1:]}, "
                                        f"got {exp.shape[1:]}")
        return self.append_level(par, pp_new, tok, exp)

    def append_level(self, parents: np.ndarray, path_prob: np.ndarray, tokens: np.ndarray | None,
                     experts: np.ndarray | None) -> np.ndarray:
        """:meth:`add_level` of arrays already checked (int64 parents in the tree or earlier in these
        arrays, float64 P in [0, 1] at most the parent's, int64 tokens and experts iff the tree has
        them): the engine's path, whose levels come from its own arrays. Several levels may come in one
        call (:attr:`last_level` then holds all their ids)."""
        n = self.n
        ids = np.arange(n, n + parents.shape[0], dtype=np.int64)
        self._parents = np.concatenate([self._parents, parents])
        self._path_prob = np.concatenate([self._path_prob, path_prob])
        if tokens is not None:
            self._tokens = np.concatenate([self._tokens, tokens])
        if experts is not None:
            self._experts = np.concatenate([self._experts, experts])
        self._forget_views()
        if self._items is not None:
            self._items.extend(parents, self._item_experts(n))
        if self._read_items is not None:
            self._read_items.extend(parents, self._item_experts(n))
        if self._resident_items is not None:
            self._resident_items[1].extend(parents, self._item_experts(n))
        self.last_level = ids
        self.labels = None
        return ids

    @classmethod
    def of_arrays(cls, parents: np.ndarray, path_prob: np.ndarray, tokens: np.ndarray | None,
                  experts: np.ndarray | None, num_experts: int | None) -> "DraftTree":
        """A tree of arrays already in internal form and valid, without the constructor's checks
        (a subtree of a valid tree, the engine's root)."""
        tree = cls.__new__(cls)
        tree._parents, tree._path_prob, tree._tokens, tree._experts = parents, path_prob, tokens, experts
        tree.num_experts = None if num_experts is None else int(num_experts)
        tree._items = None
        tree._read_items = None
        tree._resident_items = None
        tree.last_level = np.zeros(0, dtype=np.int64)
        tree.labels = None
        return tree

    def set_experts(self, experts) -> None:
        """Replace the experts of every node (shape (n, L, k), e.g. the true routing for the oracle);
        the coverage accounting is rebuilt on the next :meth:`items` call.

        Raises
        ------
        SpecFitInputError
            If the shape does not match the tree or an id is out of range.
        """
        self._experts = check_experts(experts, self.n, self.num_experts)
        self._items = None
        self._read_items = None
        self._resident_items = None

    def _forget_views(self) -> None:
        for name in ("depth", "children", "ancestor_mask"):
            self.__dict__.pop(name, None)

    def _item_experts(self, start: int = 0) -> np.ndarray:
        if self._experts is None:
            return np.zeros((self.n - start, 0, 0), dtype=np.int64)
        return self._experts[start:]

    # --- coverage accounting ------------------------------------------------------------------
    def items(self, cache: np.ndarray) -> ItemSets:
        """The per-node uncached-item bitsets of this tree against ``cache`` (:class:`ItemSets`).

        Computed once for a given cache array (compared by identity) and extended by
        :meth:`add_level`, so a tree grown level by level is accounted for once.

        Parameters
        ----------
        cache : numpy.ndarray of bool, shape (L, num_experts)
            Do not modify it in place while the tree uses it.
        """
        if self._items is None or self._items.cache is not cache:
            items = ItemSets(cache)
            items.extend(self._parents, self._item_experts())
            self._items = items
        return self._items

    def read_items(self) -> ItemSets:
        """The per-node bitsets of *every* expert each node routes to (:class:`ItemSets` against an empty
        cache): the experts a verify reads from device memory, resident or not (SPECFIT.md §3, the
        ``read_ms`` term). Computed once and extended by :meth:`add_level`, like :meth:`items`."""
        if self._read_items is None:
            L, E = self.num_layers, self.num_experts or 0
            items = ItemSets(np.zeros((L, E), dtype=bool))
            items.extend(self._parents, self._item_experts())
            self._read_items = items
        return self._read_items

    def resident_items(self, cache: np.ndarray) -> ItemSets:
        """The per-node bitsets of the routed experts that ``cache`` *holds* (:class:`ItemSets` against the
        complement of the cache): the resident experts a verify reads without a copy (SPECFIT.md §3, the
        ``read_ms`` term). Computed once per cache array (compared by identity) and extended by
        :meth:`add_level`, like :meth:`items`."""
        if self._resident_items is None or self._resident_items[0] is not cache:
            items = ItemSets(~np.asarray(cache, dtype=bool))
            items.extend(self._parents, self._item_experts())
            self._resident_items = (cache, items)
        return self._resident_items[1]

    # --- basic data -------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._parents.shape[0])

    @property
    def n(self) -> int:
        """Number of nodes, root included."""
        return len(self)

    @property
    def parents(self) -> np.ndarray:
        """Parents array, int64 of shape (n,), ``parents[0] = -1``."""
        return self._parents

    @property
    def path_prob(self) -> np.ndarray:
        """Path probabilities ``P_v``, float64 of shape (n,)."""
        return self._path_prob

    @property
    def q(self) -> np.ndarray:
        """Draft probabilities ``q_v = P_v / P_parent(v)``, float64 of shape (n,), ``q_0 = 1`` (0 under a
        parent of probability 0)."""
        par, pp = self._parents, self._path_prob
        safe = np.where(pp[par[1:]] > 0, pp[par[1:]], 1.0)
        return np.concatenate([[1.0], np.where(pp[par[1:]] > 0, pp[1:] / safe, 0.0)])

    @property
    def tokens(self) -> np.ndarray | None:
        """Token ids, int64 of shape (n,), or None."""
        return self._tokens

    @property
    def experts(self) -> np.ndarray | None:
        """Predicted experts, int64 of shape (n, L, k), or None."""
        return self._experts

    @property
    def num_layers(self) -> int:
        """L, the number of MoE layers with predicted experts (0 without experts)."""
        return 0 if self._experts is None else int(self._experts.shape[1])

    # --- derived views, computed once per size -------------------------------------------------
    @cached_property
    def depth(self) -> np.ndarray:
        """Depth of each node (root 0), int64 of shape (n,)."""
        par = self._parents.tolist()  # list indexing: several times cheaper than numpy scalars
        d = [0] * len(par)
        for i in range(1, len(par)):
            d[i] = d[par[i]] + 1
        return np.array(d, dtype=np.int64)

    @cached_property
    def children(self) -> list[list[int]]:
        """``children[v]``: the children of v in increasing index order."""
        par = self._parents.tolist()
        ch: list[list[int]] = [[] for _ in par]
        for i in range(1, len(par)):
            ch[par[i]].append(i)
        return ch

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """Bool array of shape (n, n): ``mask[i, j]`` is True iff j is i or an ancestor of i.

        This is the tree-attention mask of a verify forward (each node attends to its root path).
        """
        m = np.zeros((self.n, self.n), dtype=bool)
        m[0, 0] = True
        for i in range(1, self.n):
            m[i] = m[self._parents[i]]
            m[i, i] = True
        return m

    def is_ancestor_closed(self, nodes: Iterable[int]) -> bool:
        """True iff ``nodes`` contains the root and, with every node, its parent."""
        s, n = set(map(int, nodes)), self.n
        if 0 not in s or not all(0 <= v < n for v in s):
            return False
        par = self._parents.tolist()  # list lookups: the solvers' every selection comes through here
        return all(v == 0 or par[v] in s for v in s)

    def subtree(self, nodes: Iterable[int]) -> tuple["DraftTree", np.ndarray]:
        """Extract the ancestor-closed subtree on ``nodes``.

        Returns
        -------
        tree : DraftTree
            The subtree, renumbered in increasing order of the old ids (so still topological).
        old_ids : numpy.ndarray of int64, shape (m,)
            ``old_ids[new] = old``.

        Raises
        ------
        SpecFitInputError
            If ``nodes`` is not ancestor-closed (it must hold the root and every node's parent).
        """
        keep = np.array(sorted(set(int(v) for v in nodes)), dtype=np.int64)
        if not self.is_ancestor_closed(keep):
            raise SpecFitInputError("nodes", "must be ancestor-closed: contain the root and every node's parent")
        new_of = np.full(self.n, -1, dtype=np.int64)
        new_of[keep] = np.arange(keep.shape[0])
        par = np.concatenate([[-1], new_of[self._parents[keep[1:]]]])
        sub = DraftTree.of_arrays(par.astype(np.int64, copy=False), self._path_prob[keep],
                                   None if self._tokens is None else self._tokens[keep],
                                   None if self._experts is None else self._experts[keep], self.num_experts)
        if self.labels is not None:
            sub.labels = [self.labels[int(o)] for o in keep]
        return sub, keep

    # --- networkx interchange -----------------------------------------------------------------
    def to_networkx(self) -> nx.DiGraph:
        """The tree as a ``DiGraph`` with edges parent → child.

        Nodes are :attr:`labels` when the tree came from :meth:`from_networkx`, else the ids 0..n-1.
        Node attributes: ``path_prob`` (float), ``token`` (int, when the tree has tokens) and
        ``experts`` (when it has experts: ``experts[l]`` is the list of expert ids of MoE layer l).
        Graph attribute ``num_experts`` when known. ``DraftTree.from_networkx(t.to_networkx())``
        gives back the same arrays.
        """
        label = self.labels if self.labels is not None else list(range(self.n))
        g = nx.DiGraph()
        if self.num_experts is not None:
            g.graph["num_experts"] = self.num_experts
        for v in range(self.n):
            attrs = {"path_prob": float(self._path_prob[v])}
            if self._tokens is not None:
                attrs["token"] = int(self._tokens[v])
            if self._experts is not None:
                attrs["experts"] = self._experts[v].tolist()
            g.add_node(label[v], **attrs)
        g.add_edges_from((label[int(p)], label[v]) for v, p in enumerate(self._parents) if p >= 0)
        return g

    @classmethod
    def from_networkx(cls, graph: nx.DiGraph, num_experts: int | None = None) -> "DraftTree":
        """Build a draft tree from a networkx ``DiGraph`` (edges parent → child).

        Parameters
        ----------
        graph : networkx.DiGraph
            A rooted tree; node labels may be any hashable. Node attributes: ``path_prob`` (float in
            [0, 1], 1 at the root, required), ``token`` (int; on every node or on none), ``experts``
            (on every node or on none: ``experts[l]`` is the list of the k expert ids the node routes
            to in MoE layer l, the same L and k on every node).
        num_experts : int, optional
            Experts per MoE layer; default ``graph.graph["num_experts"]``; required with experts.

        Returns
        -------
        DraftTree
            Nodes numbered breadth-first from the root (children in the graph's order), so parents
            precede children; :attr:`labels` maps each node id back to the graph's label.

        Raises
        ------
        SpecFitInputError
            Field ``graph`` if it is not a directed graph, is empty, has a cycle, has no root or
            several roots, or a node has two parents; ``graph.nodes[<label>].<attribute>`` for a
            missing or bad node attribute.
        """
        if not isinstance(graph, nx.DiGraph) or isinstance(graph, nx.MultiDiGraph):
            raise SpecFitInputError("graph", f"must be a networkx.DiGraph (edges parent -> child), got "
                                    f"{type(graph).__name__}")
        if graph.number_of_nodes() == 0:
            raise SpecFitInputError("graph", "must contain at least the root")
        if not nx.is_directed_acyclic_graph(graph):
            cycle = nx.find_cycle(graph)
            raise SpecFitInputError("graph", f"must be a tree, found a cycle through node {cycle[0][0]!r}")
        two = [v for v, d in graph.in_degree() if d > 1]
        if two:
            raise SpecFitInputError(f"graph.nodes[{two[0]!r}]", f"has {graph.in_degree(two[0])} parents; "
                                    "in a draft tree every node but the root has one")
        roots = [v for v, d in graph.in_degree() if d == 0]
        if len(roots) != 1:
            raise SpecFitInputError("graph", f"must have exactly one root (a node without parent), got {len(roots)}: "
                                    f"{roots[:5]!r}")
        labels = [roots[0]]
        parents = [-1]
        for i in range(graph.number_of_nodes()):
            for child in graph.successors(labels[i]):
                labels.append(child)
                parents.append(i)

        def column(key: str, required: bool) -> list | None:
            have = [key in graph.nodes[v] for v in labels]
            if not any(have) and not required:
                return None
            if not all(have):
                v = labels[have.index(False)]
                rule = "is required" if required else f"is missing: give {key} on every node or on none"
                raise SpecFitInputError(f"graph.nodes[{v!r}].{key}", rule)
            return [graph.nodes[v][key] for v in labels]

        pp = column("path_prob", True)
        for v, p in zip(labels, pp):
            if isinstance(p, bool) or not isinstance(p, (int, float, np.floating, np.integer)):
                raise SpecFitInputError(f"graph.nodes[{v!r}].path_prob", f"must be a number in [0, 1], got {p!r}")
        tokens = column("token", False)
        experts = column("experts", False)
        if experts is not None:
            arrays = [_node_experts(v, e) for v, e in zip(labels, experts)]
            for v, arr in zip(labels, arrays):
                if arr.shape != arrays[0].shape:
                    raise SpecFitInputError(f"graph.nodes[{v!r}].experts", "must be a list of L lists of k expert ids "
                                            f"(experts[l] for MoE layer l), the same L and k on every node: the "
                                            f"root's has shape {arrays[0].shape}, this one {arr.shape}")
            experts = np.stack(arrays)
        if num_experts is None:
            num_experts = graph.graph.get("num_experts")
        try:
            tree = cls(parents, path_prob=pp, tokens=tokens, experts=experts, num_experts=num_experts)
            if tree.experts is not None:
                check_distinct_experts(tree.experts)
        except SpecFitInputError as exc:
            m = _INDEXED.match(exc.field)
            if m is None:
                raise
            key = {"tokens": "token"}.get(m.group(1), m.group(1))
            raise SpecFitInputError(f"graph.nodes[{labels[int(m.group(2))]!r}].{key}{m.group(3)}", exc.rule) from None
        tree.labels = labels
        return tree

    def __repr__(self) -> str:
        return f"DraftTree(n={self.n}, depth={int(self.depth.max())}, layers={self.num_layers})"


def _node_experts(label, experts) -> np.ndarray:
    """One node's ``experts`` attribute as an int array of shape (L, k); ``[]`` means L = 0."""
    try:
        arr = np.asarray(experts)
    except ValueError:  # ragged lists
        arr = np.zeros(0, dtype=object)
    if arr.ndim == 1 and arr.size == 0 and arr.dtype != object:
        arr = arr.reshape(0, 0)
    if arr.dtype == object or arr.ndim != 2:
        raise SpecFitInputError(f"graph.nodes[{label!r}].experts", "must be a list of L lists of k expert ids "
                                "(experts[l] for MoE layer l), the same L and k on every node")
    return arr


#: A per-node field name of a validation error, e.g. ``experts[3][1]``: (array, node, rest).
_INDEXED = re.compile(r"^(path_prob|tokens|experts)\[(\d+)\](.*)$")

