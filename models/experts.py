"""Host expert store and device expert cache for offloaded Mixture-of-Experts layers.

The experts of every MoE layer live in a :class:`HostExpertStore` (host memory, pinned when the
compute device is CUDA so that H2D copies are asynchronous DMA). A :class:`DeviceExpertCache`
keeps, per MoE layer, a fixed number of device slots, each holding one expert's weights; an expert
needed by a forward that is not resident is a *miss* and costs one H2D transfer (SPECFIT.md §2).

Weights of one expert ``e`` of one layer, in the orientation of ``torch.nn.functional.linear``:

* ``gate_up[e]``: (2 * I, H), rows ``[:I]`` the gate projection, rows ``[I:]`` the up projection;
* ``down[e]``: (H, I).

``expert(x) = down @ (silu(gate @ x) * (up @ x))`` (SwiGLU; Shazeer 2020, "GLU Variants Improve
Transformer", eq. 6). H is the hidden size, I the expert intermediate size.

The cache never returns a wrong expert when one forward needs more distinct experts than a layer has
slots: :meth:`DeviceExpertCache.run` processes the needed experts in rounds, and a slot handed out in a
round is never evicted before that round's computation finished (PITFALLS.md, "Offloaded MoE runtime").
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from specfit.core.errors import SpecFitInputError

#: Accepted units of a memory budget string, in bytes.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str | int, field: str = "gpu_memory") -> int:
    """Parse a memory size such as ``"20GiB"``, ``"512MB"`` or ``1048576`` into bytes.

    Parameters
    ----------
    text : str or int
        A non-negative number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB;
        case-insensitive). A bare number is bytes.
    field : str
        Field name used in the error message.

    Returns
    -------
    int
        The size in bytes.

    Raises
    ------
    SpecFitInputError
        If the text is not a non-negative number with a known unit.
    """
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise SpecFitInputError(field, f"must be a size like '20GiB' or '512MB', got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def check_cache_args(slots: int | str, policy: str, num_experts: int, admission: str = "all") -> int:
    """Validate expert-cache arguments and return the slots per layer as an integer.

    Parameters
    ----------
    slots : int or "all"
        Slots per layer, in [0, num_experts], or ``"all"`` (= num_experts).
    policy : str
        A key of :data:`POLICIES`.
    num_experts : int
        Experts per layer E.
    admission : str
        One of :data:`ADMISSIONS`.

    Raises
    ------
    SpecFitInputError
        If ``slots``, ``policy`` or ``admission`` is invalid.
    """
    given = slots  # as given: a command line's text stays quoted in the message
    if slots == "all":
        slots = num_experts
    elif isinstance(slots, str) and slots.strip().isascii() and slots.strip().isdigit():  # as typed on a command line
        slots = int(slots)
    if isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots <= num_experts:
        raise SpecFitInputError("cache_slots", f"must be an integer in [0, {num_experts}] or 'all', got {given!r}")
    if policy not in POLICIES:
        raise SpecFitInputError("eviction", f"must be one of {sorted(POLICIES)}, got {policy!r}")
    if admission not in ADMISSIONS:
        raise SpecFitInputError("admission", f"must be one of {list(ADMISSIONS)}, got {admission!r}")
    return slots


class HostExpertStore:
    """The expert weights of every MoE layer, in host memory.

    Parameters
    ----------
    num_layers : int
        Number of MoE layers L.
    num_experts : int
        Experts per layer E.
    hidden_size : int
        H.
    intermediate_size : int
        Expert intermediate size I.
    dtype : torch.dtype
        Storage dtype (the compute dtype: float32 on CPU, bfloat16 on CUDA).
    pin_memory : bool
        Allocate page-locked memory (use when the compute device is CUDA).

    Notes
    -----
    Per layer, ``gate_up[l]`` is one (E, 2I, H) tensor and ``down[l]`` one (E, H, I) tensor; they are
    filled expert by expert with :meth:`set_expert` so that a loader never holds more than one
    checkpoint tensor besides the store.
    """

    def __init__(self, num_layers: int, num_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, pin_memory: bool = False):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.dtype = dtype
        self.gate_up = [torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype,
                                    pin_memory=pin_memory) for _ in range(num_layers)]
        self.down = [torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype,
                                 pin_memory=pin_memory) for _ in range(num_layers)]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate, up and down) in the storage dtype."""
        return 3 * self.hidden_size * self.intermediate_size * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Host bytes held by the store."""
        return self.num_layers * self.num_experts * self.expert_bytes

    def set_expert(self, layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor) -> None:
        """Copy one expert's weights into the store.

        Parameters
        ----------
        layer, expert : int
            MoE layer index and expert id.
        gate, up : torch.Tensor
            (I, H) each.
        down : torch.Tensor
            (H, I).
        """
        i = self.intermediate_size
        self.gate_up[layer][expert, :i].copy_(gate)
        self.gate_up[layer][expert, i:].copy_(up)
        self.down[layer][expert].copy_(down)


class LRU:
    """Least-recently-used eviction: the victim is the resident expert used longest ago."""

    name = "lru"

    def victim(self, candidates: Sequence[int], last_use: Sequence[int], uses: Sequence[int]) -> int:
        """Pick the expert to evict among ``candidates`` (resident, not in use this round)."""
        return min(candidates, key=lambda e: last_use[e])


class LFU:
    """Least-frequently-used eviction over the whole history of the layer; ties go to the LRU one."""

    name = "lfu"

    def victim(self, candidates: Sequence[int], last_use: Sequence[int], uses: Sequence[int]) -> int:
        """Pick the expert to evict among ``candidates`` (resident, not in use this round)."""
        return min(candidates, key=lambda e: (uses[e], last_use[e]))


class Lookahead:
    """Lookahead eviction: the victim is the candidate with the least predicted near-future demand,
    ties (every candidate, while no demand is set) broken by a base policy.

    The demand is an (L, E) array set from outside per decoding cycle
    (:meth:`DeviceExpertCache.set_lookahead`), typically the expected uses of each expert by the draft
    tree's nodes (:func:`specfit.core.lookahead.tree_expert_demand`); the cache hands the policy the
    victim's layer row. Without demand the policy is exactly its base policy. Speculation as a lookahead
    for eviction: MoE-SpAc (arXiv 2603.09983).

    Parameters
    ----------
    base : LRU or LFU
        The tie-breaking policy (``"lookahead"``: LRU, ``"lookahead-lfu"``: LFU).
    """

    #: The cache passes the demand row of the victim's layer to :meth:`victim`.
    uses_lookahead = True

    def __init__(self, base=None):
        self.base = LRU() if base is None else base
        self.name = "lookahead" if self.base.name == "lru" else f"lookahead-{self.base.name}"

    def victim(self, candidates: Sequence[int], last_use: Sequence[int], uses: Sequence[int],
               demand: Sequence[float] | None = None) -> int:
        """Pick the expert to evict among ``candidates`` (resident, not in use this round): the least
        ``demand[e]``, then the base policy's victim among the tied ones (in the candidates' order)."""
        if demand is not None:
            least = min(demand[e] for e in candidates)
            candidates = [e for e in candidates if demand[e] == least]
        return self.base.victim(candidates, last_use, uses)


#: Eviction policies by name. ``lookahead`` evicts by predicted demand with LRU ties (with no demand
#: set: plain LRU), ``lookahead-lfu`` with LFU ties.
POLICIES = {"lru": LRU, "lfu": LFU, "lookahead": Lookahead, "lookahead-lfu": lambda: Lookahead(LFU())}

#: Admission of the experts a verify forward touches (:meth:`DeviceExpertCache.settle`): ``all``
#: (default) counts every expert the verify touched as used (plain LRU/LFU); ``accepted`` counts a
#: use only for experts of the accepted path and puts experts transferred only for rejected draft
#: nodes at the cold end of the eviction order. On the shipped proxy ``accepted`` moved as many or
#: slightly more experts per committed token (BENCHMARKS.md, "Cache-aware verification"), so it is not the default.
ADMISSIONS = ("all", "accepted")


@dataclass
class LayerStats:
    """Counters of one MoE layer's expert cache.

    ``hits``/``misses`` count (forward, expert) pairs: an expert needed by a forward is a hit when it
    was resident when the forward reached the layer, a miss otherwise (one H2D transfer each).
    ``prefetched`` counts experts loaded by :meth:`DeviceExpertCache.prefetch`; their bytes and time
    are included in ``bytes_moved`` and ``transfer_ms``. ``rejected_misses`` counts the misses of
    verify forwards whose expert no accepted node used (transfers paid only for rejected draft
    nodes; counted by :meth:`DeviceExpertCache.settle`).
    """

    hits: int = 0
    misses: int = 0
    rejected_misses: int = 0
    prefetched: int = 0
    bytes_moved: int = 0
    transfer_ms: float = 0.0


#: The counters of :class:`LayerStats`, in order.
_STAT_KEYS = tuple(vars(LayerStats()))


class _Timer:
    """Device-generic interval timer: CUDA events on CUDA (resolved lazily), perf_counter otherwise."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._pending: list[tuple[object, object, Callable[[float], None]]] = []

    def _event(self):
        """A timing event recorded on the current stream of *this* device (where the copies and
        kernels are queued), not of whichever CUDA device happens to be current."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def start(self):
        if self.cuda:
            return self._event()
        return time.perf_counter()

    def stop(self, start, sink: Callable[[float], None]) -> None:
        """Close the interval opened by :meth:`start`; ``sink(ms)`` is called now or at :meth:`flush`."""
        if self.cuda:
            self._pending.append((start, self._event(), sink))
        else:
            sink((time.perf_counter() - start) * 1e3)

    def flush(self, block: bool = True) -> None:
        """Deliver the pending CUDA intervals: all of them after waiting for the last one (``block``), or
        without waiting only those whose end event has completed, in order (the rest stay pending)."""
        if not self._pending:
            return
        if block:
            self._pending[-1][1].synchronize()
            done = len(self._pending)
        else:
            done = 0
            while done < len(self._pending) and self._pending[done][1].query():
                done += 1
        for a, b, sink in self._pending[:done]:
            sink(a.elapsed_time(b))
        del self._pending[:done]


class _no_stream:
    """A do-nothing context (the CPU has no streams)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class DeviceExpertCache:
    """Per-layer device slots holding experts copied from a :class:`HostExpertStore`.

    Parameters
    ----------
    store : HostExpertStore
        The host copy of every expert.
    device : torch.device or str
        The compute device (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
    slots : int or "all"
        Slots per layer. ``0``: nothing is kept between forwards, every needed expert is
        transferred for each forward (the vanilla offloading setting); ``"all"``: every expert is
        resident (loaded once at construction, not counted in the stats); otherwise ``1..E``.
    policy : str
        Eviction policy, a key of :data:`POLICIES`: ``"lru"`` (default), ``"lfu"``, or ``"lookahead"`` /
        ``"lookahead-lfu"`` (evict the least predicted demand, :meth:`set_lookahead`; ties by LRU / LFU).
    admission : str
        ``"all"`` (default) or ``"accepted"``: how the experts of a tentative (verify) forward are
        ranked once the accepted path is known, see :meth:`settle`.
    staging_slots : int or None
        With ``slots=0``, the size of the one transient buffer shared by all layers (default: E,
        capped at 8, so that one AR token's top-8 experts move in one round).

    Raises
    ------
    SpecFitInputError
        If ``slots`` is not an integer in [0, E] nor ``"all"``, or ``policy`` or ``admission`` is unknown.
    """

    def __init__(self, store: HostExpertStore, device, slots: int | str = 0, policy: str = "lru",
                 staging_slots: int | None = None, admission: str = "all"):
        self.store = store
        self.device = torch.device(device)
        E = store.num_experts
        slots = check_cache_args(slots, policy, E, admission)
        self.slots, self.policy, self.admission = slots, POLICIES[policy](), admission
        self.timer = _Timer(self.device)
        L, I, H, dt = store.num_layers, store.intermediate_size, store.hidden_size, store.dtype
        if slots > 0:
            self.gate_up = [torch.empty(slots, 2 * I, H, dtype=dt, device=self.device) for _ in range(L)]
            self.down = [torch.empty(slots, H, I, dtype=dt, device=self.device) for _ in range(L)]
        else:
            n = staging_slots or min(E, 8)
            shared_gu = torch.empty(n, 2 * I, H, dtype=dt, device=self.device)
            shared_dn = torch.empty(n, H, I, dtype=dt, device=self.device)
            self.gate_up, self.down = [shared_gu] * L, [shared_dn] * L
        self._copy_stream = None           # CUDA: the stream the H2D copies run on (created on first copy)
        self._forget()
        if slots == E:
            for layer in range(L):
                self._load(layer, range(E), range(E))
                self._slot_of[layer] = {e: e for e in range(E)}
            self._resident[:] = True
            self.reset_stats()

    def _forget(self) -> None:
        """The bookkeeping of an empty cache: nothing resident, every counter and recency at zero."""
        L, E = self.store.num_layers, self.store.num_experts
        self._slot_of: list[dict[int, int]] = [{} for _ in range(L)]   # expert -> slot, per layer
        self._resident = np.zeros((L, E), dtype=bool)  # the same residency as an array (resident_mask)
        self._last_use = [[0] * E for _ in range(L)]
        self._uses = [[0] * E for _ in range(L)]
        self._tick = 0
        self._stats = [LayerStats() for _ in range(L)]
        self._cold: list[set[int]] = [set() for _ in range(L)]   # demoted experts, evicted first
        # per layer, expert -> (last_use, uses, resident) before the open tentative forward touched it
        self._journal: list[dict[int, tuple[int, int, bool]]] | None = None
        self._held: list[dict[int, tuple[int, int, bool]]] | None = None  # closed, awaiting settle
        self._deferred: list[tuple[int, torch.Tensor, list | None]] = []  # touch_resident's pending counts
        self._slot_table: list[torch.Tensor | None] = [None] * L  # expert -> slot on the device, per layer
        self._ready: list[object | None] = [None] * L  # CUDA: per layer, the event of its last copies
        self._lookahead: list[list[float]] | None = None  # (L, E) demand read by a Lookahead policy

    def clear(self) -> None:
        """Return to the state of a new cache of the same settings without allocating or copying anything.

        With ``slots`` below E every expert is forgotten (the slots' memory is kept and overwritten by later
        loads); with every expert resident (``"all"``) the experts stay in their slots, as a new cache would
        load them. Either way every counter, recency, demotion, lookahead demand and pending record is
        reset, so what follows (results, counters, eviction order) is what a new cache gives.
        """
        self._flush_touches()
        self.timer.flush()
        full = self.slots == self.store.num_experts
        slot_of = self._slot_of
        self._forget()
        if full:
            self._slot_of = slot_of
            self._resident[:] = True

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.store.num_layers

    @property
    def device_bytes(self) -> int:
        """Device bytes held by the slots (or the staging buffer when ``slots=0``)."""
        if not self.gate_up:  # a model without MoE layers
            return 0
        per = self.gate_up[0].nbytes + self.down[0].nbytes
        return per * (self.num_layers if self.slots > 0 else 1)

    def all_resident(self, layer: int) -> bool:
        """Whether every expert of ``layer`` is in a device slot (known on the host: no device sync)."""
        return bool(self._resident[layer].all())

    def slot_table(self, layer: int) -> torch.Tensor:
        """The expert -> slot table of ``layer`` on the device: (E,) int64, -1 for an expert not resident.

        Built from the host's slot map the first time it is asked for after the layer's slots changed (one
        host-to-device copy), so a forward whose experts are all resident maps routed experts to slots on
        the device without reading the routing back. Before reading the slots, the caller's stream waits for
        the layer's pending copies (:meth:`wait_copies`).
        """
        table = self._slot_table[layer]
        if table is None:
            host = np.full(self.store.num_experts, -1, dtype=np.int64)
            for e, s in self._slot_of[layer].items():
                host[e] = s
            table = torch.from_numpy(host).to(self.device)
            self._slot_table[layer] = table
        self.wait_copies(layer)
        return table

    def wait_copies(self, layer: int) -> None:
        """CUDA: make the current stream wait (on the device, not the host) for the copies last issued into
        ``layer``'s slots on the copy stream; a no-op elsewhere and when none is pending."""
        ev = self._ready[layer]
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
            self._ready[layer] = None

    def cached_experts(self) -> list[list[int]]:
        """Expert ids resident per MoE layer, sorted (the selector's cache input C[l], SPECFIT.md §3).

        Returns
        -------
        list of list of int
            ``L`` lists; all empty when ``slots=0``.
        """
        return [sorted(m) for m in self._slot_of]

    def resident_mask(self) -> np.ndarray:
        """The same residency as :meth:`cached_experts`, as a bool array of shape (L, E) (a copy; kept
        up to date as experts are admitted and evicted, so reading it costs one copy, not a walk over the
        slots: the engine reads it at the start of every decoding cycle)."""
        return self._resident.copy()

    def recency(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The eviction state, what :class:`specfit.engine.twin.ARTwinCache` copies after a prefill.

        Returns
        -------
        tuple of numpy.ndarray, each shape (L, E)
            ``resident`` (bool), ``last_use`` (recency tick), ``uses`` (use count) and ``admitted``
            (admission order among the resident experts: the policy's ties go to the earliest).
            Experts demoted to the cold end (``admission="accepted"``) are not marked: AR decoding,
            which the twin replays, demotes none.
        """
        self._flush_touches()
        L, E = self.num_layers, self.store.num_experts
        resident, admitted = np.zeros((L, E), dtype=bool), np.zeros((L, E), dtype=np.int64)
        for layer, slot_of in enumerate(self._slot_of):
            ids = np.fromiter(slot_of, dtype=np.int64, count=len(slot_of))
            resident[layer, ids] = True
            admitted[layer, ids] = np.arange(1, ids.size + 1)
        return resident, np.asarray(self._last_use, dtype=np.int64), np.asarray(self._uses, dtype=np.int64), admitted

    def stats(self) -> dict:
        """Counters per layer and in total; never waits for the device (on CUDA, ``transfer_ms`` counts the
        copies whose end event has completed; synchronise the device first for all of them).

        Returns
        -------
        dict
            ``{"slots": int, "policy": str, "admission": str, "expert_bytes": int, "layers": [ {hits,
            misses, rejected_misses, prefetched, bytes_moved, transfer_ms}, ... ], "total": {same
            keys, plus "hit_rate"}}``;
            ``transfer_ms`` in milliseconds (CUDA events on CUDA, wall clock on CPU).
        """
        self._flush_touches()
        self.timer.flush(block=False)
        layers = [vars(s).copy() for s in self._stats]
        total = {k: sum([d[k] for d in layers]) for k in _STAT_KEYS}
        looked_up = total["hits"] + total["misses"]
        total["hit_rate"] = total["hits"] / looked_up if looked_up else 0.0
        return {"slots": self.slots, "policy": self.policy.name, "admission": self.admission,
                "expert_bytes": self.store.expert_bytes,
                "layers": layers, "total": total}

    def reset_stats(self) -> None:
        """Zero every counter (the cache contents stay)."""
        self._flush_touches()
        self.timer.flush()
        self._stats = [LayerStats() for _ in range(self.num_layers)]

    # -- movement --------------------------------------------------------------------------------
    def _load(self, layer: int, experts: Sequence[int], slots: Sequence[int], defer: bool = False) -> None:
        """H2D-copy ``experts`` into ``slots`` of ``layer``, count bytes and time.

        On CUDA the copies run on a dedicated copy stream: it first waits (on the device) for the work
        already queued on the compute stream, the last readers of the slots being overwritten, and an event
        recorded after the copies is what the compute stream waits for before it reads the layer's slots:
        at once, or with ``defer`` (:meth:`prefetch`) when the layer is next used (:meth:`wait_copies`), so
        that copies issued ahead of a forward overlap the kernels queued after them (a draft head's). The
        host never waits. Not exercised on a GPU in this repository's tests (the CPU path copies in place).
        """
        if not experts:
            return
        st = self._stats[layer]
        gu, dn = self.gate_up[layer], self.down[layer]
        self._slot_table[layer] = None
        if self.slots == 0:  # the staging buffer is shared by every layer
            self._slot_table = [None] * self.num_layers
        stream = None
        if self.device.type == "cuda":
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            stream = self._copy_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else _no_stream():
            t0 = self.timer.start()
            for e, s in zip(experts, slots):
                gu[s].copy_(self.store.gate_up[layer][e], non_blocking=True)
                dn[s].copy_(self.store.down[layer][e], non_blocking=True)
            self.timer.stop(t0, lambda ms: setattr(st, "transfer_ms", st.transfer_ms + ms))
            if stream is not None:
                ev = torch.cuda.Event()
                ev.record(stream)
                self._ready[layer] = ev
        if not defer:
            self.wait_copies(layer)
        st.bytes_moved += len(experts) * self.store.expert_bytes

    def _assign(self, layer: int, experts: Sequence[int], busy: set[int]) -> list[int]:
        """Choose slots for non-resident ``experts`` (empty slots first, then the policy's victims
        among resident experts not in ``busy``), update the maps and return the slots."""
        slot_of = self._slot_of[layer]
        self._slot_table[layer] = None
        free = sorted(set(range(self.slots)) - set(slot_of.values()))
        out = []
        for e in experts:
            if free:
                s = free.pop(0)
            else:
                cands = [x for x in slot_of if x not in busy]
                cold = [x for x in cands if x in self._cold[layer]]
                v = self._victim(layer, cold or cands)
                s = slot_of.pop(v)
                self._cold[layer].discard(v)
                self._resident[layer, v] = False
            slot_of[e] = s
            self._resident[layer, e] = True
            busy.add(e)
            out.append(s)
        return out

    def _victim(self, layer: int, candidates: list[int]) -> int:
        """The policy's victim among ``candidates`` of ``layer``, given the lookahead demand's row when
        the policy reads it (:class:`Lookahead`) and one is set."""
        demand = self._lookahead
        if demand is None or not getattr(self.policy, "uses_lookahead", False):
            return self.policy.victim(candidates, self._last_use[layer], self._uses[layer])
        return self.policy.victim(candidates, self._last_use[layer], self._uses[layer], demand[layer])

    # -- lookahead ------------------------------------------------------------------------------------
    def set_lookahead(self, demand) -> None:
        """Set the predicted near-future demand read by a lookahead policy's evictions (timing only, never
        results), until the next call.

        Parameters
        ----------
        demand : array_like of float, shape (L, E), or None
            Per MoE layer, the expected uses of each expert by the tokens about to come (e.g.
            :func:`specfit.core.lookahead.tree_expert_demand` of the current draft tree); ``None``
            clears it (the policy then evicts as its base policy). Ignored by the ``lru``/``lfu``
            policies.

        Raises
        ------
        SpecFitInputError
            If ``demand`` is not an (L, E) array of finite non-negative numbers (field ``demand``).
        """
        if demand is None:
            self._lookahead = None
            return
        L, E = self.num_layers, self.store.num_experts
        try:
            d = np.array(demand, dtype=np.float64)
        except (TypeError, ValueError):
            raise SpecFitInputError("demand", f"must be an ({L}, {E}) array of numbers") from None
        if d.shape != (L, E):
            raise SpecFitInputError("demand", f"must have shape (L, E) = ({L}, {E}), got {d.shape}")
        if not (np.isfinite(d) & (d >= 0)).all():
            raise SpecFitInputError("demand", "must be finite and non-negative (expected uses)")
        self._lookahead = d.tolist()  # rows of Python floats: the victim's min compares them one by one

    # -- cache-aware verification ---------------------------------------------------------------------
    def begin_tentative(self) -> None:
        """Start recording the experts the next forwards touch (a verify, whose draft nodes may be
        rejected); :meth:`settle` ranks them once the accepted path is known. Timing only, never results."""
        self._journal = [{} for _ in range(self.num_layers)]

    def end_tentative(self) -> None:
        """Stop recording (the recorded touches wait for :meth:`settle`)."""
        self._held, self._journal = self._journal, None

    def settle(self, accepted: Sequence[Iterable[int]] | None) -> None:
        """Rank the experts of the last tentative forward by what the accepted path used.

        With ``admission="accepted"``, an expert the tentative forward touched that no accepted node
        used (``accepted[l]``) gets its use undone: an expert that was resident before gets back its
        previous recency and use count; one transferred by that forward is demoted to the cold end
        of the eviction order (evicted before every expert not demoted) until a forward uses it again.
        So experts copied only for rejected draft nodes do not push out the experts the accepted
        path and the next tokens need (BENCHMARKS.md, "Cache-aware verification"). With
        ``admission="all"`` every touched expert stays counted as used (plain LRU/LFU).
        Results never change: only which slot is evicted next.

        Parameters
        ----------
        accepted : sequence of iterable of int, or None
            Per MoE layer, the experts routed by the accepted path's nodes (the root included);
            ``None`` discards the record without ranking (the tentative forward was abandoned).
        """
        journal, self._held = self._held, None
        if journal is None or accepted is None:
            return
        self._flush_touches()
        for layer, (seen, keep) in enumerate(zip(journal, accepted)):
            keep = set(int(e) for e in keep)
            self._stats[layer].rejected_misses += sum(not r and e not in keep for e, (_, _, r) in seen.items())
            if self.admission == "all":
                continue
            for e, (last, uses, was_resident) in seen.items():
                if e in keep or e not in self._slot_of[layer]:
                    continue
                self._last_use[layer][e], self._uses[layer][e] = last, uses
                if not was_resident:
                    self._cold[layer].add(e)

    def _prefetch_ids(self, layer: int, expert_ids: Iterable[int]) -> list[int]:
        """``expert_ids`` without repeats, in order, after checking ``layer`` and every id (see :meth:`prefetch`)."""
        if not 0 <= layer < self.num_layers:
            raise SpecFitInputError("layer", f"must be in [0, {self.num_layers}), got {layer}")
        ids = list(dict.fromkeys(int(e) for e in expert_ids))
        bad = [e for e in ids if not 0 <= e < self.store.num_experts]
        if bad:
            raise SpecFitInputError("expert_ids", f"must be in [0, {self.store.num_experts}), got {bad[0]}")
        return ids

    def prefetch(self, layer: int, expert_ids: Iterable[int], protect: Iterable[int] = ()) -> list[int]:
        """Make experts resident in ``layer`` ahead of a forward (changes timing only, never results).

        Parameters
        ----------
        layer : int
            MoE layer index.
        expert_ids : iterable of int
            Experts in priority order; at most ``slots`` of them are loaded (the first ones), and
            already resident ones are only marked as recently used. No-op when ``slots=0``.
        protect : iterable of int
            Resident experts the loads must not evict besides ``expert_ids`` (e.g. the ones the next
            forward is predicted to use); when every other slot is protected, fewer experts are loaded.

        Returns
        -------
        list of int
            The experts that were transferred.

        Raises
        ------
        SpecFitInputError
            If ``layer`` or an expert id is out of range.
        """
        ids = self._prefetch_ids(layer, expert_ids)
        keep = set(self._prefetch_ids(layer, protect))
        if self.slots == 0 or self.slots == self.store.num_experts:
            return []
        ids = ids[: self.slots]
        self._flush_touches()
        self._tick += 1
        for e in ids:
            self._last_use[layer][e] = self._tick
            self._cold[layer].discard(e)
        new = [e for e in ids if e not in self._slot_of[layer]]
        held = keep | set(ids)  # loads take a free slot or evict a resident expert outside these
        room = self.slots - len(self._slot_of[layer]) + sum(e not in held for e in self._slot_of[layer])
        new = new[:max(room, 0)]
        self._load(layer, new, self._assign(layer, new, held), defer=True)
        self._stats[layer].prefetched += len(new)
        return new

    def prefetch_layers(self, layer_expert_ids: Sequence[Iterable[int]],
                        protect: Sequence[Iterable[int]] | None = None) -> list[list[int]]:
        """:meth:`prefetch` for every MoE layer at once: what an engine calls with a selected tree's predicted
        experts while its draft head runs (on CUDA the copies are queued on the copy stream and this returns
        without waiting for them; results never change, only timing).

        Parameters
        ----------
        layer_expert_ids : sequence of iterable of int
            One list per MoE layer (``num_layers`` of them), experts in priority order.
        protect : sequence of iterable of int, optional
            One list per MoE layer: resident experts the loads must not evict (:meth:`prefetch`).

        Returns
        -------
        list of list of int
            Per layer, the experts transferred.

        Raises
        ------
        SpecFitInputError
            If the number of lists is not ``num_layers`` (field ``layer_expert_ids``) or an id is out of range.
        """
        if len(layer_expert_ids) != self.num_layers:
            raise SpecFitInputError("layer_expert_ids", f"must hold one list per MoE layer ({self.num_layers}), "
                                    f"got {len(layer_expert_ids)}")
        if protect is not None and len(protect) != self.num_layers:
            raise SpecFitInputError("protect", f"must hold one list per MoE layer ({self.num_layers}), got {len(protect)}")
        return [self.prefetch(layer, ids, () if protect is None else protect[layer])
                for layer, ids in enumerate(layer_expert_ids)]

    def touch_resident(self, layer: int, routing: torch.Tensor) -> None:
        """Count a forward's use of ``layer``'s experts, all resident, from its routing ``routing`` (n, k) on
        the device, without reading it now: the count (hits, recency, use counts, the tentative journal) is
        made, in the order of the forwards, the next time the host reads the bookkeeping (:meth:`stats`,
        :meth:`recency`, :meth:`settle`, or the next forward that needs the host's routing), all pending
        routings in one device-to-host copy. The same counters as :meth:`run_rounds` with hits only."""
        self._deferred.append((layer, routing, self._journal))
        if len(self._deferred) >= 4096:  # a long run nobody reads the counters of: apply them in bulk
            self._flush_touches()

    def _flush_touches(self) -> None:
        """Apply the pending :meth:`touch_resident` counts (one device-to-host copy of their routings)."""
        if not self._deferred:
            return
        pending, self._deferred = self._deferred, []
        rows = torch.cat([r for _, r, _ in pending]).cpu().tolist()  # every routing's (n, k) rows, in order
        start = 0
        for layer, r, journal in pending:
            n = r.shape[0]
            ids = sorted(set(rows[start]) if n == 1 else {e for row in rows[start:start + n] for e in row})
            start += n
            self._touch_now(layer, ids, journal)
            self._stats[layer].hits += len(ids)

    def _touch(self, layer: int, experts: Sequence[int], journal: bool = True) -> None:
        """Count one use of each of ``experts`` now (recency, use count; journalled in a tentative
        forward unless ``journal`` is False: a static cache has nothing to rank)."""
        self._flush_touches()
        self.wait_copies(layer)  # a forward is about to read the layer's slots
        self._touch_now(layer, experts, self._journal if journal else None)

    def _touch_now(self, layer: int, experts: Sequence[int], journal: list | None) -> None:
        slot_of, last_use, uses, cold = self._slot_of[layer], self._last_use[layer], self._uses[layer], self._cold[layer]
        self._tick += 1
        tick = self._tick
        seen = journal[layer] if journal is not None else None
        for e in experts:
            if seen is not None and e not in seen:  # its state before this forward's use
                seen[e] = (last_use[e], uses[e], e in slot_of)
            last_use[e] = tick
            uses[e] += 1
        if cold:
            cold.difference_update(experts)

    def run(self, layer: int, experts: Sequence[int],
            compute: Callable[[int, torch.Tensor, torch.Tensor], None], rows: Sequence[int] | None = None,
            num_tokens: int | None = None) -> None:
        """Call ``compute(e, gate_up_e, down_e)`` once for each expert in ``experts``, on device weights.

        Resident experts are hits and run in the first round; the others are misses, transferred in
        rounds of at most ``slots`` experts (the staging size when ``slots=0``). Within a round no
        slot handed out is evicted, so every call receives the weights of the expert it names; a
        round's experts are called in increasing id (:meth:`run_rounds`).

        Parameters
        ----------
        layer : int
            MoE layer index.
        experts : sequence of int
            Distinct expert ids the forward needs in this layer.
        compute : callable
            ``compute(expert_id, gate_up (2I, H), down (H, I))``; device tensors valid during the call.
        rows : sequence of int, optional
            (token, expert) rows of each expert of ``experts`` in the forward. Unused here, as is
        num_tokens : int, optional
            the forward's token count: the ``auto`` offload mode's cache chooses with both.
        """
        def each(ids: list[int], slots: list[int], gu: torch.Tensor, dn: torch.Tensor) -> None:
            for e, s in zip(ids, slots):
                compute(e, gu[s], dn[s])

        self.run_rounds(layer, experts, each)

    #: :meth:`run_rounds` hands a round's experts over in their device slots (the host-compute caches,
    #: whose misses run on host tensors, do not).
    grouped = True

    def run_rounds(self, layer: int, experts: Sequence[int],
                   compute_round: Callable[[list, list, torch.Tensor, torch.Tensor], None]) -> None:
        """Load ``experts`` of ``layer`` round by round and call ``compute_round`` once per round.

        The rounds are those of :meth:`run` (hits with the first misses, then the remaining misses in
        rounds of at most ``slots``; the staging size when ``slots=0``); within a round no slot handed
        out is evicted. The runtime runs a round's experts together (one gather of their rows, a product
        per used slot or one grouped kernel: ``OffloadedQwen3Moe.grouped_experts``), not one call per expert.

        Parameters
        ----------
        layer, experts
            As in :meth:`run`.
        compute_round : callable
            ``compute_round(ids, slots, gate_up (S, 2I, H), down (S, H, I))``: the round's expert ids in
            increasing order, the slot of each, and the layer's slot tensors (the staging buffer when
            ``slots=0``); valid during the call.
        """
        st, slot_of = self._stats[layer], self._slot_of[layer]
        self._touch(layer, experts)
        hits = [e for e in experts if e in slot_of]
        misses = [e for e in experts if e not in slot_of]
        st.hits += len(hits)
        st.misses += len(misses)
        gu, dn = self.gate_up[layer], self.down[layer]
        if self.slots == 0:
            width = gu.shape[0]
            for r in range(0, len(misses), width):
                batch = sorted(misses[r:r + width])
                self._load(layer, batch, range(len(batch)))
                compute_round(batch, list(range(len(batch))), gu, dn)
            return
        busy = set(hits)
        batch = misses[: self.slots - len(hits)]
        rest = misses[len(batch):]
        while True:
            slots = self._assign(layer, batch, busy)
            self._load(layer, batch, slots)
            ids = sorted(busy)
            compute_round(ids, [slot_of[e] for e in ids], gu, dn)
            if not rest:
                return
            busy = set()
            batch, rest = rest[: self.slots], rest[self.slots:]


def slots_for_budget(budget_bytes: int, resident_bytes: int, num_layers: int, num_experts: int,
                     expert_bytes: int) -> int:
    """Slots per layer that fit in a device memory budget.

    ``slots = floor((budget - resident) / (num_layers * expert_bytes))``, capped at ``num_experts``.

    Parameters
    ----------
    budget_bytes : int
        Device memory the runtime may use, bytes.
    resident_bytes : int
        Bytes already committed on the device (non-expert weights, KV cache, staging buffer).
    num_layers, num_experts : int
        MoE layers and experts per layer.
    expert_bytes : int
        Bytes of one expert.

    Returns
    -------
    int
        Slots per layer in [0, num_experts].

    Raises
    ------
    SpecFitInputError
        If the budget does not even hold the resident weights.
    """
    free = budget_bytes - resident_bytes
    if free < 0:
        raise SpecFitInputError("gpu_memory", f"{budget_bytes} bytes cannot hold the resident weights, "
                                f"KV cache and staging buffer ({resident_bytes} bytes)")
    return min(num_experts, free // (num_layers * expert_bytes))
