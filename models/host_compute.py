"""The host-compute offload mode: experts not in the device cache run on the CPU, from host memory.

This is the offloading most consumer deployments of Qwen3-30B-A3B use today (llama.cpp
``--n-cpu-moe`` / ``-ot exps=CPU``, KTransformers, Fiddler arXiv 2402.07033): instead of copying
an uncached expert host-to-device (the ``transfer`` mode of :class:`DeviceExpertCache`, one
9.4 MB PCIe copy per expert), the host computes it where its weights already are and only the
(n, H) activations cross the link.

How the device cache is filled in this mode: a **static hot set**. Every MoE layer's slots hold
the ``slots`` experts the routing trace routes to most often (ties to the lower id), loaded once
when the cache is built and never replaced: no admission, no eviction, no H2D copy during
decoding. This is the fixed placement of llama.cpp (which places expert tensors once, at load
time), chosen per expert from measured routing frequencies rather than per layer. Without a trace
the cache stays empty and every expert runs on the host (there is no routing statistic to pick a
static set from, and a set picked at random would only waste device memory).

The ``auto`` mode (:class:`AutoOffloadCache`, "choose per expert") starts from the same hot
set and, in each layer of each forward, copies into the cache the uncached experts whose copy
shortens the layer (the idle link works while the host computes the rest;
:meth:`specfit.core.cost.HostProfile.split`), which then stay cached under the cache's eviction policy.

Numerics: the model calls ``compute`` for the needed experts in increasing expert id, the order
of the transfer mode with 0 slots or all slots, so on the CPU the two modes give bit-identical
outputs; on CUDA the host experts run the CPU kernels, equal within floating-point tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from specfit.core.errors import SpecFitInputError
from specfit.models.experts import DeviceExpertCache, HostExpertStore, LayerStats, check_cache_args

#: The offload modes of the runtime: ``transfer`` copies uncached experts H2D (SPECFIT.md §2),
#: ``host`` computes them on the CPU (:class:`HostComputeCache`), ``auto`` chooses per expert
#: (:class:`AutoOffloadCache`).
OFFLOAD_MODES = ("transfer", "host", "auto")


def check_offload(offload: str) -> str:
    """Return ``offload`` if it is one of :data:`OFFLOAD_MODES`.

    Raises
    ------
    SpecFitInputError
        If it is not (field ``offload``).
    """
    if offload not in OFFLOAD_MODES:
        raise SpecFitInputError("offload", f"must be one of {list(OFFLOAD_MODES)}, got {offload!r}")
    return offload


def hot_experts(routing: np.ndarray, num_experts: int, slots: int) -> list[list[int]]:
    """The ``slots`` most frequently routed experts of every MoE layer (the static hot set).

    Parameters
    ----------
    routing : array of int, shape (N, L, k)
        Top-k experts of N traced tokens per MoE layer (:class:`specfit.models.traces.RoutingTrace`).
    num_experts : int
        Experts per layer E.
    slots : int
        Experts to keep per layer, in [0, E].

    Returns
    -------
    list of list of int
        L lists of ``slots`` expert ids, most frequent first (ties: lower id first).
    """
    r = np.asarray(routing)
    out = []
    for layer in range(r.shape[1]):
        counts = np.bincount(r[:, layer].ravel(), minlength=num_experts)
        out.append([int(e) for e in np.lexsort((np.arange(num_experts), -counts))[:slots]])
    return out


@dataclass
class HostLayerStats(LayerStats):
    """:class:`LayerStats` of the host mode: ``host_computed`` counts (forward, expert) pairs computed
    on the host instead of being copied (``misses`` stays 0), ``host_rows`` their (token, expert) rows."""

    host_computed: int = 0
    host_rows: int = 0


class HostComputeCache(DeviceExpertCache):
    """A device expert cache with a static hot set; the other experts are computed on the host.

    Parameters
    ----------
    store : HostExpertStore
        The host copy of every expert (the host computes from it directly).
    device : torch.device or str
        The compute device of the cached experts.
    slots : int or "all"
        Slots per layer in [0, E]; ``"all"`` keeps every expert on the device.
    policy : str
        Accepted for symmetry with :class:`DeviceExpertCache`; nothing is ever evicted.
    hot : sequence of sequence of int, optional
        Per MoE layer, the experts to place on the device, most important first (e.g.
        :func:`hot_experts` of a routing trace); the first ``slots`` are loaded. None: the cache
        stays empty (all slots but ``"all"``).

    Raises
    ------
    SpecFitInputError
        Bad ``slots``/``policy``; ``hot`` without one list per MoE layer, or an expert id out of range.
    """

    def __init__(self, store: HostExpertStore, device, slots: int | str = 0, policy: str = "lru",
                 hot: Sequence[Sequence[int]] | None = None):
        super().__init__(store, device, slots, policy, staging_slots=1)
        E, L = store.num_experts, store.num_layers
        if hot is not None and len(hot) != L:
            raise SpecFitInputError("hot_experts", f"must have one list per MoE layer ({L}), got {len(hot)}")
        if 0 < self.slots < E and hot is not None:
            for layer, ids in enumerate(hot):
                ids = list(dict.fromkeys(int(e) for e in ids))[: self.slots]
                if any(not 0 <= e < E for e in ids):
                    raise SpecFitInputError("hot_experts", f"expert ids must lie in [0, {E}) (layer {layer})")
                self._load(layer, ids, range(len(ids)))
                self._slot_of[layer] = {e: s for s, e in enumerate(ids)}
                self._resident[layer, ids] = True
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero every counter, host counters included (the cache contents stay)."""
        super().reset_stats()
        self._stats = [HostLayerStats() for _ in range(self.num_layers)]

    def prefetch(self, layer: int, expert_ids: Iterable[int], protect: Iterable[int] = ()) -> list[int]:
        """The hot set is static: checks the arguments as :meth:`DeviceExpertCache.prefetch` does
        and moves nothing (returns ``[]``)."""
        self._prefetch_ids(layer, expert_ids)
        self._prefetch_ids(layer, protect)
        return []

    def run(self, layer: int, experts: Sequence[int],
            compute: Callable[[int, torch.Tensor, torch.Tensor], int | None], rows: Sequence[int] | None = None,
            num_tokens: int | None = None) -> None:
        """Call ``compute(e, gate_up_e, down_e)`` for each expert, in increasing expert id.

        A resident expert gets its device slot's weights (a hit); any other gets the host store's
        tensors (``host_computed``; ``compute`` computes it on the host and may return the number
        of rows it computed, summed in ``host_rows``). Nothing is copied into the cache. The
        parameters are those of :meth:`DeviceExpertCache.run` (``rows``, ``num_tokens`` unused); the
        weights handed to ``compute`` are device tensors for hits and host tensors for the others.
        """
        self._touch(layer, experts, journal=False)
        slot_of = self._slot_of[layer]
        self._stats[layer].hits += sum(e in slot_of for e in experts)
        self._compute(layer, experts, compute)

    #: Misses run on the host store's tensors, not in device slots: the runtime calls :meth:`run`.
    grouped = False

    def run_rounds(self, layer, experts, compute_round) -> None:
        """Not available: a host-computed expert has no device slot (use :meth:`run`).

        Raises
        ------
        NotImplementedError
            Always.
        """
        raise NotImplementedError(f"{type(self).__name__} computes its misses on the host; call run(), not run_rounds()")

    def _compute(self, layer: int, experts: Sequence[int],
                 compute: Callable[[int, torch.Tensor, torch.Tensor], int | None]) -> None:
        """``compute`` every expert in increasing id: resident ones on their device slot, the others on
        the host store's tensors (counted in ``host_computed`` and ``host_rows``)."""
        st, slot_of = self._stats[layer], self._slot_of[layer]
        gu, dn = self.gate_up[layer], self.down[layer]
        for e in sorted(experts):
            if e in slot_of:
                compute(e, gu[slot_of[e]], dn[slot_of[e]])
            else:
                st.host_computed += 1
                st.host_rows += int(compute(e, self.store.gate_up[layer][e], self.store.down[layer][e]) or 0)

    def stats(self) -> dict:
        """:meth:`DeviceExpertCache.stats` plus ``"offload": "host"`` and, per layer and in total,
        ``host_computed`` and ``host_rows`` (:class:`HostLayerStats`); ``hit_rate`` is hits over hits
        + host-computed experts."""
        out = super().stats()
        t = out["total"]
        for key in ("host_computed", "host_rows"):
            t[key] = sum(layer[key] for layer in out["layers"])
        looked_up = t["hits"] + t["misses"] + t["host_computed"]
        t["hit_rate"] = t["hits"] / looked_up if looked_up else 0.0
        out["offload"] = self.offload
        return out

    #: The offload mode the stats report.
    offload = "host"


class AutoOffloadCache(HostComputeCache):
    """The ``auto`` offload mode: per MoE layer and forward, each uncached expert is either copied
    H2D into the device cache or computed on the host, whichever makes the layer fastest.

    The device cache starts as the ``host`` mode's static hot set and then behaves as the
    ``transfer`` mode's cache (``policy`` eviction, ``admission``): an expert copied for a forward
    is admitted, evicting the policy's victim. The choice per layer is
    :meth:`specfit.core.cost.HostProfile.split` on ``cost``: while the host computes the experts
    left to it, the link copies the ones with the most (token, expert) rows, as many as shorten
    max(GPU part + copies, host part); the hits of the forward and the experts being copied are
    never evicted, so at most ``slots`` minus the hits are copied. A copied expert stays cached
    for the next forwards (a benefit the per-forward choice does not count: it is conservative).

    Numerics: every expert is computed in increasing expert id, as in the other modes, so on the
    CPU outputs are bit-identical to theirs.

    Parameters
    ----------
    store, device, slots, policy, hot
        As :class:`HostComputeCache`.
    admission : str
        As :class:`DeviceExpertCache`.
    cost : HostProfile
        The host-regime profile whose :meth:`~specfit.core.cost.HostProfile.split` decides.

    Raises
    ------
    SpecFitInputError
        As :class:`HostComputeCache`; ``cost`` not a host-regime profile (field ``host_profile``).
    """

    offload = "auto"

    def __init__(self, store: HostExpertStore, device, slots: int | str = 0, policy: str = "lru",
                 hot: Sequence[Sequence[int]] | None = None, admission: str = "all", cost=None):
        from specfit.core.cost import HostProfile

        if not isinstance(cost, HostProfile):
            raise SpecFitInputError("host_profile", f"the auto offload mode needs a host-regime profile, got {cost!r}")
        super().__init__(store, device, slots, policy, hot=hot)
        check_cache_args(self.slots, policy, store.num_experts, admission)
        self.admission, self.cost = admission, cost

    def prefetch(self, layer: int, expert_ids: Iterable[int], protect: Iterable[int] = ()) -> list[int]:
        """As :meth:`DeviceExpertCache.prefetch` (the cache is dynamic in this mode)."""
        return DeviceExpertCache.prefetch(self, layer, expert_ids, protect)

    def run(self, layer: int, experts: Sequence[int],
            compute: Callable[[int, torch.Tensor, torch.Tensor], int | None], rows: Sequence[int] | None = None,
            num_tokens: int | None = None) -> None:
        """Call ``compute(e, gate_up_e, down_e)`` for each expert, in increasing expert id: hits and
        the experts chosen for copying (``misses``, admitted to the cache) on device weights, the
        others on host weights (``host_computed``, ``host_rows``).

        Parameters
        ----------
        layer, experts, compute
            As :meth:`DeviceExpertCache.run`.
        rows : sequence of int, optional
            (token, expert) rows of each expert of ``experts`` (default 1 each).
        num_tokens : int, optional
            Tokens of the forward (default: the largest row count); prices the GPU part.
        """
        st, slot_of = self._stats[layer], self._slot_of[layer]
        rows = [1] * len(experts) if rows is None else [int(r) for r in rows]
        row_of = dict(zip(experts, rows))
        self._touch(layer, experts)
        hits = [e for e in experts if e in slot_of]
        st.hits += len(hits)
        uncached = sorted((e for e in experts if e not in slot_of), key=lambda e: (-row_of[e], e))
        n = num_tokens if num_tokens is not None else max(rows, default=1)
        k = self.cost.split(n, [row_of[e] for e in uncached], max(self.slots - len(hits), 0))[0] if uncached else 0
        copy = uncached[:k]
        st.misses += len(copy)
        self._load(layer, copy, self._assign(layer, copy, set(hits)))
        self._compute(layer, experts, compute)  # the copied experts are resident now
