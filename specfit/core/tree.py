"""Draft trees: the rooted trees of candidate tokens that speculative decoding verifies.

A :class:`DraftTree` stores the tree as a networkx ``DiGraph`` (edges parent → child) with the
node data the rest of SpecFit needs, and exposes derived array views (parents, depth, ancestor
mask, position ids) computed once.

Conventions (SPECFIT.md §2): node 0 is the root, the last committed token, always verified;
nodes are numbered in topological order, ``parents[i] < i`` and ``parents[0] = -1``.
The path probability of node v is the product of the draft probabilities q along the root → v
path, ``P_root = 1`` (EAGLE-2, Li et al. 2024, §4 keeps ``log P`` as the node "score").
"""

from __future__ import annotations

from functools import cached_property
from typing import Iterable, Sequence

import networkx as nx
import numpy as np

from specfit.core.errors import SpecFitInputError

#: Slack allowed when checking that path probabilities do not increase along a path.
PROB_TOL = 1e-9


def _as_int_array(values, field: str, ndim: int) -> np.ndarray:
    try:
        arr = np.asarray(values)
    except ValueError as exc:  # numpy refuses ragged nested lists
        raise SpecFitInputError(field, f"must be a rectangular array ({exc})") from None
    if arr.dtype == object:
        raise SpecFitInputError(field, "must be a rectangular array of integers (ragged lists)")
    if arr.size == 0 and arr.ndim < ndim:
        arr = arr.reshape((0,) * ndim)
    if arr.ndim != ndim:
        raise SpecFitInputError(field, f"must have {ndim} dimension(s), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise SpecFitInputError(field, "must contain integers")
    return arr.astype(np.int64)


def _as_prob_array(values, field: str, n: int) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise SpecFitInputError(field, "must be a list of numbers") from None
    if arr.shape != (n,):
        raise SpecFitInputError(field, f"must have one entry per node ({n}), got shape {arr.shape}")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise SpecFitInputError(f"{field}[{bad[0]}]", "must be finite (got NaN or infinity)")
    bad = np.flatnonzero((arr < 0.0) | (arr > 1.0))
    if bad.size:
        raise SpecFitInputError(f"{field}[{bad[0]}]", f"must lie in [0, 1], got {arr[bad[0]]!r}")
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
    arr = _as_int_array(parents, "parents", 1)
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


class DraftTree:
    """A draft tree of candidate tokens over a networkx ``DiGraph``.

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
    Node attributes in :attr:`graph`: ``token``, ``q``, ``path_prob``, ``depth`` and, when given,
    ``experts`` (int array of shape (L, k)).
    """

    def __init__(self, parents: Sequence[int], *, path_prob=None, q=None, tokens=None,
                 experts=None, num_experts: int | None = None):
        par = validate_parents(parents)
        n = par.shape[0]
        if (path_prob is None) == (q is None):
            raise SpecFitInputError("path_prob", "give exactly one of path_prob and q")
        if q is not None:
            q_arr = _as_prob_array(q, "q", n)
            q_arr[0] = 1.0
            pp = np.empty(n)
            pp[0] = 1.0
            for i in range(1, n):
                pp[i] = pp[par[i]] * q_arr[i]
        else:
            pp = _as_prob_array(path_prob, "path_prob", n)
            if pp[0] != 1.0:
                raise SpecFitInputError("path_prob[0]", f"must be 1.0 (the root is always committed), got {pp[0]}")
            up = np.flatnonzero(pp[1:] > pp[par[1:]] + PROB_TOL) + 1
            if up.size:
                i = int(up[0])
                raise SpecFitInputError(f"path_prob[{i}]", f"must not exceed its parent's ({pp[par[i]]}), got {pp[i]}: "
                                        "path probabilities are products of q <= 1")
            # Admitted within PROB_TOL of the parent: clamp to the running minimum so that every
            # consumer (solvers, stop rule, orders by P) sees P non-increasing along paths and any
            # {v : P_v >= t} stays ancestor-closed (SPECFIT.md §3).
            if np.any(pp[1:] > pp[par[1:]]):
                for i in range(1, n):  # parents precede children: one pass
                    pp[i] = min(pp[i], pp[par[i]])
            safe = np.where(pp[par[1:]] > 0, pp[par[1:]], 1.0)
            q_arr = np.concatenate([[1.0], np.where(pp[par[1:]] > 0, pp[1:] / safe, 0.0)])
        tok = None
        if tokens is not None:
            tok = _as_int_array(tokens, "tokens", 1)
            if tok.shape != (n,):
                raise SpecFitInputError("tokens", f"must have one entry per node ({n}), got {tok.shape[0]}")
        exp = None
        if experts is not None:
            exp = _as_int_array(experts, "experts", 3)
            if exp.shape[0] != n:
                raise SpecFitInputError("experts", f"must have one entry per node ({n}), got {exp.shape[0]}")
            if num_experts is None:
                raise SpecFitInputError("num_experts", "is required when experts are given")
            if int(num_experts) < 1:
                raise SpecFitInputError("num_experts", f"must be >= 1, got {num_experts}")
            if exp.shape[1] and not exp.shape[2]:
                raise SpecFitInputError("experts", "each node routes to at least one expert per MoE layer; "
                                        "got empty expert lists")
            bad = np.argwhere((exp < 0) | (exp >= num_experts))
            if bad.size:
                v, l, j = (int(x) for x in bad[0])
                raise SpecFitInputError(f"experts[{v}][{l}]", f"expert id {exp[v, l, j]} is out of range [0, {num_experts})")
        self._parents = par
        self._path_prob = pp
        self._q = q_arr
        self._tokens = tok
        self._experts = exp
        self.num_experts = None if num_experts is None else int(num_experts)

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
        """Draft probabilities ``q_v = P_v / P_parent(v)``, float64 of shape (n,), ``q_0 = 1``."""
        return self._q

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

    # --- derived views, computed once ------------------------------------------------------
    @cached_property
    def graph(self) -> nx.DiGraph:
        """The tree as a ``DiGraph`` with edges parent → child and the node attributes above."""
        g = nx.DiGraph()
        for v in range(self.n):
            attrs = {"q": float(self._q[v]), "path_prob": float(self._path_prob[v]), "depth": int(self.depth[v]),
                     "token": None if self._tokens is None else int(self._tokens[v])}
            if self._experts is not None:
                attrs["experts"] = self._experts[v]
            g.add_node(v, **attrs)
        g.add_edges_from((int(p), v) for v, p in enumerate(self._parents) if p >= 0)
        return g

    @cached_property
    def depth(self) -> np.ndarray:
        """Depth of each node (root 0), int64 of shape (n,)."""
        d = np.zeros(self.n, dtype=np.int64)
        for i in range(1, self.n):
            d[i] = d[self._parents[i]] + 1
        return d

    @cached_property
    def children(self) -> list[list[int]]:
        """``children[v]``: the children of v in increasing index order."""
        ch: list[list[int]] = [[] for _ in range(self.n)]
        for i in range(1, self.n):
            ch[int(self._parents[i])].append(i)
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

    def position_ids(self, prefix_len: int) -> np.ndarray:
        """Position ids of the nodes when ``prefix_len`` tokens precede the root in the KV cache.

        The root (the last committed token, not yet in the target's KV cache) sits at
        ``prefix_len`` and node v at ``prefix_len + depth[v]``; int64, shape (n,). The
        flattened index is wrong for branching trees (PITFALLS.md, tree attention).

        Raises
        ------
        SpecFitInputError
            If ``prefix_len < 0``.
        """
        if prefix_len < 0:
            raise SpecFitInputError("prefix_len", f"must be >= 0, got {prefix_len}")
        return prefix_len + self.depth

    def paths(self) -> list[list[int]]:
        """All root-to-leaf paths, each a list of node ids starting with 0."""
        out = []
        for leaf in range(self.n):
            if not self.children[leaf]:
                path = [leaf]
                while path[-1] != 0:
                    path.append(int(self._parents[path[-1]]))
                out.append(path[::-1])
        return out

    def root_path(self, v: int) -> list[int]:
        """Node ids on the path root → v, inclusive."""
        path = [int(v)]
        while path[-1] != 0:
            path.append(int(self._parents[path[-1]]))
        return path[::-1]

    def is_ancestor_closed(self, nodes: Iterable[int]) -> bool:
        """True iff ``nodes`` contains the root and, with every node, its parent."""
        s = set(int(v) for v in nodes)
        return 0 in s and all(0 <= v < self.n for v in s) and all(v == 0 or int(self._parents[v]) in s for v in s)

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
        new_of = {int(o): i for i, o in enumerate(keep)}
        par = [-1] + [new_of[int(self._parents[o])] for o in keep[1:]]
        sub = DraftTree(par, path_prob=self._path_prob[keep],
                        tokens=None if self._tokens is None else self._tokens[keep],
                        experts=None if self._experts is None else self._experts[keep],
                        num_experts=self.num_experts)
        return sub, keep

    def __repr__(self) -> str:
        return f"DraftTree(n={self.n}, depth={int(self.depth.max())}, layers={self.num_layers})"
