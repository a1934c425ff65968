"""The expert cache plain AR decoding would have had: the AR gate's counterfactual (SPECFIT.md §3).

A drafted cycle commits τ tokens. Plain AR decoding would have committed the same τ tokens (greedy
speculative output equals greedy AR output; a sampled one has the same distribution) in τ one-token
forwards: the cycle's root and its accepted draft nodes, each routed to exactly the experts the verify
routed it to (the same token after the same context). What AR would have paid for them depends on
AR's own expert cache, which is not the engine's: a verify's draft nodes bring experts in and push
others out, so after drafted cycles the engine's cache holds fewer of the experts the next tokens
need than AR's would. Pricing the counterfactual AR step against the engine's cache would charge AR
for the drafting's own cache pollution, and the gate would overrate drafting. The twin also prices the
shadow cycles' counterfactual, so without it an AR step carries none: with 16 cache slots the twin
pays about 1% of modeled tok/s, what the shadow cycles pay (BENCHMARKS.md, "Engine mechanisms: what each pays").

:class:`ARTwinCache` replays AR decoding's cache: the engine copies its cache's state into it after
each prefill (:meth:`ARTwinCache.sync`) and then feeds it, one token at a time, the routing of every
committed token's forward (:meth:`ARTwinCache.step`), with the eviction policy of
:class:`specfit.models.experts.DeviceExpertCache` (each forward's experts used once, the same tick;
misses fill free slots, then evict the policy's victim among experts this forward does not use). It
holds expert ids only, never weights: ``(L, E)`` arrays, a few vector operations per token.

Under a lookahead cache (``--eviction lookahead``) plain AR decoding is ``ar+lookahead``: its AR steps draft
a lookahead and evict the least predicted demand. The twin then evicts by a demand too
(:meth:`ARTwinCache.set_lookahead`), the one the engine hands it per replayed cycle: an AR step's lookahead
draft (what ``ar+lookahead`` drafts from the same token), or a drafted cycle's whole draft tree (the
head's prediction of the tokens after each committed one; the lookahead draft ``ar+lookahead`` would draft
from each of them is a smaller tree from the same head: an approximation).
"""

from __future__ import annotations

import numpy as np

from specfit.core.errors import SpecFitInputError


class ARTwinCache:
    """Expert-cache state of plain AR decoding over the same committed tokens (module docstring).

    Parameters
    ----------
    num_layers, num_experts : int
        L MoE layers of E experts each.
    slots : int
        Slots per layer, ``0..E`` (``E``: every expert resident, nothing ever misses; ``0``: nothing
        kept, every expert of every token misses).
    policy : str
        ``"lru"`` (evict the least recently used), ``"lfu"`` (fewest uses, then least recent), or
        ``"lookahead"`` / ``"lookahead-lfu"`` (the least demand set by :meth:`set_lookahead`, ties by
        LRU / LFU; without a demand the base policy), as the engine's cache.

    Raises
    ------
    SpecFitInputError
        If ``slots`` is not in [0, E] or ``policy`` is unknown.

    Notes
    -----
    Miss for miss equal to :class:`specfit.models.experts.DeviceExpertCache` fed the same one-token
    forwards when ``slots`` is at least the experts per token (tests/engine/test_twin.py). With fewer,
    the runtime copies one forward's experts in rounds and the twin keeps the last admitted: an
    approximation. The admission mode ``accepted`` does not arise: every AR forward is accepted.

    References
    ----------
    docs/SPECFIT.md §3, "The AR step as a candidate" (the gate's measured utility).
    """

    def __init__(self, num_layers: int, num_experts: int, slots: int, policy: str = "lru"):
        if not 0 <= int(slots) <= int(num_experts):
            raise SpecFitInputError("slots", f"must be an integer in [0, {num_experts}], got {slots!r}")
        if policy not in ("lru", "lfu", "lookahead", "lookahead-lfu"):
            raise SpecFitInputError("policy", f"must be 'lru', 'lfu', 'lookahead' or 'lookahead-lfu', got {policy!r}")
        self.slots, self.policy = int(slots), "lru" if policy == "lookahead" else policy.removeprefix("lookahead-")
        self.looks_ahead = policy.startswith("lookahead")
        self.demand: np.ndarray | None = None
        shape = (int(num_layers), int(num_experts))
        self.resident = np.full(shape, self.slots == shape[1], dtype=bool)
        self.last_use = np.zeros(shape, dtype=np.int64)
        self.uses = np.zeros(shape, dtype=np.int64)
        self.admitted = np.zeros(shape, dtype=np.int64)  # admission order: ties go to the earliest admitted
        self.tick = 0
        self._rows = np.arange(shape[0])[:, None]

    def sync(self, resident, last_use=None, uses=None, admitted=None) -> None:
        """Take the engine's cache state (after a prefill, when AR decoding and the engine stand alike).

        Parameters
        ----------
        resident : array-like of bool, shape (L, E)
            Experts resident per layer.
        last_use, uses, admitted : array-like of int, shape (L, E), optional
            Recency ticks, use counts and admission order (:meth:`DeviceExpertCache.recency`); without
            them every resident expert is equally recent, unused and admitted in id order.
        """
        r = np.array(resident, dtype=bool)
        zero = np.zeros(r.shape, np.int64)
        self.resident = r
        self.last_use = zero.copy() if last_use is None else np.array(last_use, np.int64)
        self.uses = zero.copy() if uses is None else np.array(uses, np.int64)
        self.admitted = np.broadcast_to(np.arange(r.shape[1]), r.shape).copy() if admitted is None \
            else np.array(admitted, np.int64)
        self.tick = int(self.last_use.max(initial=0))

    def set_lookahead(self, demand) -> None:
        """Set the predicted demand a lookahead policy's evictions read, until the next call (as
        :meth:`specfit.models.experts.DeviceExpertCache.set_lookahead`; ignored by ``lru``/``lfu``).

        Parameters
        ----------
        demand : array-like of float, shape (L, E), or None
            Expected uses of each expert by the tokens about to come; None: the base policy's eviction.

        Raises
        ------
        SpecFitInputError
            If ``demand`` is not an (L, E) array (field ``demand``).
        """
        if demand is None or not self.looks_ahead:
            self.demand = None
            return
        d = np.asarray(demand, dtype=np.float64)
        if d.shape != self.resident.shape:
            raise SpecFitInputError("demand", f"must have shape (L, E) = {self.resident.shape}, got {d.shape}")
        self.demand = d

    def step(self, experts) -> np.ndarray:
        """One AR forward: count its misses, then admit them as the engine's cache would.

        Parameters
        ----------
        experts : array-like of int, shape (L, k)
            The token's routed experts per layer (distinct within a layer).

        Returns
        -------
        numpy.ndarray of int, shape (L,)
            Experts the forward misses per layer (copied host-to-device by AR decoding).
        """
        e = np.sort(np.asarray(experts, dtype=np.int64), axis=1)  # the runtime runs a layer's experts in id order
        rows = self._rows
        miss = ~self.resident[rows, e]
        misses = miss.sum(axis=1)
        self.tick += 1
        self.last_use[rows, e] = self.tick
        self.uses[rows, e] += 1
        if self.slots in (0, self.resident.shape[1]) or not misses.any():
            return misses
        ml, mc = np.nonzero(miss)  # admitted in id order, after every expert admitted before
        self.admitted[ml, e[ml, mc]] = self.admitted.max() + 1 + np.arange(ml.size)
        self.resident[ml, e[ml, mc]] = True
        over = self.resident.sum(axis=1) - self.slots
        if over.max() > 0:
            self._evict(over)
        return misses

    def _evict(self, over: np.ndarray) -> None:
        """Evict ``over[l]`` experts per layer: the policy's victims among the resident experts this
        forward did not use (:meth:`DeviceExpertCache._assign`), ties to the earliest admitted."""
        E = self.resident.shape[1]
        cand = self.resident & (self.last_use < self.tick)
        rank = np.argsort(np.argsort(self.admitted, axis=1, kind="stable"), axis=1)  # < E per layer
        key = self.last_use if self.policy == "lru" else self.uses * (self.tick + 1) + self.last_use
        key = np.where(cand, key * E + rank, np.iinfo(np.int64).max)
        kk = int(over.max())
        if self.demand is not None:  # the least demand first, ties by the base policy (Lookahead.victim)
            part = np.lexsort((key, np.where(cand, self.demand, np.inf)), axis=1)[:, :kk]
        else:
            part = np.argpartition(key, kk - 1, axis=1)[:, :kk]
            part = np.take_along_axis(part, np.argsort(np.take_along_axis(key, part, 1), axis=1), 1)
        n = np.minimum(np.maximum(over, 0), cand.sum(axis=1))
        out = np.arange(kk)[None, :] < n[:, None]
        self.resident[np.broadcast_to(self._rows, part.shape)[out], part[out]] = False
        for layer in np.flatnonzero(over > n):  # fewer slots than one forward's experts: keep the last admitted
            now = np.flatnonzero(self.resident[layer])
            self.resident[layer, now[np.argsort(self.admitted[layer, now])[: int(over[layer] - n[layer])]]] = False
