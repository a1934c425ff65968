"""Expert predictors: which experts will the target route each draft node to, per MoE layer?

The selector (SPECFIT.md §3) needs E[v][l], the experts of node v in MoE layer l, before the target
has seen node v. A predictor returns exactly ``k`` distinct expert ids per node and layer (``k`` =
the target's top-k); the engine reports the true routing of committed tokens after each cycle
(:meth:`ExpertPredictor.observe`) and asks for new draft nodes (:meth:`ExpertPredictor.predict`).

Predictors (registry :func:`get_predictor`):

* ``recency`` — context: per layer, the k experts used most by the last W observed tokens (ties:
  most recently used, then the prior order). MoE routing is temporally local (Eliseev & Mazur 2023,
  "Fast Inference of Mixture-of-Experts Language Models with Offloading", §3.1 — LRU caching works
  because consecutive tokens reuse experts).
* ``frequency`` — per-(layer, token id) frequency tables from a recorded trace, smoothed towards the
  layer's global frequency (unseen tokens get the global frequency), optionally blended with the
  recency context. Routing depends strongly on the token id, most of all in early layers.
* ``probe`` — a linear probe per layer on the draft hidden state (softmax over E experts, top-k at
  prediction), trained on recorded routing with :func:`train_probe`; optionally blended with the
  frequency tables (``frequency_weight``). Nodes without a hidden state fall back to ``frequency``
  (when blended) or ``recency``.

Everything here is numpy at the interface; torch is used only inside :func:`train_probe`.
"""

from __future__ import annotations

import os
from typing import Callable, Protocol

import numpy as np

from specfit.models.traces import RoutingTrace, check_hidden, check_routing, check_tokens, routing_array, save_npz
from specfit.core.errors import SpecFitInputError, check_positive_int


class ExpertPredictor(Protocol):
    """What the engine calls (all arrays numpy; L = MoE layers, k = the target's top-k)."""

    name: str
    #: Whether :meth:`predict` reads ``draft_hidden`` (optional; the engine assumes True when absent). A
    #: predictor that never does lets the engine skip gathering the head's hidden states per draft level.
    uses_hidden: bool
    #: Whether :meth:`predict` always returns a numpy int64 array of shape (m, L, k), ids in [0, E)
    #: (optional; the engine assumes False when absent). The engine checks every other predictor's
    #: output (:func:`specfit.core.tree.check_experts`) on each call; the built-in predictors set it, and
    #: tests/models/test_predictors.py holds them to it.
    valid_output: bool

    def reset(self) -> None:
        """A new prompt begins: drop the per-prompt context."""

    def observe(self, tokens: np.ndarray, routing: np.ndarray, draft_hidden: np.ndarray | None) -> None:
        """True routing (T, L, k) of committed tokens (T,), reported after each cycle."""

    def predict(self, tokens: np.ndarray, draft_hidden: np.ndarray | None) -> np.ndarray:
        """Experts (m, L, k) int64 of m new draft nodes: k distinct ids per layer."""

    # Optional: ``observe_and_predict(observed, routing, tokens, draft_hidden)``, :meth:`observe` then
    # :meth:`predict` in one call (the engine uses it when present; :class:`FrequencyPredictor` has it).


# -- metric ------------------------------------------------------------------------------------------
def recall_at_k(pred, true) -> np.ndarray:
    """Mean fraction of the true experts that the prediction contains, per layer.

    ``recall@k[l] = mean_v |pred[v, l] ∩ true[v, l]| / k`` (sets; the prediction has k ids too, so
    this is also precision@k).

    Parameters
    ----------
    pred : array_like
        (m, L, k) predicted expert ids.
    true : array_like
        (m, L, k) true expert ids (the target's top-k routing).

    Returns
    -------
    numpy.ndarray
        (L,) float64 in [0, 1].

    Raises
    ------
    SpecFitInputError
        If the shapes differ, are not (m, L, k) with m >= 1, or a row repeats an id or holds a
        negative id (fields ``pred`` / ``true``).
    """
    p = check_routing(pred, field="pred")
    t = check_routing(true, field="true")
    if p.shape != t.shape:
        raise SpecFitInputError("pred", f"must have the shape of true {t.shape}, got {p.shape}")
    if p.shape[0] == 0:
        raise SpecFitInputError("pred", "must contain at least one node")
    hits = (p[..., :, None] == t[..., None, :]).any(-1).sum(-1)  # (m, L); ids are distinct per row
    return hits.mean(axis=0) / p.shape[2]


# -- helpers -----------------------------------------------------------------------------------------
def top_k_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest scores along the last axis, best first; ties → lower id (stable).

    Exactly ``np.argsort(-scores, axis=-1, kind="stable")[..., :k]`` as int64 (NaN ranks below
    every number, as in that sort), much cheaper over 128 experts: a row's k-th largest score comes
    from a plain sort (``np.sort`` is ~3× faster than ``argpartition``), the scores at or above it
    are the row's top k when there are exactly k of them (their ids come out ascending), and only
    those k are ordered by a stable argsort. Rows where a tie straddles the k-th place, or holding
    NaN, fall back to the full stable argsort. (16, 6, 128) scores, k = 8: ~60 µs against ~150 µs
    for an argpartition version and ~400 µs for the full stable argsort (2-vCPU VM, numpy 2.4).

    Parameters
    ----------
    scores : array_like
        (..., E) real scores (e.g. (m, L, E) per draft node and MoE layer).
    k : int
        How many ids per row (``k >= E`` gives the full order).

    Returns
    -------
    numpy.ndarray
        (..., min(k, E)) int64 ids, best first.
    """
    s = np.asarray(scores)
    E = s.shape[-1]
    if not 0 < k < E or s.size == 0:
        return np.argsort(-s, axis=-1, kind="stable")[..., :k].astype(np.int64)
    rows = s.reshape(-1, E)
    ranked = np.sort(rows, axis=-1)  # ascending, NaN last
    top = rows >= ranked[:, -k, None]  # the scores at or above each row's k-th largest
    flat = np.flatnonzero(top)
    nan = np.isnan(ranked[:, -1]) if ranked.dtype.kind == "f" else np.zeros(len(rows), bool)
    exact, kept = ~nan, rows
    if nan.any() or len(flat) != len(rows) * k:  # without NaN every row holds k or more
        exact &= top.sum(axis=-1) == k
        kept, flat = rows[exact], np.flatnonzero(top[exact])
    order = np.argsort(-kept.ravel()[flat].reshape(-1, k), axis=-1, kind="stable")  # ids ascend per row
    best = flat[order + np.arange(0, len(flat), k)[:, None]] % E
    if kept is not rows:
        out = np.empty((len(rows), k), np.int64)
        out[exact], out[~exact] = best, np.argsort(-rows[~exact], axis=-1, kind="stable")[:, :k]
        best = out
    return best.astype(np.int64, copy=False).reshape(s.shape[:-1] + (k,))


def _check_dims(num_layers, num_experts, top_k) -> tuple[int, int, int]:
    L, E, k = (check_positive_int("num_layers", num_layers), check_positive_int("num_experts", num_experts),
               check_positive_int("top_k", top_k))
    if k > E:
        raise SpecFitInputError("top_k", f"must be <= num_experts ({E}), got {k}")
    return L, E, k


def global_counts(trace: RoutingTrace) -> np.ndarray:
    """(L, E) float64: how often each expert is routed to in each layer over the whole trace."""
    r = trace.routing
    L = r.shape[1]
    out = np.zeros((L, trace.num_experts))
    for l in range(L):
        out[l] = np.bincount(r[:, l].ravel(), minlength=trace.num_experts)
    return out


_INT64 = np.dtype(np.int64)


def _is_kernel_array(a, ndim: int) -> bool:
    """True iff ``a`` is a writable C-contiguous int64 numpy array of ``ndim`` dimensions (what the kernels
    are compiled for: :func:`specfit.core.kernels.kernel_array`). Per predictor call in a drafted cycle,
    right after a forward: one flags object, the dtype compared as a dtype (no conversion of ``np.int64``)."""
    if type(a) is not np.ndarray or a.ndim != ndim or a.dtype != _INT64:
        return False
    flags = a.flags
    return flags.c_contiguous and flags.writeable


def _token_ids(tokens, field: str) -> np.ndarray:
    """Token ids as a kernel's int64 (T,) array, for a kernel that checks their signs itself: ``tokens`` when
    it is one, else :func:`check_tokens`' array (errors name ``field``), copied if need be."""
    if _is_kernel_array(tokens, 1):
        return tokens
    from specfit.core.kernels import kernel_array

    return kernel_array(check_tokens(tokens, field=field), np.int64)


#: The window push's error codes (:func:`specfit.core.kernels._frequency_observe_top_k`) as (field, rule),
#: given the number of experts.
_OBSERVE_ERRORS = {
    1: lambda E: ("routing", f"expert ids must lie in [0, {E})"),
    2: lambda E: ("routing", "each (token, layer) row must list k distinct experts"),
    3: lambda E: ("observed", "token ids must be non-negative"),
    4: lambda E: ("tokens", "token ids must be non-negative"),
}


class _Window:
    """The routing of the last W observed tokens: per-layer counts and last-use step.

    ``counts[l, e]``: uses of expert e of layer l by the window's tokens; ``last[l, e]``: the step (0 for
    the first token observed) of its last use, -1 if never; ``step``: tokens observed; ``size``: tokens
    in the window (at most W), kept oldest first in a ring of W rows from ``head``. One compiled call
    checks and pushes a batch (:func:`specfit.core.kernels.window_push_kernel`)."""

    def __init__(self, L: int, E: int, k: int, window: int):
        self.L, self.E, self.k, self.W = L, E, k, check_positive_int("window", window)
        from specfit.core.kernels import window_push_kernel

        window_push_kernel()  # compiled (or loaded from numba's cache) here: no decoding cycle pays it
        self.reset()

    def observe(self, tokens, routing) -> None:
        """Validate the committed tokens (T,) and their true routing (T, L, k), then push it (nothing is
        pushed if any check fails)."""
        r = routing_array(routing, copy=False)  # its ids: checked by the push (which only reads it)
        if r.shape[1:] != (self.L, self.k):
            raise SpecFitInputError("routing", f"must have shape (T, {self.L}, {self.k}), got {r.shape}")
        check_tokens(tokens, r.shape[0])
        self.push(r)

    def reset(self) -> None:
        self.ring = np.zeros((self.W, self.L, self.k), np.int64)
        self.size = self.head = self.step = 0
        self.counts = np.zeros((self.L, self.E), np.int64)
        self.last = np.full((self.L, self.E), -1, np.int64)

    def push(self, routing) -> None:
        """Push (T, L, k) routing rows, as if one at a time (checked as :func:`check_routing` checks)."""
        from specfit.core.kernels import window_push_kernel

        r = np.ascontiguousarray(routing, dtype=np.int64)
        self.size, self.head, self.step, error = window_push_kernel()(self.counts, self.last, self.ring, self.size,
                                                                      self.head, self.step, r, self.E)
        if error:
            raise SpecFitInputError(*_OBSERVE_ERRORS[error](self.E))

    def share(self) -> np.ndarray:
        """(L, E) fraction of the window's token slots that used each expert (0 when empty)."""
        return self.counts / (self.size * self.k) if self.size else np.zeros((self.L, self.E))


# -- (a) recency -------------------------------------------------------------------------------------
class RecencyPredictor:
    """Per layer, the k experts used most by the last ``window`` observed tokens.

    Every node of a cycle gets the same prediction (the context does not depend on the node).
    Order: count in the window, then most recent use, then the prior order. Before any
    observation (and to fill layers whose window holds fewer than k experts) the prior decides:
    ``prior`` counts (L, E) when given (e.g. :func:`global_counts` of a trace), else experts
    0..k-1.

    Parameters
    ----------
    num_layers, num_experts, top_k : int
        L, E, k of the target.
    window : int
        W, observed tokens remembered (default 32, a few cycles of committed tokens).
    prior : array_like, optional
        (L, E) finite scores for the fallback order (larger first).
    """

    name = "recency"
    uses_hidden = False
    valid_output = True

    def __init__(self, num_layers: int, num_experts: int, top_k: int, window: int = 32, prior=None):
        self.L, self.E, self.k = _check_dims(num_layers, num_experts, top_k)
        self.window = _Window(self.L, self.E, self.k, window)
        if prior is None:
            prior = np.tile(-np.arange(self.E, dtype=np.float64), (self.L, 1))  # 0..k-1 first
        prior = np.asarray(prior, dtype=np.float64)
        if prior.shape != (self.L, self.E) or not np.isfinite(prior).all():
            raise SpecFitInputError("prior", f"must be finite with shape ({self.L}, {self.E}), got {prior.shape}")
        # rank 0 = worst, E-1 = best (ties → lower id first)
        self._prior_rank = np.empty((self.L, self.E), np.int64)
        np.put_along_axis(self._prior_rank, top_k_ids(prior, self.E), np.arange(self.E - 1, -1, -1)[None], axis=1)
        self._top = None  # (L, k) prediction of the current context, until the next observe

    def reset(self) -> None:
        """Forget the observed context."""
        self.window.reset()
        self._top = None

    def observe(self, tokens, routing, draft_hidden=None) -> None:
        """Append the true routing (T, L, k) of committed tokens (T,) to the window."""
        self.window.observe(tokens, routing)
        self._top = None

    def scores(self) -> np.ndarray:
        """(L, E) int64 keys, larger = predicted first (count, then last use, then prior)."""
        w = self.window
        return (w.counts * (w.step + 1) + (w.last + 1)) * self.E + self._prior_rank

    def predict(self, tokens, draft_hidden=None) -> np.ndarray:
        """(m, L, k) int64: the same top-k per layer for every node."""
        m = check_tokens(tokens).shape[0]
        if self._top is None:
            self._top = top_k_ids(self.scores(), self.k)
        return np.broadcast_to(self._top, (m, self.L, self.k)).copy()


# -- (b) frequency tables ----------------------------------------------------------------------------
class FrequencyPredictor:
    """Per-(layer, token id) expert frequencies from a recorded trace.

    For a token seen ``n_t`` times, with counts ``c_t[l, e]`` and the layer's global expert share
    ``g[l, e]`` (sums to 1 over e), the score is the additively smoothed share

        s[l, e] = (c_t[l, e] / k + a * g[l, e]) / (n_t + a) + β * w[l, e]

    with smoothing strength ``a`` (an unseen token gets ``g``) and ``w`` the recency window's expert
    share (β = ``recency_weight``; 0 disables the blend). Ties go to the globally more frequent
    expert. Build it with :func:`build_frequency`.

    Parameters
    ----------
    token_ids : array_like
        (n,) distinct token ids with a table row.
    table : array_like
        (n, L, E) routing counts of those tokens.
    token_counts : array_like
        (n,) occurrences of each token.
    global_share : array_like
        (L, E) g, rows summing to 1.
    top_k : int
    smoothing : float
        a >= 0 (default 1).
    recency_weight : float
        β >= 0 (default 0.5: on the proxy target, chosen on a validation split of the build
        prompts, it adds about one point of recall@8 over 0: BENCHMARKS.md, "Expert predictors").
    window : int
        Recency window W (default 32).
    """

    name = "frequency"
    uses_hidden = False
    valid_output = True

    def __init__(self, token_ids, table, token_counts, global_share, top_k: int, smoothing: float = 1.0,
                 recency_weight: float = 0.5, window: int = 32):
        g = np.array(global_share, dtype=np.float64, order="C")  # C layout, as its kernels read it (and _pseudo)
        if g.ndim != 2:
            raise SpecFitInputError("global_share", f"must have shape (L, E), got {g.shape}")
        self.L, self.E, self.k = _check_dims(g.shape[0], g.shape[1], top_k)
        ids = check_tokens(token_ids, field="token_ids")
        table = np.array(table, dtype=np.float32, order="C")  # one layout (and writable): one compiled predict
        if table.shape != (len(ids), self.L, self.E):
            raise SpecFitInputError("table", f"must have shape ({len(ids)}, {self.L}, {self.E}), got {table.shape}")
        for field, v in (("smoothing", smoothing), ("recency_weight", recency_weight)):
            if not np.isfinite(v) or v < 0:
                raise SpecFitInputError(field, f"must be a finite number >= 0, got {v!r}")
        self.table = table
        self.n = np.array(token_counts, dtype=np.float64)
        if self.n.shape != (len(ids),) or not (np.isfinite(self.n).all() and (self.n >= 0).all()):
            raise SpecFitInputError("token_counts", f"must be {len(ids)} finite counts >= 0, one per token id")
        self.a, self.beta = float(smoothing), float(recency_weight)
        self._row = np.full(int(ids.max()) + 1 if len(ids) else 0, -1, np.int64)
        self._row[ids] = np.arange(len(ids))
        # the (L, E) terms of the scores, as one array the compiled calls take (each is a view of it): the
        # smoothing's pseudo-shares a g, g, the tie-break, and the recency blend and an unseen token's scores
        # (both made by the compiled calls)
        self._terms = np.zeros((5, self.L, self.E))
        self._pseudo, self.g, self._tiebreak, self._blend, self._unseen = self._terms
        self.g[:] = g
        self._tiebreak[:] = np.argsort(np.argsort(g, axis=1, kind="stable"), axis=1) / (self.E * 1e6)
        np.multiply(self.a, g, out=self._pseudo)
        self.window = _Window(self.L, self.E, self.k, window)
        self._context = None  # (β w, the unseen token's scores), both (L, E), until the next observe
        # the compiled calls' copy of the same two terms, valid while _fresh (made by the last compiled call
        # since the last observe): the predictions after a cycle's first reuse them
        self._fresh = False  # whether _blend and _unseen hold the current window's terms
        from specfit.core.kernels import frequency_observe_top_k_kernel, frequency_order, frequency_predict_kernel

        # the compiled ranking's threshold algorithm: each row's experts by their static score, and per layer the
        # largest blend (made with _blend) and tie-break that bound the rest of a score
        self._order = frequency_order(table, self._pseudo, self.k)
        self._bounds = np.zeros((2, self.L))
        self._bounds[1] = self._tiebreak.max(axis=1)

        # compiled (or loaded from numba's cache) here: no decoding cycle pays it, nor looks them up
        self._predict_kernel, self._observe_predict_kernel = frequency_predict_kernel(), frequency_observe_top_k_kernel()

    def reset(self) -> None:
        """Forget the recency context (the tables stay)."""
        self.window.reset()
        self._context, self._fresh = None, False

    def observe(self, tokens, routing, draft_hidden=None) -> None:
        """Feed the recency context (used only when ``recency_weight > 0``)."""
        self.window.observe(tokens, routing)
        self._context, self._fresh = None, False

    def _recency_terms(self) -> tuple[np.ndarray | None, np.ndarray]:
        """The (L, E) terms that do not depend on the token: ``β w`` (None when β = 0) and the score of
        an unseen token, ``(g + β w) + tie-break``; computed once per observed context."""
        if self._context is None:
            blend = self.beta * self.window.share() if self.beta else None
            unseen = self.g + blend if self.beta else self.g.copy()
            unseen += self._tiebreak
            self._context = (blend, unseen)
        return self._context

    def scores(self, tokens) -> np.ndarray:
        """(m, L, E) float64 scores of the given tokens (see the class docstring)."""
        t = check_tokens(tokens)
        if len(t) and t.max() < len(self._row):
            rows = self._row[t]
        else:
            rows = np.full(len(t), -1)
            inside = t < len(self._row)
            rows[inside] = self._row[t[inside]]
        seen = rows >= 0
        blend, unseen = self._recency_terms()
        if not seen.any():
            return np.broadcast_to(unseen, (len(t), self.L, self.E)).copy()
        known = rows[seen]
        counts = self.table[known]
        counts /= self.k  # float32, as the table
        s = np.add(counts, self._pseudo)  # float64 from here; the same operations, in place, as the formula
        s /= (self.n[known] + self.a)[:, None, None]
        if blend is not None:
            s += blend
        s += self._tiebreak
        if seen.all():
            return s
        out = np.empty((len(t), self.L, self.E))
        out[seen], out[~seen] = s, unseen
        return out

    def observe_and_predict(self, observed, routing, tokens, draft_hidden=None) -> np.ndarray:
        """:meth:`observe` of the committed tokens ``observed`` (T,) with their routing (T, L, k), then
        :meth:`predict` of ``tokens`` (m,), in one compiled call
        (:func:`specfit.core.kernels.frequency_observe_top_k_kernel`; the engine's call at the start of a
        drafted cycle, where two separate calls take longer on caches a forward has just evicted).

        Returns
        -------
        numpy.ndarray
            (m, L, k) int64, equal to what ``observe`` then ``predict`` return.

        Raises
        ------
        SpecFitInputError
            As :meth:`observe` and :meth:`predict` do, naming ``observed``, ``routing`` or ``tokens``;
            nothing is observed if any check fails.
        """
        o, t = _token_ids(observed, "observed"), _token_ids(tokens, "tokens")  # their signs: checked in the call
        r = routing
        if not _is_kernel_array(r, 3):
            from specfit.core.kernels import kernel_array

            r = kernel_array(routing_array(routing, copy=False), np.int64)
        return self.observe_and_predict_ids(o, r, t)

    def observe_and_predict_ids(self, observed: np.ndarray, routing: np.ndarray, tokens: np.ndarray,
                                draft_hidden=None) -> np.ndarray:
        """:meth:`observe_and_predict` of arrays already in the compiled call's form: ``observed`` (T,) and
        ``tokens`` (m,) int64, ``routing`` (T, L, k) int64, each a C-contiguous numpy array (what the engine
        passes: arrays it made). Their type, dimensions and layout are not checked (an array of another dtype
        of 8-byte items, or another layout, is misread); their values and shapes are, in the compiled call,
        which spares the engine's drafted cycle the Python-level checks on caches a forward has evicted.

        Raises
        ------
        SpecFitInputError
            As :meth:`observe_and_predict` does on the values and shapes; nothing is observed then.
        """
        w = self.window
        out = np.empty((tokens.shape[0], self.L, self.k), np.int64)  # made here: boxing a kernel's own costs more
        w.size, w.head, w.step, error = self._observe_predict_kernel(
            w.counts, w.last, w.ring, w.size, w.head, w.step, routing, w.E, observed, self.table, self._row, self.n,
            self.a, self.k, self._terms, self.beta, tokens, out, self._order, self._bounds)
        if error == 5:
            raise SpecFitInputError("routing", f"must have shape (T, {w.L}, {w.k}), got {routing.shape}")
        if error == 6:
            raise SpecFitInputError("observed", f"must have one entry per routing row ({routing.shape[0]}), "
                                                f"got {observed.shape[0]}")
        if error:
            raise SpecFitInputError(*_OBSERVE_ERRORS[error](w.E))
        self._context, self._fresh = None, True
        return out

    def predict(self, tokens, draft_hidden=None) -> np.ndarray:
        """(m, L, k) int64, the top-k of :meth:`scores` per node and layer (:func:`top_k_ids`' order), in
        one compiled call (:func:`specfit.core.kernels.frequency_predict_kernel`) that computes the scores,
        the recency blend included, operation for operation as :meth:`scores` does; the blend and an unseen
        token's scores are made once per observed context (the first call after an observe) and reused.

        Raises
        ------
        SpecFitInputError
            On ``tokens``: not a 1-D array of non-negative integer ids.
        """
        return self.predict_ids(_token_ids(tokens, "tokens"))  # its signs: checked in the call

    def predict_ids(self, tokens: np.ndarray, draft_hidden=None) -> np.ndarray:
        """:meth:`predict` of ``tokens`` already in the compiled call's form: a C-contiguous (m,) int64 numpy
        array (what the engine passes). Its type, dimensions and layout are not checked (as
        :meth:`observe_and_predict_ids`); the ids' signs are, in the compiled call.

        Raises
        ------
        SpecFitInputError
            On ``tokens``: a negative id.
        """
        w = self.window
        out = np.empty((tokens.shape[0], self.L, self.k), np.int64)  # made here: boxing a kernel's own costs more
        error = self._predict_kernel(self.table, self._row, self.n, self.a, self.k, self._terms, w.counts,
                                     w.size * w.k, self.beta, self._fresh, tokens, out, self._order, self._bounds)
        if error:
            raise SpecFitInputError(*_OBSERVE_ERRORS[error](w.E))
        self._fresh = True
        return out


def build_frequency(trace: RoutingTrace, smoothing: float = 1.0, recency_weight: float = 0.5,
                    window: int = 32) -> FrequencyPredictor:
    """Build per-(layer, token id) frequency tables from a routing trace.

    Parameters
    ----------
    trace : RoutingTrace
        Recorded true routing (prompts used to build; evaluate on others).
    smoothing, recency_weight, window
        See :class:`FrequencyPredictor`.

    Returns
    -------
    FrequencyPredictor

    Raises
    ------
    SpecFitInputError
        If the trace is empty.
    """
    tokens, r = trace.tokens, trace.routing
    ids, inverse, counts = np.unique(tokens, return_inverse=True, return_counts=True)
    L, k, E = r.shape[1], r.shape[2], trace.num_experts
    table = np.zeros((len(ids), L, E), np.float32)
    np.add.at(table, (np.repeat(inverse, L * k), np.tile(np.repeat(np.arange(L), k), len(tokens)), r.ravel()), 1)
    g = global_counts(trace)
    return FrequencyPredictor(ids, table, counts, g / g.sum(axis=1, keepdims=True), k, smoothing,
                              recency_weight, window)


# -- (c) linear probe on the draft hidden state ------------------------------------------------------
class ProbePredictor:
    """A linear probe per MoE layer on the draft hidden state: ``logits[l] = W[l]ᵀ z + b[l]``.

    ``z = (h - mean) / std`` is the standardised draft hidden state h (Hd,); the prediction is the
    top-k of the logits. With a ``frequency`` predictor and weight ``w > 0`` the score is the
    product-of-experts blend ``log_softmax(logits) + w · log s_freq(token)`` (the draft hidden state
    that produced a node's token does not encode that token; the frequency table does). Nodes
    without a hidden state (``draft_hidden`` None or a NaN row, e.g. the cycle's root) get the
    ``frequency`` prediction when one is given, else the ``recency`` one; :meth:`observe` feeds both.

    Parameters
    ----------
    weight : array_like
        (L, Hd, E).
    bias : array_like
        (L, E).
    mean, std : array_like
        (Hd,) standardisation of the inputs.
    top_k : int
    window : int
        Recency window of the fallback.
    prior : array_like, optional
        (L, E) prior order of the recency fallback (see :class:`RecencyPredictor`).
    frequency : FrequencyPredictor, optional
        Token tables to blend with and fall back to.
    frequency_weight : float
        w >= 0 (default 1; ignored without ``frequency``).
    """

    name = "probe"
    uses_hidden = True
    valid_output = True

    def __init__(self, weight, bias, mean, std, top_k: int, window: int = 32, prior=None,
                 frequency: FrequencyPredictor | None = None, frequency_weight: float = 1.0):
        self.weight = np.asarray(weight, dtype=np.float32)
        if self.weight.ndim != 3:
            raise SpecFitInputError("weight", f"must have shape (L, Hd, E), got {self.weight.shape}")
        self.L, self.Hd, self.E = self.weight.shape
        self.bias = np.asarray(bias, dtype=np.float32)
        self.mean, self.std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
        if self.bias.shape != (self.L, self.E):
            raise SpecFitInputError("bias", f"must have shape ({self.L}, {self.E}), got {self.bias.shape}")
        if self.mean.shape != (self.Hd,) or self.std.shape != (self.Hd,) or (self.std <= 0).any():
            raise SpecFitInputError("std", f"mean and std must have shape ({self.Hd},), std > 0")
        if not np.isfinite(frequency_weight) or frequency_weight < 0:
            raise SpecFitInputError("frequency_weight", f"must be a finite number >= 0, got {frequency_weight!r}")
        if frequency is not None and (frequency.L, frequency.E, frequency.k) != (self.L, self.E, top_k):
            raise SpecFitInputError("frequency", f"must have (L, E, k) = ({self.L}, {self.E}, {top_k})")
        self.recency = RecencyPredictor(self.L, self.E, top_k, window, prior)
        self.k = self.recency.k
        self.prior, self.frequency, self.frequency_weight = prior, frequency, float(frequency_weight)

    def reset(self) -> None:
        """Forget the per-prompt context."""
        self.recency.reset()
        if self.frequency is not None:
            self.frequency.reset()

    def observe(self, tokens, routing, draft_hidden=None) -> None:
        """Feed the fallbacks' recency context."""
        self.recency.observe(tokens, routing)
        if self.frequency is not None:
            self.frequency.observe(tokens, routing)

    def logits(self, draft_hidden) -> np.ndarray:
        """(m, L, E) float32 probe logits of (m, Hd) hidden states."""
        z = (np.asarray(draft_hidden, np.float32) - self.mean) / self.std
        return np.einsum("mh,lhe->mle", z, self.weight) + self.bias

    def predict(self, tokens, draft_hidden=None) -> np.ndarray:
        """(m, L, k) int64: the probe's top-k for rows with a hidden state, the fallback's otherwise."""
        t = check_tokens(tokens)
        out = (self.frequency or self.recency).predict(t)
        h = check_hidden(draft_hidden, len(t), self.Hd)
        if h is not None:
            ok = ~np.isnan(h).any(axis=1)
            if ok.any():
                z = self.logits(h[ok]).astype(np.float64)
                z -= z.max(-1, keepdims=True)
                score = z - np.log(np.exp(z).sum(-1, keepdims=True))
                if self.frequency is not None and self.frequency_weight:
                    score += self.frequency_weight * np.log(np.maximum(self.frequency.scores(t[ok]), 1e-12))
                out[ok] = top_k_ids(score, self.k)
        return out

    def save(self, path) -> None:
        """Write the probe to ``path`` (``.npz``), atomically (temporary file, then rename)."""
        arrays = dict(weight=self.weight, bias=self.bias, mean=self.mean, std=self.std, top_k=np.array(self.k))
        if self.prior is not None:
            arrays["prior"] = np.asarray(self.prior, np.float64)
        save_npz(path, arrays)

    @classmethod
    def load(cls, path, window: int = 32) -> "ProbePredictor":
        """Read a probe written by :meth:`save` (field ``probe`` in errors)."""
        from specfit.core.readers import read_npz

        z = read_npz(path, "probe", required=("weight", "bias", "mean", "std", "top_k"))
        return cls(z["weight"], z["bias"], z["mean"], z["std"], int(z["top_k"]), window, z.get("prior"))


def train_probe(hidden, routing, num_experts: int, *, epochs: int = 40, lr: float = 3e-3,
                weight_decay: float = 1e-4, batch_size: int = 512, seed: int = 0, device="cpu",
                window: int = 32, prior=None, frequency: FrequencyPredictor | None = None,
                frequency_weight: float = 1.0) -> ProbePredictor:
    """Train one linear probe per MoE layer on draft hidden states against the true routing.

    Loss: per layer, softmax cross-entropy over the E experts against the uniform distribution on
    the k true experts (the multi-label softmax loss of Mahajan et al. 2018, "Exploring the Limits of
    Weakly Supervised Pretraining", §2.2), summed over layers; Adam (Kingma & Ba 2015) with
    decoupled weight decay (AdamW, Loshchilov & Hutter 2019), mini-batches, inputs standardised.
    The layers share nothing, so this equals L independent probes.

    Parameters
    ----------
    hidden : array_like
        (N, Hd) draft hidden states; rows containing NaN are skipped.
    routing : array_like
        (N, L, k) true experts.
    num_experts : int
        E.
    epochs : int
        Passes over the data (default 40).
    lr : float
        Adam learning rate (default 3e-3).
    weight_decay : float
        Decoupled weight decay (default 1e-4).
    batch_size : int
        Rows per step (default 512).
    seed : int
        Shuffling and initialisation seed.
    device : str or torch.device
        Where to train (float32).
    window, prior, frequency, frequency_weight
        Fallback and blend settings (see :class:`ProbePredictor`).

    Returns
    -------
    ProbePredictor

    Raises
    ------
    SpecFitInputError
        Bad shapes (fields ``hidden``, ``routing``), no usable row, or a bad hyper-parameter.
    """
    import torch

    r = check_routing(routing, num_experts)
    h = check_hidden(hidden, r.shape[0], field="hidden")
    if h is None:
        raise SpecFitInputError("hidden", "is required to train a probe")
    ok = ~np.isnan(h).any(axis=1)
    if not ok.any():
        raise SpecFitInputError("hidden", "has no row without NaN")
    h, r = h[ok], r[ok]
    epochs, batch_size = check_positive_int("epochs", epochs), check_positive_int("batch_size", batch_size)
    from specfit.models.devices import resolve_device

    device = resolve_device(device)
    for field, v in (("lr", lr), ("weight_decay", weight_decay)):
        if not np.isfinite(v) or v < 0 or (field == "lr" and v == 0):
            raise SpecFitInputError(field, f"must be a finite number > 0 (weight_decay >= 0), got {v!r}")
    N, L, k = r.shape
    E = int(num_experts)
    mean, std = h.mean(0), h.std(0) + 1e-6
    gen = torch.Generator().manual_seed(seed)
    x = torch.from_numpy((h - mean) / std).to(device)
    target = torch.zeros(N, L, E)
    target.scatter_(2, torch.from_numpy(r), 1.0 / k)
    target = target.to(device)
    lin = torch.nn.Linear(h.shape[1], L * E).to(device)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.01, generator=gen)
        lin.bias.zero_()
    opt = torch.optim.AdamW(lin.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(epochs):
        for idx in torch.randperm(N, generator=gen).to(device).split(batch_size):
            logp = torch.log_softmax(lin(x[idx]).view(-1, L, E), dim=-1)
            loss = -(target[idx] * logp).sum(-1).mean(0).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    W = lin.weight.detach().float().cpu().numpy().reshape(L, E, -1).transpose(0, 2, 1)
    b = lin.bias.detach().float().cpu().numpy().reshape(L, E)
    return ProbePredictor(W, b, mean, std, k, window, prior, frequency, frequency_weight)


# -- registry ----------------------------------------------------------------------------------------
def _make_recency(trace: RoutingTrace | None = None, num_layers=None, num_experts=None, top_k=None,
                  window: int = 32, prior=None) -> RecencyPredictor:
    if trace is not None:
        num_layers, num_experts, top_k = trace.num_layers, trace.num_experts, trace.top_k
        prior = global_counts(trace) if prior is None else prior
    if None in (num_layers, num_experts, top_k):
        raise SpecFitInputError("num_layers", "recency needs a trace or num_layers, num_experts and top_k")
    return RecencyPredictor(num_layers, num_experts, top_k, window, prior)


def _make_frequency(trace: RoutingTrace | None = None, **options) -> FrequencyPredictor:
    if trace is None:
        raise SpecFitInputError("trace", "the frequency predictor is built from a routing trace")
    return build_frequency(trace, **options)


def _make_probe(trace: RoutingTrace | None = None, path=None, window: int = 32, frequency_weight: float = 0.0,
                **train_options) -> ProbePredictor:
    if path is not None:
        probe = ProbePredictor.load(path, window)
    elif trace is None or trace.draft_hidden is None:
        raise SpecFitInputError("trace", "the probe needs a saved probe (path) or a trace with draft hidden states")
    else:
        probe = train_probe(trace.draft_hidden, trace.routing, trace.num_experts, window=window,
                            prior=global_counts(trace), **train_options)
    if frequency_weight:
        if trace is None:
            raise SpecFitInputError("trace", "frequency_weight > 0 needs a trace to build the frequency tables")
        return ProbePredictor(probe.weight, probe.bias, probe.mean, probe.std, probe.k, window, probe.prior,
                              build_frequency(trace, window=window), frequency_weight)
    return probe


PREDICTORS: dict[str, Callable[..., ExpertPredictor]] = {
    "recency": _make_recency,
    "frequency": _make_frequency,
    "probe": _make_probe,
}


def get_predictor(name: str, **options) -> ExpertPredictor:
    """Build a registered expert predictor.

    Parameters
    ----------
    name : str
        ``"recency"``, ``"frequency"`` or ``"probe"``.
    **options
        Every predictor: ``trace`` (a :class:`~models.traces.RoutingTrace` or the path of a saved
        one), ``num_layers``, ``num_experts``, ``top_k`` (the target's; with a trace they must agree
        with it), ``window``. ``recency``: a trace or the three dimensions (a trace also gives the
        global-count prior), ``prior``. ``frequency``: ``trace`` (required), ``smoothing``,
        ``recency_weight``. ``probe``: ``path`` of a saved probe, or ``trace`` with draft hidden
        states plus :func:`train_probe` hyper-parameters; ``frequency_weight`` (default 0: the
        pure probe; > 0 blends with and falls back to the frequency tables of ``trace``).

    Returns
    -------
    ExpertPredictor

    Raises
    ------
    SpecFitInputError
        Unknown name (field ``predictor``), unknown option (``options``), a trace recorded on a
        target of other dimensions (``trace``), or bad option values.
    """
    if name not in PREDICTORS:
        raise SpecFitInputError("predictor", f"must be one of {sorted(PREDICTORS)}, got {name!r}")
    trace = options.get("trace")
    if isinstance(trace, (str, os.PathLike)):
        trace = options["trace"] = RoutingTrace.load(trace)
    if trace is not None:
        dims = {"num_layers": trace.num_layers, "num_experts": trace.num_experts, "top_k": trace.top_k}
        for key, value in dims.items():
            given = options.pop(key, None)
            if given is not None and given != value:
                raise SpecFitInputError("trace", f"was recorded with {key} = {value}, the target has {given}")
    try:
        return PREDICTORS[name](**options)
    except TypeError as e:
        raise SpecFitInputError("options", f"bad option for predictor {name!r}: {e}") from None
