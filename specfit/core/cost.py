"""The cycle-time cost model, named hardware profiles, and calibration from measured cycles.

The model (SPECFIT.md §3) predicts the time of one verify cycle that verifies the node set S:

    T(S) = fixed_ms + per_node_ms * |S| + sum_l [per_expert_ms[l] * |U_l(S) \\ C[l]| + read_ms * |U_l(S)|]

where ``U_l(S) = union_{v in S} E[v][l]`` are the experts the nodes of S route to in MoE layer l and
``C[l]`` the experts already resident in the device expert cache. ``|S|`` counts the root. Every expert
of ``U_l(S)`` is read once from device memory (``read_ms``: its bytes over the memory bandwidth); a
missing one is first copied host-to-device (``per_expert_ms``: its bytes over the link bandwidth).
T prices one cycle against the cache at its start, not the next cycle's cost through what the verify leaves
resident: the bound on that myopic approximation is SPECFIT.md §3, "What a verify leaves resident".
"""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import ClassVar, Sequence

import numpy as np

from specfit.core.errors import (MAX_LAYERS, MAX_MS, MIN_CYCLE_MS, SpecFitInputError, check_int, check_number,
                                   check_positive_int, lookup)
from specfit.core.host_cost import HOST_COSTS, HostCosts, host_costs_from_json

#: Bytes of one Qwen3-30B-A3B expert in bf16: (gate, up, down) = 3 * 2048 * 768 params * 2 bytes.
QWEN3_30B_A3B_EXPERT_BYTES = 9_437_184
#: MoE layers of Qwen3-30B-A3B, the deployed target the profiles describe.
REFERENCE_LAYERS = 48
#: Experts per MoE layer of Qwen3-30B-A3B.
QWEN3_30B_A3B_EXPERTS = 128
#: Experts each token routes to per MoE layer in Qwen3-30B-A3B (``num_experts_per_tok``).
QWEN3_30B_A3B_TOP_K = 8


def check_ms(name: str, value) -> float:
    """``value`` as a duration in ms: a finite number in [0, MAX_MS] (:func:`~specfit.core.errors.check_number`;
    not a bool or a string; :data:`~specfit.core.errors.MAX_MS` keeps every sum over an instance finite).

    Raises
    ------
    SpecFitInputError
        On ``name``, if it is not a number, not finite, negative or above ``MAX_MS``.
    """
    return check_number(name, value, 0.0, MAX_MS, unit="a duration in ms")


def check_bandwidth(name: str, value) -> float:
    """``value`` as a bandwidth in GB/s: a finite float > 0.

    Raises
    ------
    SpecFitInputError
        On ``name``: missing (None), not a number, not finite, or <= 0.
    """
    if value is None:
        raise SpecFitInputError(name, "is required (a bandwidth in GB/s, 1 GB = 1e9 bytes)")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise SpecFitInputError(name, f"must be a number (GB/s), got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(v) or v <= 0:
        raise SpecFitInputError(name, f"must be a finite number > 0 (GB/s), got {value!r}")
    return v


def bytes_ms(num_bytes: int, gb_per_s: float) -> float:
    """Milliseconds to move ``num_bytes`` at ``gb_per_s`` (1 GB = 1e9 bytes): ``bytes / (GB/s * 1e9) * 1e3``."""
    return num_bytes / (gb_per_s * 1e9) * 1e3


@dataclass(frozen=True)
class CostModel:
    """Constants of the cycle-time model, in milliseconds.

    Parameters
    ----------
    fixed_ms : float
        Time of a verify forward that does not depend on the tree (dense weights, launch overhead).
    per_node_ms : float
        Extra time per verified node (root included).
    per_expert_ms : float or sequence of float
        H2D transfer time of one uncached expert; one number, or one per MoE layer.
    read_ms : float
        Time of one read of one expert's weights from device memory (expert bytes / memory
        bandwidth), paid by every expert the verify routes to, resident or copied (default 0: a
        model without the resident-read term, as instance JSON written before the term existed).
    name : str
        A label, e.g. the profile name; informational.
    reference_layers : int, optional
        Hardware profiles: MoE layers of the deployed target the constants describe (Qwen3-30B-A3B:
        48); :meth:`for_layers` scales a smaller model's expert term to it.
    num_experts : int, optional
        Hardware profiles: experts per MoE layer of that target (Qwen3-30B-A3B: 128).
    draft_level_ms : float, optional
        Hardware profiles: modeled time of one EAGLE-3 draft level (one head forward) in ms.
    host_level_ms : float, optional
        Hardware profiles: host CPU time paid per draft level by the engine besides the head
        forward, in ms: the level's share of calibration, tree building, expert prediction and exact
        solves (level-by-level selection), the prior the engine uses until it has measured its own.
        Charged by the whole-cycle objective (SPECFIT.md §3, "Whole-cycle objective").
    expert_bytes : int, optional
        Bytes of one expert's weights (Qwen3-30B-A3B in bf16: 9,437,184), the source of the expert terms.
    memory_gb_per_s, link_gb_per_s : float, optional
        Device memory and host-to-device link bandwidths (GB/s, 1 GB = 1e9 bytes) that give ``read_ms``
        and ``per_expert_ms`` (:meth:`from_bandwidths`); informational once those are set.
    experts_per_token : int, optional
        Experts each token routes to per MoE layer (Qwen3-30B-A3B: top-8). When a caller prices a verify
        without its routed-expert counts, :meth:`cycle_ms` reads at least this many per layer (exact for
        one node, e.g. the AR step; a lower bound for more).

    The last seven describe the deployment and take no part in T(S); they are not compared and not
    written to the instance JSON.

    Raises
    ------
    SpecFitInputError
        If any constant is negative, NaN or infinite, or a bandwidth or ``expert_bytes`` is not > 0
        (the error names the field).
    """

    #: The offload regime whose verify time the model prices (:class:`HostProfile`: ``"host"``).
    regime: ClassVar[str] = "transfer"

    fixed_ms: float
    per_node_ms: float
    per_expert_ms: float | tuple[float, ...]
    name: str = field(default="custom", compare=False)
    reference_layers: int | None = field(default=None, compare=False)
    num_experts: int | None = field(default=None, compare=False)
    draft_level_ms: float | None = field(default=None, compare=False)
    host_level_ms: float | None = field(default=None, compare=False)
    read_ms: float = 0.0
    expert_bytes: int | None = field(default=None, compare=False)
    memory_gb_per_s: float | None = field(default=None, compare=False)
    link_gb_per_s: float | None = field(default=None, compare=False)
    experts_per_token: int | None = field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "fixed_ms", check_ms("cost.fixed_ms", self.fixed_ms))
        object.__setattr__(self, "per_node_ms", check_ms("cost.per_node_ms", self.per_node_ms))
        pe = self.per_expert_ms
        if isinstance(pe, (list, tuple, np.ndarray)):
            if len(pe) == 0:
                raise SpecFitInputError("cost.per_expert_ms", "a per-layer list must not be empty")
            pe = tuple(check_ms(f"cost.per_expert_ms[{i}]", x) for i, x in enumerate(pe))
        else:
            pe = check_ms("cost.per_expert_ms", pe)
        object.__setattr__(self, "per_expert_ms", pe)
        for name in ("draft_level_ms", "host_level_ms"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_ms(f"cost.{name}", getattr(self, name)))
        object.__setattr__(self, "read_ms", check_ms("cost.read_ms", self.read_ms))
        for name in ("memory_gb_per_s", "link_gb_per_s"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_bandwidth(f"cost.{name}", getattr(self, name)))
        if self.expert_bytes is not None:
            object.__setattr__(self, "expert_bytes", check_positive_int("cost.expert_bytes", self.expert_bytes))
        if self.experts_per_token is not None:
            object.__setattr__(self, "experts_per_token",
                               check_positive_int("cost.experts_per_token", self.experts_per_token))
        if self.fixed_ms + self.per_node_ms < MIN_CYCLE_MS:
            raise SpecFitInputError("cost.fixed_ms", f"fixed_ms + per_node_ms must be >= {MIN_CYCLE_MS} ms so that every "
                                    f"cycle takes time (a throughput 1000 A / T stays finite), got "
                                    f"{self.fixed_ms + self.per_node_ms}")

    @classmethod
    def from_bandwidths(cls, fixed_ms: float, per_node_ms: float, *, expert_bytes: int, memory_gb_per_s: float,
                        link_gb_per_s: float, name: str = "custom", **meta) -> "CostModel":
        """A model whose expert terms come from datasheet (or measured) bandwidths:
        ``read_ms = expert_bytes / memory bandwidth`` and ``per_expert_ms = expert_bytes / link bandwidth``
        (:func:`bytes_ms`; the copy rounded to 1e-4 ms, the read to 1e-6 ms).

        Parameters
        ----------
        fixed_ms, per_node_ms : float
            As the class (ms).
        expert_bytes : int
            Bytes of one expert's weights.
        memory_gb_per_s, link_gb_per_s : float
            Device memory bandwidth and host-to-device link bandwidth, GB/s (1 GB = 1e9 bytes).
        name : str
        **meta
            ``reference_layers``, ``num_experts``, ``experts_per_token``, ``draft_level_ms``, ``host_level_ms``.

        Raises
        ------
        SpecFitInputError
            Naming the field: a bandwidth missing (None), not a number, NaN, infinite or <= 0;
            ``expert_bytes`` not a positive integer; a time negative or not finite.
        """
        nbytes = check_positive_int("cost.expert_bytes", expert_bytes)
        mem = check_bandwidth("cost.memory_gb_per_s", memory_gb_per_s)
        link = check_bandwidth("cost.link_gb_per_s", link_gb_per_s)
        return cls(fixed_ms, per_node_ms, round(bytes_ms(nbytes, link), 4), name=name,
                   read_ms=round(bytes_ms(nbytes, mem), 6), expert_bytes=nbytes, memory_gb_per_s=mem,
                   link_gb_per_s=link, **meta)

    @property
    def level_ms(self) -> float:
        """ms paid per draft level: ``draft_level_ms + host_level_ms`` (a missing field counts 0)."""
        return (self.draft_level_ms or 0.0) + (self.host_level_ms or 0.0)

    def read_array(self, num_layers: int) -> np.ndarray:
        """``read_ms`` per layer: float64 of shape (num_layers,), read-only (kept for the next call)."""
        memo = self.__dict__.get("_read_memo")
        if memo is not None and memo[0] == num_layers and memo[1] == self.read_ms:
            return memo[2]
        w = np.full(num_layers, float(self.read_ms))
        w.setflags(write=False)
        object.__setattr__(self, "_read_memo", (num_layers, self.read_ms, w))
        return w

    def segment_ms(self, num_layers: int) -> np.ndarray:
        """The ms of one item of each item segment the solvers price (:class:`specfit.core.coverage.PricedItems`):
        per layer ``per_expert_ms`` (an uncached expert's copy), plus ``read_ms`` (its read) when that is not 0,
        then, when ``read_ms > 0``, ``read_ms`` per layer (a resident expert's read). Float64 of shape (L,) or
        (2L,), read-only.

        Raises
        ------
        SpecFitInputError
            As :meth:`per_expert_array`.
        """
        pe = self.per_expert_array(num_layers)
        if not self.read_ms:
            return pe
        memo = self.__dict__.get("_segment_memo")
        if memo is not None and memo[0] == num_layers and memo[1] == self.read_ms:
            return memo[2]
        rd = self.read_array(num_layers)
        w = np.concatenate([pe + rd, rd])
        w.setflags(write=False)
        object.__setattr__(self, "_segment_memo", (num_layers, self.read_ms, w))
        return w

    def uncached_ms_array(self, num_layers: int) -> np.ndarray:
        """ms of one uncached expert per layer, its copy and its read: ``per_expert_ms + read_ms``, float64 of
        shape (num_layers,), read-only and the same array on every call for the same L (callers may memoise
        on its identity). The price of an expert the predictor missed. Raises as :meth:`per_expert_array`."""
        if not self.read_ms:
            return self.per_expert_array(num_layers)
        memo = self.__dict__.get("_uncached_memo")
        seg = self.segment_ms(num_layers)
        if memo is None or memo[0] is not seg:
            memo = (seg, seg[:num_layers])
            object.__setattr__(self, "_uncached_memo", memo)
        return memo[1]

    def per_expert_array(self, num_layers: int) -> np.ndarray:
        """``per_expert_ms`` as float64 of shape (num_layers,), read-only (kept for the next call).

        Raises
        ------
        SpecFitInputError
            If a per-layer list does not have ``num_layers`` entries.
        """
        memo = self.__dict__.get("_per_expert_memo")  # (num_layers, array): the engine prices every cycle
        if memo is not None and memo[0] == num_layers:
            return memo[1]
        if isinstance(self.per_expert_ms, tuple):
            if len(self.per_expert_ms) != num_layers:
                raise SpecFitInputError("cost.per_expert_ms", f"has {len(self.per_expert_ms)} entries but the "
                                        f"instance has {num_layers} MoE layers")
            w = np.asarray(self.per_expert_ms, dtype=np.float64)
        else:
            w = np.full(num_layers, float(self.per_expert_ms))
        w.setflags(write=False)  # shared by later calls
        object.__setattr__(self, "_per_expert_memo", (num_layers, w))
        return w

    def check_layers(self, num_layers: int) -> None:
        """Check that the model can price an instance with ``num_layers`` MoE layers.

        Raises
        ------
        SpecFitInputError
            If a per-layer ``per_expert_ms`` list does not have ``num_layers`` entries.
        """
        self.per_expert_array(num_layers)

    def cycle_ms(self, num_nodes: int, new_experts_per_layer: Sequence[int] | np.ndarray,
                 rows_per_layer=None, read_per_layer=None) -> float:
        """Predicted cycle time in ms for ``num_nodes`` verified nodes (root included), the given
        count of uncached experts per layer, shape (L,), and the count of every expert the verify
        routes to per layer (``read_per_layer``, |U_l(S)|, shape (L,)). SPECFIT.md §3, T(S).

        Without ``read_per_layer`` the verify is taken to read ``max(new_l, experts_per_token)`` experts in
        layer l (each of its tokens routes to that many distinct experts; ``new_l`` without
        ``experts_per_token``): exact for one node (the AR step, the root alone), a lower bound of T for
        more. It is not used when ``read_ms`` is 0.

        ``rows_per_layer`` (the (token, expert) rows of those experts) is accepted so that both
        regimes price measured counts through one call, and ignored: a copied expert costs the same
        whatever the number of tokens routed to it (:meth:`HostProfile.cycle_ms` prices rows). The expert
        term is summed layer by layer, in layer order: the uncached experts at ``per_expert_ms[l] + read_ms``
        each, then the resident ones (``read_per_layer - new_experts_per_layer``) at ``read_ms`` (no BLAS dot,
        whose order and fused multiply-adds vary by machine), so that compiled code (the item segments of
        :meth:`segment_ms`) reproduces T bit for bit.

        Raises
        ------
        SpecFitInputError
            If ``read_per_layer`` does not have the shape of the uncached counts."""
        m = np.asarray(new_experts_per_layer, dtype=np.float64)
        if not m.size:  # no expert term (every expert cached, or no MoE layer in the tree)
            return self.fixed_ms + self.per_node_ms * num_nodes
        experts_ms = 0.0  # layer by layer, in order: compiled code (the exact solver) sums the same floats
        w_all = self.segment_ms(m.shape[0]).tolist()
        L = m.shape[0]
        for w, c in zip(w_all[:L], m.reshape(-1).tolist()):
            experts_ms += w * c
        if self.read_ms and (read_per_layer is not None or self.experts_per_token):
            r = (np.maximum(m, float(self.experts_per_token)) if read_per_layer is None
                 else np.asarray(read_per_layer, dtype=np.float64))
            if r.shape != m.shape:
                raise SpecFitInputError("read_per_layer", f"must have the shape of the uncached counts {m.shape}")
            for w, c in zip(w_all[L:], (r - m).reshape(-1).tolist()):  # the resident experts read
                experts_ms += w * c
        return self.fixed_ms + self.per_node_ms * num_nodes + experts_ms

    @property
    def min_node_ms(self) -> float:
        """A lower bound (ms) on what one more verified node adds to T(S) for any S: ``per_node_ms``
        (the expert term only grows with S). The stop rule and the AR gate rely on it
        (:mod:`specfit.solvers.stop`)."""
        return self.per_node_ms

    def min_node_ms_for(self, cache: np.ndarray) -> float:
        """:attr:`min_node_ms` given the expert cache of the cycle (shape (L, num_experts)): the same
        ``per_node_ms`` whatever the cache."""
        return self.per_node_ms

    def plus_ms(self, ms: float) -> "CostModel":
        """This model with ``ms`` added to every T(S) (a cost of the cycle that does not depend on S,
        e.g. the draft levels already paid): ``fixed_ms + ms``.

        Raises
        ------
        SpecFitInputError
            If ``ms`` is not a finite number >= 0 (field ``ms``).
        """
        return self.with_costs(self.fixed_ms + check_ms("ms", ms), self.per_node_ms)

    def with_costs(self, fixed_ms: float, per_node_ms: float) -> "CostModel":
        """This model with ``fixed_ms`` and ``per_node_ms`` replaced, both already checked (finite, >= 0,
        their sum > 0): the engine prices every cycle anew, so no other field is re-checked (as
        ``dataclasses.replace`` would) and the per-layer expert array is kept."""
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        object.__setattr__(out, "fixed_ms", fixed_ms)
        object.__setattr__(out, "per_node_ms", per_node_ms)
        return out

    def node_added_ms(self, root_new_per_layer, node_new, node_rows) -> np.ndarray:
        """Per draft node v, a lower bound (ms) on what verifying v beside the root adds to T(root
        alone) beyond :attr:`min_node_ms`: the transfer and the read of v's experts that neither the
        cache nor the root holds (``per_expert_ms + read_ms`` each; the reads of v's cached experts that
        the root does not route to are left out, so the bound holds without knowing them).

        Parameters
        ----------
        root_new_per_layer : array-like of int, shape (L,)
            Uncached experts of the root per layer (unused here).
        node_new : numpy.ndarray of int, shape (m, L)
            Per node, its experts neither cached nor the root's, per layer.
        node_rows : numpy.ndarray of int, shape (m, L)
            Per node, its uncached experts per layer (unused here).

        Returns
        -------
        numpy.ndarray of float64, shape (m,)
        """
        new = np.asarray(node_new)
        return new @ (self.per_expert_array(new.shape[1]) + self.read_ms)

    def for_layers(self, num_layers: int, reference_layers: int | None = None) -> "CostModel":
        """This model for a target with ``num_layers`` MoE layers standing in for one with
        ``reference_layers`` (default: the profile's, else :data:`REFERENCE_LAYERS` = 48 of
        Qwen3-30B-A3B): ``per_expert_ms`` is scaled by
        ``reference_layers / num_layers``, i.e. each layer's miss count is taken as representative
        of ``reference_layers / num_layers`` real layers, so that the expert term keeps its weight
        against ``fixed_ms`` and ratios between methods stay honest; ``read_ms`` likewise. A per-layer
        list is first averaged. Used for modeled times of the small proxy models; label results as modeled.

        Raises
        ------
        SpecFitInputError
            If ``num_layers`` or ``reference_layers`` is not a positive integer.
        """
        if reference_layers is None:
            reference_layers = self.reference_layers or REFERENCE_LAYERS
        check_positive_int("num_layers", num_layers)
        check_positive_int("reference_layers", reference_layers)
        pe = self.per_expert_ms
        mean = sum(pe) / len(pe) if isinstance(pe, tuple) else pe
        return CostModel(self.fixed_ms, self.per_node_ms, mean * reference_layers / num_layers,
                         name=f"{self.name}@{num_layers}/{reference_layers}layers", reference_layers=reference_layers,
                         num_experts=self.num_experts, draft_level_ms=self.draft_level_ms,
                         host_level_ms=self.host_level_ms, read_ms=self.read_ms * reference_layers / num_layers,
                         expert_bytes=self.expert_bytes, memory_gb_per_s=self.memory_gb_per_s,
                         link_gb_per_s=self.link_gb_per_s, experts_per_token=self.experts_per_token)

    def to_json(self) -> dict:
        """The ``cost`` object of the instance JSON (SPECFIT.md §4); ``read_ms`` only when it is not 0."""
        pe = list(self.per_expert_ms) if isinstance(self.per_expert_ms, tuple) else self.per_expert_ms
        out = {"fixed_ms": self.fixed_ms, "per_node_ms": self.per_node_ms, "per_expert_ms": pe}
        if self.read_ms:
            out["read_ms"] = self.read_ms
        return out

    @classmethod
    def from_json(cls, obj, name: str = "custom") -> "CostModel | HostProfile":
        """Build from the instance JSON's ``cost`` object; one with ``"regime": "host"`` is a
        :class:`HostProfile` (:meth:`HostProfile.from_json`).

        Raises
        ------
        SpecFitInputError
            If ``obj`` is not an object, a key is missing or unknown, or a value is bad. ``read_ms`` is
        optional (default 0: an instance written without the resident-read term).
        """
        if not isinstance(obj, dict):
            raise SpecFitInputError("cost", "must be an object with fixed_ms, per_node_ms, per_expert_ms")
        if obj.get("regime", "transfer") not in ("transfer", "host"):
            raise SpecFitInputError("cost.regime", f"must be 'transfer' or 'host' (or absent: transfer), got {obj['regime']!r}")
        if "regime" in obj and obj["regime"] != "transfer":  # the host-compute regime's object
            return HostProfile.from_json(obj)
        keys = {"fixed_ms", "per_node_ms", "per_expert_ms"}
        for k in keys:
            if k not in obj:
                raise SpecFitInputError(f"cost.{k}", "is required")
        extra = set(obj) - keys - {"regime", "read_ms"}
        if extra:
            raise SpecFitInputError(f"cost.{sorted(extra)[0]}", "is not a known cost field")
        return cls(obj["fixed_ms"], obj["per_node_ms"], obj["per_expert_ms"], name=name,
                   read_ms=obj.get("read_ms", 0.0))


#: Datasheet bandwidths of the profiles' GPUs and links, GB/s (1 GB = 1e9 bytes), and their sources.
#: RTX 4090: 1,008 GB/s GDDR6X (NVIDIA GeForce RTX 4090 specifications: 21 Gbps on a 384-bit bus).
#: H200: 4,800 GB/s HBM3e (NVIDIA H200 Tensor Core GPU datasheet, "GPU memory bandwidth 4.8 TB/s").
#: PCIe Gen4 x16: 31.5 GB/s per direction on paper, pinned host-to-device copies achieve 22-26 GB/s
#: (SPECFIT.md §5): the profile takes 24. PCIe Gen5 x16: 63 GB/s on paper, 45-55 GB/s achieved
#: (SPECFIT.md §5); this runtime's pinned copies moved 48-53 GB/s on an H200 (BENCHMARKS.md, "First CUDA
#: run"): the profile takes 50. A read at the datasheet peak is a lower bound on the time of the real
#: read (a batch-1 expert GEMV reaches 70-90% of peak): the model's reads are optimistic, not pessimistic.
GPU_MEMORY_GB_PER_S = {"rtx-4090": 1008.0, "h100-sxm": 3350.0, "h200": 4800.0}
LINK_GB_PER_S = {"pcie4-x16-achieved": 24.0, "pcie5-x16-achieved": 50.0}

#: Named hardware profiles for Qwen3-30B-A3B (datasheet-derived, not measured here).
#:
#: Expert terms (both profiles): one expert is :data:`QWEN3_30B_A3B_EXPERT_BYTES` = 9,437,184 bytes in
#: bf16 (gate, up and down projections, 3 x 2048 x 768 parameters x 2 bytes). ``read_ms`` = those bytes
#: over the GPU's memory bandwidth (:data:`GPU_MEMORY_GB_PER_S`), ``per_expert_ms`` = over the link's
#: (:data:`LINK_GB_PER_S`); :meth:`CostModel.from_bandwidths`.
#:
#: ``qwen3-30b-a3b-pcie4`` — a 24 GB consumer GPU (RTX 4090 class) on PCIe Gen4 x16. H2D at 24 GB/s:
#: one expert takes 0.393 ms; its read at 1,008 GB/s 0.0094 ms (an AR step's 8 x 48 experts: 3.6 ms).
#: fixed_ms: the ~3.1 GB of non-expert weights read once per forward at ~1 TB/s (~3.1 ms) plus
#: ~48 layers of attention/router/norm kernel launches (~3 ms in eager PyTorch) ≈ 6 ms.
#: per_node_ms: attention + expert FLOPs per extra verified token (3.3 B active params, 6.6 GFLOP
#: per token at ~80 dense TFLOP/s effective ≈ 0.08 ms) ≈ 0.1 ms.
#:
#: draft_level_ms, one EAGLE-3 draft level: the Qwen3-30B-A3B EAGLE-3 head (SPECFIT.md §5: fc
#: 3·2048→2048, one Llama decoder layer with a 2H attention input and a 6,144-wide MLP, lm_head over a
#: 32k draft vocabulary) has ~0.15 B parameters ≈ 0.3 GB in bf16; a level is memory-bound at these
#: batch sizes (<= 16 rows). pcie4 (RTX 4090 class, ~1 TB/s): 0.3 ms of weight reads + ~15 kernel
#: launches and the top-k host sync (~0.2 ms) ≈ 0.5 ms; h200 (~4.8 TB/s): 0.06 ms + ~0.2 ms ≈ 0.25 ms.
#: Estimates from datasheet bandwidths, not measurements.
#:
#: host_level_ms, host CPU time per draft level (both profiles, the host CPU is the same kind): one
#: ``exact`` solve of a ~64-node instance through the Python path, 0.57 ms wall median on one core, plus
#: the default frequency predictor on one level's nodes, ~50 µs per call, ≈ 0.6 ms: conservative, since
#: ``exact`` solves a 64-node instance in a median 0.134–0.141 ms wall (BENCHMARKS.md, "Solvers"); the
#: engine uses its own measured host ms after the first drafted cycle. Measured on this project's CPU, not
#: on the deployment's.
#:
#: ``qwen3-30b-a3b-h200`` — an H200 on PCIe Gen5 x16: at 50 GB/s one expert's copy takes 0.189 ms; its
#: read at 4,800 GB/s 0.00197 ms (an AR step's 384 experts: 0.75 ms). fixed_ms: 3.1 GB at ~4.3 TB/s
#: (~0.7 ms) plus launches (~2.3 ms) ≈ 3 ms; per_node_ms ≈ 0.03 ms (~790 bf16 TFLOP/s peak, ~25% achieved).
#: Measured on an H200 (BENCHMARKS.md, "Runtime"): this runtime's pinned copies move 48-53 GB/s,
#: 0.178-0.196 ms per expert, so the transfer term holds; its eager forward took ~3 ms per decoder layer
#: (per-operation host cost, inferred; not profiled; ~145 ms for 48 layers) with one call per expert, so
#: fixed_ms describes a runtime with fused MoE kernels and CUDA graphs. ``python -m specfit.eval.cost_fit``
#: measures a profile of the runtime on the machine it runs on (BENCHMARKS.md, "Cycle-time model against
#: the runtime").
#:
#: ``qwen3-30b-a3b-h100`` — an H100 SXM (80 GB HBM3, 3.35 TB/s; NVIDIA H100 datasheet) on PCIe Gen5 x16, the
#: h200 profile with the H100's memory: a read takes 0.00282 ms (an AR step's 384 experts: 1.08 ms); fixed_ms
#: 3.1 GB at ~3.0 TB/s (~1.0 ms) plus the same launches (~2.3 ms) ≈ 3.3 ms; per_node_ms 0.03 ms (the same
#: ~990 dense bf16 TFLOP/s); draft_level_ms 0.3 GB at ~3.0 TB/s (0.1 ms) + ~0.2 ms ≈ 0.3 ms. It prices this
#: project's runs on a lent H100 (:func:`datasheet_profile`); the grids use pcie4 and h200.
PROFILES: dict[str, CostModel] = {
    "qwen3-30b-a3b-pcie4": CostModel.from_bandwidths(
        6.0, 0.1, expert_bytes=QWEN3_30B_A3B_EXPERT_BYTES, memory_gb_per_s=GPU_MEMORY_GB_PER_S["rtx-4090"],
        link_gb_per_s=LINK_GB_PER_S["pcie4-x16-achieved"], name="qwen3-30b-a3b-pcie4",
        reference_layers=REFERENCE_LAYERS, num_experts=QWEN3_30B_A3B_EXPERTS, experts_per_token=QWEN3_30B_A3B_TOP_K,
        draft_level_ms=0.5, host_level_ms=0.6),
    "qwen3-30b-a3b-h200": CostModel.from_bandwidths(
        3.0, 0.03, expert_bytes=QWEN3_30B_A3B_EXPERT_BYTES, memory_gb_per_s=GPU_MEMORY_GB_PER_S["h200"],
        link_gb_per_s=LINK_GB_PER_S["pcie5-x16-achieved"], name="qwen3-30b-a3b-h200",
        reference_layers=REFERENCE_LAYERS, num_experts=QWEN3_30B_A3B_EXPERTS, experts_per_token=QWEN3_30B_A3B_TOP_K,
        draft_level_ms=0.25, host_level_ms=0.6),
    "qwen3-30b-a3b-h100": CostModel.from_bandwidths(
        3.3, 0.03, expert_bytes=QWEN3_30B_A3B_EXPERT_BYTES, memory_gb_per_s=GPU_MEMORY_GB_PER_S["h100-sxm"],
        link_gb_per_s=LINK_GB_PER_S["pcie5-x16-achieved"], name="qwen3-30b-a3b-h100",
        reference_layers=REFERENCE_LAYERS, num_experts=QWEN3_30B_A3B_EXPERTS, experts_per_token=QWEN3_30B_A3B_TOP_K,
        draft_level_ms=0.3, host_level_ms=0.6),
}

#: The profile the evaluation uses unless told otherwise (the consumer-GPU deployment).
DEFAULT_PROFILE = "qwen3-30b-a3b-pcie4"


def datasheet_profile(device_name: str) -> str:
    """The named profile whose datasheet figures describe a GPU, from its name as CUDA reports it
    (``torch.cuda.get_device_name()``, e.g. ``"NVIDIA H100 80GB HBM3"``).

    Parameters
    ----------
    device_name : str
        The device's name.

    Returns
    -------
    str
        ``qwen3-30b-a3b-h100`` for an H100 SXM (HBM3; the PCIe and NVL boards have other memory bandwidths),
        ``qwen3-30b-a3b-h200`` for an H200 and for any other device (the profile the runtime's targets name).
    """
    name = str(device_name).upper()
    if "H100" in name and "PCIE" not in name and "NVL" not in name:
        return "qwen3-30b-a3b-h100"
    return "qwen3-30b-a3b-h200"


#: Peak DRAM bandwidths of named desktop hosts, GB/s (1 GB = 1e9 bytes), from datasheets: a DDR channel
#: is 64 bits (8 bytes) wide, so peak = channels x 8 B x MT/s (Wikipedia, "Multi-channel memory
#: architecture"). Dual-channel DDR5-5600: 89.6 GB/s, Intel's "Max Memory Bandwidth" of the Core
#: i9-13900K (2 channels, DDR5-5600; quoted at zaro.info/processor-memory-support/
#: what-is-the-max-ram-speed-for-intel-core-i9-13900k). Quad-channel DDR4-2666 (HEDT, e.g. an RTX
#: 2080 desktop): 4 x 8 B x 2666 MT/s = 85.3 GB/s. Dual-channel DDR4-3200: 2 x 8 B x
#: 3200 = 51.2 GB/s (AIDA64 reads ~43-46 GB/s on such a kit, guru3d.com G.Skill TridentZ Royal
#: DDR4-3200 review p. 9: peaks are not reached, so host times from them are lower bounds).
DRAM_GB_PER_S = {"ddr5-5600-2ch": 89.6, "ddr4-2666-4ch": 4 * 8 * 2666e6 / 1e9, "ddr4-3200-2ch": 2 * 8 * 3200e6 / 1e9}

#: Host ms per (token, expert) row of a bf16 Qwen3-30B-A3B expert on an 8-core desktop: the row's
#: 2 x 3 x 2048 x 768 = 9.44 MFLOP at the per-core fp32 rate measured by ``eval/host_bench.py`` on the
#: 2-vCPU VM of BENCHMARKS.md ("Host-compute regime": per_row_ms 0.31 ms on one core in run 1, the
#: most conservative of three runs; 0.17 ms on the quiet machine) times 8 cores (the 8 P-cores of a
#: Core i9-13900K). Measured shape, scaled by a datasheet core count: an estimate, labelled so in
#: every modeled figure.
HOST_ROW_MS_8CORE = round(0.31 / 8, 4)

#: Per MoE layer that computes experts on the host: the (n, H) activations go device-to-host and
#: the results back, and the device waits for the host. **Assumed**, not measured (no GPU here):
#: two small PCIe copies and a stream synchronize at ~10 us each. Not measured yet.
HOST_SYNC_MS = 0.03


@dataclass(frozen=True)
class HostProfile:
    """A hardware profile of the host-compute offload regime (``offload="host"``): cached experts
    run on the GPU, the others on the CPU from host DRAM, in parallel, per MoE layer.

    Modeled time of one verify of ``n`` nodes, per MoE layer ``l`` of the deployed target
    (SPECFIT.md §3, "Host-compute regime"):

        T_l = max(g, h_l) + sync_ms * [u_l > 0],   g = (gpu.fixed_ms + gpu.per_node_ms * n) / R,
        h_l = host_per_expert_ms * u_l + host_per_row_ms * r_l

    with ``u_l`` the experts computed on the host (the union of the uncached experts the nodes need:
    each is read from DRAM once per verify), ``r_l`` their (token, expert) rows and ``R`` the
    profile's reference layers (48); T = extra_ms + sum_l T_l. The GPU part also reads each resident
    expert the nodes route to once from device memory: ``g_l = g + gpu.read_ms * s_l`` with ``s_l =
    |U_l(S) ∩ C_l|`` (``resident_per_layer``; 0 when not given, and when the GPU side has no
    ``read_ms``). With nothing on the host T equals the GPU profile's ``fixed_ms + per_node_ms * n``
    plus its reads. A proxy with L < R MoE layers stands for the
    deployed target as in :meth:`CostModel.for_layers`: each of its layers counts for R / L real ones.

    The ``auto`` offload mode ("choose per expert") may also copy some uncached experts
    H2D into the device cache, each at :attr:`copy_ms` on the link, in series with the GPU part
    while the host computes the rest: with ``c_l`` experts copied in layer l,

        T_l = max(g + gpu.read_ms * s_l + (copy_ms + gpu.read_ms) * c_l, h_l) + sync_ms * [u_l > 0]

    (``u_l``, ``r_l`` now count only the experts left to the host; a copied expert is read too). ``c_l = 0`` is the host regime,
    ``u_l = 0`` the transfer regime's ``g + per_expert_ms * c_l``. :meth:`split` chooses ``c_l``.

    The selection's cost model in the host regime (SPECFIT.md §3, "Host-compute regime"): an
    :class:`~specfit.core.instance.Instance` with this cost has T(S) = :meth:`cycle_ms` of
    ``|S|``, ``u_l(S) = |(union_v E[v][l]) \\ C[l]|`` and ``r_l(S) = sum_v |E[v][l] \\ C[l]|``, and the
    solvers, the stop rule and the AR gate use it (T is monotone in S but, through the max, not a
    closure objective). It also prices recorded cycles in eval (labelled modeled).

    Parameters
    ----------
    name : str
    gpu : CostModel
        The GPU side: a transfer-regime profile of :data:`PROFILES` (its ``per_expert_ms`` is the
        H2D copy of one expert, used only by the ``auto`` mode: :attr:`copy_ms`).
    dram_gb_per_s : float
        Datasheet peak DRAM bandwidth of the host (:data:`DRAM_GB_PER_S`).
    host_per_expert_ms : float
        Host ms per expert: its bf16 bytes read at ``dram_gb_per_s``.
    host_per_row_ms : float
        Host ms per (token, expert) row (:data:`HOST_ROW_MS_8CORE`).
    sync_ms : float
        Per MoE layer with host experts (:data:`HOST_SYNC_MS`).
    num_layers : int, optional
        MoE layers of the model whose counts are priced (default: the reference layers).
    extra_ms : float
        ms added to every T outside the per-layer max (:meth:`plus_ms`: the draft levels of the
        cycle already paid, whole-cycle objective); 0 for a profile.
    node_extra_ms : float
        ms every draft node (every node but the root) adds to T outside the per-layer max:
        T = extra_ms + node_extra_ms * (n - 1) + sum_l T_l. The engine's price of the uncached
        experts its expert predictor misses per draft node (:meth:`specfit.engine.online.OnlineModel.corrected_cost`);
        0 for a profile.

    Raises
    ------
    SpecFitInputError
        If a time is negative or not finite.
    """

    #: The offload regime whose verify time the profile prices.
    regime: ClassVar[str] = "host"

    name: str
    gpu: CostModel
    dram_gb_per_s: float
    host_per_expert_ms: float
    host_per_row_ms: float
    sync_ms: float
    num_layers: int | None = None
    extra_ms: float = 0.0
    node_extra_ms: float = 0.0

    def __post_init__(self):
        for name in ("host_per_expert_ms", "host_per_row_ms", "sync_ms", "extra_ms", "node_extra_ms"):
            object.__setattr__(self, name, check_ms(f"cost.{name}", getattr(self, name)))

    @property
    def reference_layers(self) -> int:
        return self.gpu.reference_layers or REFERENCE_LAYERS

    @property
    def num_experts(self) -> int | None:
        """Experts per MoE layer of the deployed target (the GPU side's)."""
        return self.gpu.num_experts

    @property
    def draft_level_ms(self) -> float | None:
        return self.gpu.draft_level_ms

    @property
    def host_level_ms(self) -> float | None:
        return self.gpu.host_level_ms

    @property
    def level_ms(self) -> float:
        """ms paid per draft level (the GPU side's :attr:`CostModel.level_ms`)."""
        return self.gpu.level_ms

    @property
    def read_ms(self) -> float:
        """ms to read one expert resident on the GPU (the GPU side's :attr:`CostModel.read_ms`)."""
        return self.gpu.read_ms

    @property
    def min_node_ms(self) -> float:
        """A lower bound (ms) on what one more verified node adds to T(S) for any S: **0** (plus
        ``node_extra_ms``, which every draft node adds outside the max).

        Per layer a node raises ``g`` by ``gpu.per_node_ms / R`` and ``h_l`` by at least
        ``host_per_row_ms * r_v,l``, so ``max(g, h_l)`` grows by at least the smaller of the two
        (``max(a + x, b + y) - max(a, b) >= min(x, y)`` for x, y >= 0). A node whose experts are all
        cached has ``r_v,l = 0``, and where the host part binds (``h_l >= g`` after the node) it adds
        nothing: no positive bound holds for every S and v (SPECFIT.md §3)."""
        return self.node_extra_ms

    def min_node_ms_for(self, cache: np.ndarray) -> float:
        """:attr:`min_node_ms` given the expert cache of the cycle, ``cache`` of shape (L, num_experts):
        a layer whose every expert is cached computes nothing on the host (h_l = 0 for every S), so
        there the GPU part binds and each node adds ``c * gpu.per_node_ms / R``; other layers add
        >= 0. With every layer full this is ``gpu.per_node_ms``, the transfer regime's bound; with no
        expert layer (L = 0) T is ``extra_ms + gpu_ms(n)`` and the bound is ``gpu.per_node_ms``.

        Raises
        ------
        SpecFitInputError
            If the cache's layers do not match a profile scaled to other layers.
        """
        cache = np.asarray(cache, dtype=bool)
        L = cache.shape[0]
        if L == 0:
            return self.gpu.per_node_ms + self.node_extra_ms
        self.check_layers(L)
        return self.gpu.per_node_ms * int(cache.all(axis=1).sum()) / L + self.node_extra_ms

    def plus_ms(self, ms: float) -> "HostProfile":
        """This profile with ``ms`` added to every T outside the per-layer max (``extra_ms``).

        Raises
        ------
        SpecFitInputError
            If ``ms`` is not a finite number >= 0 (field ``ms``), as :meth:`CostModel.plus_ms`.
        """
        return replace(self, extra_ms=self.extra_ms + check_ms("ms", ms))

    def gpu_only(self) -> CostModel:
        """The transfer-regime model equal to this profile when nothing runs on the host (every
        ``u_l = r_l = 0``): T = ``extra_ms + gpu.fixed_ms + gpu.per_node_ms * n + node_extra_ms * (n - 1)``,
        linear in n (a cost model's ``fixed_ms`` is >= 0: needs ``node_extra_ms <= gpu.fixed_ms + extra_ms``).

        Raises
        ------
        SpecFitInputError
            If ``node_extra_ms`` exceeds ``gpu.fixed_ms + extra_ms``."""
        return CostModel(self.gpu.fixed_ms + self.extra_ms - self.node_extra_ms, self.gpu.per_node_ms + self.node_extra_ms,
                         0.0, name=f"{self.name}:gpu-only")

    def check_layers(self, num_layers: int) -> None:
        """Check that the profile can price an instance with ``num_layers`` MoE layers.

        Raises
        ------
        SpecFitInputError
            If the profile was scaled (:meth:`for_layers`) to another number of layers.
        """
        if num_layers and self.num_layers is not None and num_layers != self.num_layers:
            raise SpecFitInputError("cost", f"the host profile is scaled to {self.num_layers} MoE layers but the "
                                    f"instance has {num_layers}")

    def for_layers(self, num_layers: int) -> "HostProfile":
        """This profile pricing a model with ``num_layers`` MoE layers (each counts for R / L real ones).

        Raises
        ------
        SpecFitInputError
            If ``num_layers`` is not a positive integer.
        """
        check_positive_int("num_layers", num_layers)
        return replace(self, num_layers=num_layers)

    def gpu_ms(self, num_nodes: int) -> float:
        """The GPU forward without host experts, ``gpu.fixed_ms + gpu.per_node_ms * n``, ms."""
        return self.gpu.fixed_ms + self.gpu.per_node_ms * num_nodes

    @property
    def copy_ms(self) -> float:
        """ms to copy one expert H2D (the GPU side's ``per_expert_ms``; a per-layer list: its mean)."""
        pe = self.gpu.per_expert_ms
        return float(np.mean(pe)) if isinstance(pe, tuple) else float(pe)

    def cycle_ms(self, num_nodes: int, host_experts_per_layer, host_rows_per_layer=None,
                 copied_per_layer=None, resident_per_layer=None) -> float:
        """Modeled verify ms (class docstring) for counts of shape (L,) each.

        ``host_rows_per_layer`` defaults to ``host_experts_per_layer``: one row per host expert, as
        for a single node (the AR step). ``copied_per_layer``: experts copied H2D by the ``auto``
        mode (default none: the host regime). ``resident_per_layer``: resident experts the nodes route
        to, each read once on the GPU (``gpu.read_ms``); default ``max(0, gpu.experts_per_token - u_l -
        c_l)``, exact for one node (the AR step), a lower bound of T for more (0 without
        ``experts_per_token``).

        Raises
        ------
        SpecFitInputError
            If the count arrays differ in length.
        """
        u = np.asarray(host_experts_per_layer, dtype=np.float64)
        r = u if host_rows_per_layer is None else np.asarray(host_rows_per_layer, dtype=np.float64)
        if u.shape != r.shape:
            raise SpecFitInputError("host_rows_per_layer", f"must have the shape of the expert counts {u.shape}")
        c = s_ = None
        for name, arr in (("copied_per_layer", copied_per_layer), ("resident_per_layer", resident_per_layer)):
            if arr is not None:
                x = np.asarray(arr, dtype=np.float64)
                if x.shape != u.shape:
                    raise SpecFitInputError(name, f"must have the shape of the expert counts {u.shape}")
                if name == "copied_per_layer":
                    c = x.reshape(-1).tolist()
                else:
                    s_ = x.reshape(-1).tolist()
        k = self.gpu.experts_per_token
        if s_ is None and k and self.gpu.read_ms:  # each token routes to k distinct experts per layer
            s_ = [max(0.0, k - a - (c[l] if c else 0.0)) for l, a in enumerate(u.reshape(-1).tolist())]
        return self.layers_ms(num_nodes, u.reshape(-1).tolist(), r.reshape(-1).tolist(), c, s_)[0]

    def layers_ms(self, num_nodes: int, host_experts: Sequence[float], host_rows: Sequence[float],
                  copied: Sequence[float] | None = None, resident: Sequence[float] | None = None) -> tuple[float, int]:
        """:meth:`cycle_ms` on plain per-layer lists (no checks; the solvers' inner loop), and the
        bitmask of the layers where the GPU part binds (bit l set iff ``g_l >= h_l``, ``g_l = g +
        read_ms * s_l + (copy_ms + read_ms) * c_l``)."""
        extra = self.extra_ms + self.node_extra_ms * (num_nodes - 1) if self.node_extra_ms else self.extra_ms
        rd = self.gpu.read_ms
        if not host_experts:
            return extra + self.gpu_ms(num_nodes), 0
        g = self.gpu_ms(num_nodes) / self.reference_layers
        pe, pr, sync, a = self.host_per_expert_ms, self.host_per_row_ms, self.sync_ms, self.copy_ms
        total, gpu_bound = 0.0, 0
        for l, (u, r) in enumerate(zip(host_experts, host_rows)):
            h = pe * u + pr * r
            gl = g + a * copied[l] if copied else g
            if rd:
                gl += rd * ((resident[l] if resident else 0.0) + (copied[l] if copied else 0.0))
            if gl >= h:
                total += gl
                gpu_bound |= 1 << l
            else:
                total += h
            if u:
                total += sync
        return extra + total * self.reference_layers / len(host_experts), gpu_bound

    def split(self, num_nodes: int, rows: Sequence[int], max_copy: int, resident: int = 0) -> tuple[int, float]:
        """The ``auto`` mode's choice in one MoE layer: how many of its uncached experts to copy H2D
        (into the device cache) rather than compute on the host, to minimise the layer's time.

        With ``k`` experts copied, T_l(k) = max(g + copy_ms * k, h(rest)) + sync_ms * [k < u] (class
        docstring). For a fixed k the copy term does not depend on which experts are copied and the
        host term is smallest when the k with the most rows go (each host expert costs
        ``host_per_expert_ms + host_per_row_ms * rows``), so enumerating k = 0..min(u, max_copy) over
        the row counts sorted in decreasing order finds the minimum exactly. Ties go to the smaller
        k (fewer copies, fewer evictions).

        Parameters
        ----------
        num_nodes : int
            Tokens in the forward (verified nodes; 1 for an AR step).
        rows : sequence of int, shape (u,)
            (token, expert) rows of each uncached expert the forward needs, **in decreasing order**.
        max_copy : int
            Copies allowed (free device slots for this forward), >= 0.
        resident : int
            Resident experts of the layer the forward routes to, each read once on the GPU
            (``gpu.read_ms``; a copied expert is read too: ``copy_ms + read_ms`` each). Default 0.

        Returns
        -------
        (int, float)
            k, and T_l(k) in ms per real layer (without ``extra_ms``).

        References
        ----------
        SPECFIT.md §3, "Host-compute regime" (the ``auto`` mode, "choose per expert").
        """
        rd = self.gpu.read_ms
        g = self.gpu_ms(num_nodes) / self.reference_layers + rd * resident
        pe, pr, sync, a = self.host_per_expert_ms, self.host_per_row_ms, self.sync_ms, self.copy_ms + rd
        u = len(rows)
        host = pe * u + pr * float(sum(rows))
        best_k, best = 0, max(g, host) + (sync if u else 0.0)
        for k in range(1, min(u, max_copy) + 1):
            if g + a * k >= best:  # the copy term only grows with k
                break
            host -= pe + pr * rows[k - 1]
            t = max(g + a * k, host) + (sync if k < u else 0.0)
            if t < best:
                best_k, best = k, t
        return best_k, best

    def split_cycle_ms(self, num_nodes: int, rows_per_layer: Sequence[Sequence[int]]) -> float:
        """Modeled verify ms when every layer splits its uncached experts as :meth:`split` chooses
        (no cap on copies): the ``auto`` mode's verify time.

        Parameters
        ----------
        num_nodes : int
            Tokens verified (1 for an AR step).
        rows_per_layer : sequence of sequence of int, shape (L, u_l)
            Per MoE layer, the (token, expert) rows of each uncached expert, in decreasing order
            (for an AR step every row count is 1).

        Returns
        -------
        float
            ms: ``extra_ms`` plus the sum of each layer's :meth:`split` time, scaled by R / L
            (SPECFIT.md §3, "The `auto` offload mode").
        """
        if not rows_per_layer:
            return self.extra_ms + self.gpu_ms(num_nodes)
        k = self.gpu.experts_per_token or 0  # resident experts read on the GPU: at least k - uncached per layer
        total = sum(self.split(num_nodes, rows, len(rows), max(0, k - len(rows)))[1] for rows in rows_per_layer)
        return self.extra_ms + total * self.reference_layers / len(rows_per_layer)

    def node_added_ms(self, root_new_per_layer, node_new, node_rows) -> np.ndarray:
        """Per draft node v, what verifying v beside the root adds to T(root alone) beyond
        :attr:`min_node_ms` (``node_extra_ms``, which every draft node adds), ms:
        ``T({root, v}) - T({root}) - node_extra_ms`` (>= 0: the per-layer max is monotone). T is
        monotone in S, so any selection holding v costs at least T(root) + min_node_ms plus this. With
        ``gpu.read_ms > 0`` it is 0 (the resident reads, unknown here, can raise the GPU part above the
        host part's growth: no positive bound holds without them).
        Arguments and shapes as :meth:`CostModel.node_added_ms` (the root's uncached experts are also
        its rows); float64 of shape (m,)."""
        root = np.asarray(root_new_per_layer)
        if self.gpu.read_ms:  # the resident reads are unknown here: raising g can hide h's growth; 0 is sound
            return np.zeros(len(node_new), dtype=np.float64)
        base = self.cycle_ms(1, root) + self.node_extra_ms
        return np.array([self.cycle_ms(2, root + new, root + rows) - base
                         for new, rows in zip(np.asarray(node_new), np.asarray(node_rows))], dtype=np.float64)

    def to_json(self) -> dict:
        """The profile's constants: run metadata, and the instance JSON's ``cost`` object of the host
        regime (SPECFIT.md §4; :meth:`from_json` reads it back)."""
        return {"regime": "host", "name": self.name, "gpu": self.gpu.to_json(), "dram_gb_per_s": self.dram_gb_per_s,
                "host_per_expert_ms": self.host_per_expert_ms, "host_per_row_ms": self.host_per_row_ms,
                "sync_ms": self.sync_ms, "reference_layers": self.reference_layers, "num_layers": self.num_layers,
                "extra_ms": self.extra_ms, "node_extra_ms": self.node_extra_ms}

    _JSON_REQUIRED = ("regime", "gpu", "host_per_expert_ms", "host_per_row_ms", "sync_ms")
    _JSON_OPTIONAL = ("name", "dram_gb_per_s", "reference_layers", "num_layers", "extra_ms", "node_extra_ms")

    @classmethod
    def from_json(cls, obj) -> "HostProfile":
        """Build from a host-regime ``cost`` object (:meth:`to_json`; SPECFIT.md §4).

        Raises
        ------
        SpecFitInputError
            If a key is missing or unknown, ``regime`` is not ``"host"``, or a value is bad.
        """
        for k in cls._JSON_REQUIRED:
            if k not in obj:
                raise SpecFitInputError(f"cost.{k}", "is required in a host-regime cost object")
        extra = set(obj) - set(cls._JSON_REQUIRED) - set(cls._JSON_OPTIONAL)
        if extra:
            raise SpecFitInputError(f"cost.{sorted(extra)[0]}", "is not a known host-regime cost field")
        if obj["regime"] != "host":
            raise SpecFitInputError("cost.regime", f"must be 'host' (or absent for the transfer regime), got {obj['regime']!r}")
        ref = obj.get("reference_layers")
        gpu = CostModel.from_json(obj["gpu"])
        if ref is not None:
            gpu = replace(gpu, reference_layers=check_int("cost.reference_layers", ref, 1, MAX_LAYERS))
        layers = obj.get("num_layers")
        if layers is not None:
            check_int("cost.num_layers", layers, 1, MAX_LAYERS)
        dram = check_number("cost.dram_gb_per_s", obj.get("dram_gb_per_s", 0.0), 0.0, unit="GB/s")
        if not isinstance(obj.get("name", ""), str):
            raise SpecFitInputError("cost.name", f"must be a string, got {obj['name']!r}")
        return cls(str(obj.get("name", "custom")), gpu, dram, obj["host_per_expert_ms"],
                   obj["host_per_row_ms"], obj["sync_ms"], layers, obj.get("extra_ms", 0.0),
                   obj.get("node_extra_ms", 0.0))


def _host_profile(host: str, gpu: str) -> HostProfile:
    bw = DRAM_GB_PER_S[host]
    return HostProfile(f"{gpu}+host-{host}", PROFILES[gpu], round(bw, 1),
                       round(QWEN3_30B_A3B_EXPERT_BYTES / (bw * 1e9) * 1e3, 4), HOST_ROW_MS_8CORE, HOST_SYNC_MS)


#: Host-regime profiles by name: the GPU side of a transfer profile with a named desktop host
#: (sources at :data:`DRAM_GB_PER_S`, :data:`HOST_ROW_MS_8CORE`, :data:`HOST_SYNC_MS`). Modeled.
HOST_PROFILES: dict[str, HostProfile] = {
    p.name: p for p in (_host_profile("ddr5-5600-2ch", "qwen3-30b-a3b-pcie4"),
                        _host_profile("ddr4-2666-4ch", "qwen3-30b-a3b-pcie4"),
                        _host_profile("ddr4-3200-2ch", "qwen3-30b-a3b-pcie4"))}
#: The host profile ``--offload host`` prices with unless told otherwise.
DEFAULT_HOST_PROFILE = "qwen3-30b-a3b-pcie4+host-ddr5-5600-2ch"


def get_host_profile(name: str) -> HostProfile:
    """Return the named host-regime profile of :data:`HOST_PROFILES`.

    Raises
    ------
    SpecFitInputError
        If ``name`` is not a known host profile (field ``host_profile``).
    """
    return lookup(HOST_PROFILES, name, "host_profile")


def get_profile(name: str) -> CostModel:
    """Return the named hardware profile (see :data:`PROFILES` for the sources of each number), or the
    profile in the JSON file ``name`` when it is not a profile name but a path ending in ``.json`` or an
    existing file (:func:`load_profile`: e.g. one written by ``python -m specfit.eval.cost_fit``).

    Raises
    ------
    SpecFitInputError
        If ``name`` is neither a known profile nor a profile file, or the file is invalid
        (:func:`load_profile`).
    """
    if isinstance(name, str) and name not in PROFILES and (name.endswith(".json") or Path(name).is_file()):
        return load_profile(name)
    return lookup(PROFILES, name, "profile")


#: Keys of a profile file (:func:`load_profile`).
PROFILE_FILE_KEYS = ("name", "fixed_ms", "per_node_ms", "per_expert_ms", "read_ms", "expert_bytes", "memory_gb_per_s",
                     "link_gb_per_s", "reference_layers", "num_experts", "experts_per_token", "draft_level_ms",
                     "host_level_ms", "host_costs", "about")


def profile_from_json(obj, where: str = "profile") -> CostModel:
    """A hardware profile from its JSON object (the file ``specfit eval --profile FILE`` reads).

    Keys: ``fixed_ms`` and ``per_node_ms`` (required, ms); the copy of a missing expert, ``per_expert_ms``
    (ms) or ``expert_bytes`` with ``link_gb_per_s``; the read of a routed expert, ``read_ms`` (ms) or
    ``expert_bytes`` with ``memory_gb_per_s`` (a time given in ms wins; the bandwidths are then kept as
    the profile's stated sources); optional ``name``, ``reference_layers``, ``num_experts``,
    ``draft_level_ms``, ``host_level_ms``, ``host_costs`` (the engine's host prices per count,
    :func:`specfit.core.host_cost.host_costs_from_json`; read by :func:`get_host_costs`) and ``about``
    (free text or object: where the numbers come from).

    Raises
    ------
    SpecFitInputError
        One error naming the field (``profile.<key>``): not an object, an unknown key, a required key
        missing (a missing bandwidth names the bandwidth), a time negative or not finite, a bandwidth
        not a finite number > 0, a count not a positive integer.
    """
    if not isinstance(obj, dict):
        raise SpecFitInputError(where, "must be a JSON object of profile constants")
    extra = set(obj) - set(PROFILE_FILE_KEYS)
    if extra:
        raise SpecFitInputError(f"{where}.{sorted(extra)[0]}", f"is not a known profile field ({', '.join(PROFILE_FILE_KEYS)})")
    for k in ("fixed_ms", "per_node_ms"):
        if k not in obj:
            raise SpecFitInputError(f"{where}.{k}", "is required (ms)")
    nbytes = obj.get("expert_bytes")
    if nbytes is not None:
        nbytes = check_positive_int(f"{where}.expert_bytes", nbytes)
    bw = {}
    for ms_key, bw_key in (("per_expert_ms", "link_gb_per_s"), ("read_ms", "memory_gb_per_s")):
        if obj.get(bw_key) is not None or obj.get(ms_key) is None:
            bw[bw_key] = check_bandwidth(f"{where}.{bw_key}", obj.get(bw_key))  # missing both: names the bandwidth
        if obj.get(ms_key) is None and nbytes is None:
            raise SpecFitInputError(f"{where}.expert_bytes", f"is required to derive {ms_key} from {bw_key}")
    pe = check_ms(f"{where}.per_expert_ms", obj["per_expert_ms"]) if obj.get("per_expert_ms") is not None else \
        round(bytes_ms(nbytes, bw["link_gb_per_s"]), 6)
    rd = check_ms(f"{where}.read_ms", obj["read_ms"]) if obj.get("read_ms") is not None else \
        round(bytes_ms(nbytes, bw["memory_gb_per_s"]), 6)
    meta = {}
    for k in ("reference_layers", "num_experts", "experts_per_token"):
        if obj.get(k) is not None:
            meta[k] = check_positive_int(f"{where}.{k}", obj[k])
    for k in ("draft_level_ms", "host_level_ms"):
        if obj.get(k) is not None:
            meta[k] = check_ms(f"{where}.{k}", obj[k])
    if "host_costs" in obj:  # checked with the rest; get_host_costs reads them
        host_costs_from_json(obj["host_costs"], f"{where}.host_costs")
    return CostModel(check_ms(f"{where}.fixed_ms", obj["fixed_ms"]), check_ms(f"{where}.per_node_ms", obj["per_node_ms"]),
                     pe, name=str(obj.get("name", where)), read_ms=rd, expert_bytes=nbytes,
                     memory_gb_per_s=bw.get("memory_gb_per_s"), link_gb_per_s=bw.get("link_gb_per_s"), **meta)


def get_host_costs(name: str) -> HostCosts:
    """The engine's host prices (ms per count of host work, :mod:`specfit.core.host_cost`) that go with the
    profile ``name``: a profile file's ``host_costs`` when it has them, else :data:`specfit.core.host_cost.HOST_COSTS`
    (every named profile's: the host CPU is the same whichever GPU verifies).

    Raises
    ------
    SpecFitInputError
        As :func:`get_profile`; a file's ``host_costs`` invalid (field ``profile.host_costs.<kind>``).
    """
    get_profile(name)  # a bad name or file: one error
    if isinstance(name, str) and name not in PROFILES:
        from specfit.core.readers import read_json

        obj = read_json(name, "profile")
        if "host_costs" in obj:
            return host_costs_from_json(obj["host_costs"], "profile.host_costs")
    return HOST_COSTS


def load_profile(path: str | Path) -> CostModel:
    """Read a profile file (:func:`profile_from_json`), e.g. the output of ``python -m specfit.eval.cost_fit``.

    Raises
    ------
    SpecFitInputError
        If the file is missing, unreadable or not JSON (field ``profile``), or its content is invalid.
    """
    from specfit.core.readers import read_json

    return profile_from_json(read_json(path, "profile"), "profile")


@dataclass(frozen=True)
class Calibration:
    """Result of :func:`calibrate`: the fitted model and how well it fits.

    ``rmse_ms`` is the root-mean-square residual in ms, ``rel_residual`` is ``||r|| / ||y||``.
    """

    cost: CostModel
    rmse_ms: float
    rel_residual: float
    num_records: int


def calibrate(num_nodes: Sequence[int], misses_per_layer, measured_ms: Sequence[float], *,
              per_layer: bool = False, name: str = "calibrated") -> Calibration:
    """Fit ``fixed_ms``, ``per_node_ms`` and ``per_expert_ms`` by non-negative least squares.

    Parameters
    ----------
    num_nodes : sequence of int, shape (R,)
        Nodes verified in each measured cycle (root included).
    misses_per_layer : array-like of int, shape (R, L)
        Uncached experts transferred in each layer of each cycle.
    measured_ms : sequence of float, shape (R,)
        Measured cycle time in ms.
    per_layer : bool
        Fit one ``per_expert_ms`` per layer (needs R >= L + 2) instead of one shared constant.

    Returns
    -------
    Calibration

    Raises
    ------
    SpecFitInputError
        On mismatched lengths, fewer records than unknowns, or negative/NaN measurements.

    References
    ----------
    Lawson & Hanson, *Solving Least Squares Problems* (1974), ch. 23 (NNLS), via
    ``scipy.optimize.nnls``.
    """
    from scipy.optimize import nnls

    nodes = np.asarray(num_nodes, dtype=np.float64)
    miss = np.asarray(misses_per_layer, dtype=np.float64)
    y = np.asarray(measured_ms, dtype=np.float64)
    if miss.ndim != 2 or miss.shape[0] != nodes.shape[0] or y.shape != nodes.shape:
        raise SpecFitInputError("misses_per_layer", "must have shape (R, L) with R = len(num_nodes) = len(measured_ms)")
    if not np.all(np.isfinite(y)) or np.any(y < 0):
        raise SpecFitInputError("measured_ms", "must be finite and >= 0")
    cols = [np.ones_like(nodes), nodes] + ([miss[:, l] for l in range(miss.shape[1])] if per_layer else [miss.sum(1)])
    a = np.stack(cols, axis=1)
    if a.shape[0] < a.shape[1]:
        raise SpecFitInputError("measured_ms", f"need at least {a.shape[1]} cycle records, got {a.shape[0]}")
    x, rnorm = nnls(a, y)
    if x[0] + x[1] <= 0:
        # The records show no time that transfers do not explain (noisy timings on a loaded machine
        # can do this); a cycle still takes time (CostModel's rule), so fixed_ms becomes the smallest
        # unexplained part of a measured cycle, at least 1 ns.
        x[0] = max(float(np.min(y - a[:, 2:] @ x[2:])), 1e-6)
    pe = tuple(float(v) for v in x[2:]) if per_layer else float(x[2])
    cost = CostModel(float(x[0]), float(x[1]), pe, name=name)
    ynorm = float(np.linalg.norm(y))
    return Calibration(cost, float(rnorm / math.sqrt(len(y))), float(rnorm / ynorm) if ynorm else 0.0, len(y))
