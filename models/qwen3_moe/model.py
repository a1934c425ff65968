"""Qwen3-MoE forward with offloaded experts: prefill, decode, tree verify, KV compaction.

The model (Qwen team 2025, "Qwen3 Technical Report", §2; transformers' ``Qwen3MoeForCausalLM`` is
the numerical reference) is, per decoder layer::

    x = x + o_proj(attention(rope(q_norm(q_proj(rms(x)))), rope(k_norm(k_proj(rms(x)))), v_proj(rms(x))))
    x = x + moe(rms(x))            # or a dense SwiGLU MLP for layers outside moe_layers

with RMSNorm (Zhang & Sennrich 2019), rotary embeddings (Su et al. 2021, RoFormer §3.4; the
"rotate-half" layout), grouped-query attention (Ainslie et al. 2023) with per-head RMSNorm on
queries and keys, and the MoE block ``moe(x) = sum_{e in topk} w_e * expert_e(x)`` where
``w = softmax(router(x))`` restricted to the top-k and divided by its sum when ``norm_topk_prob``.

Every forward is a *tree* forward over ``n`` new tokens with ``parents`` (SPECFIT.md §2): token ``i``
attends to the whole KV prefix and to its ancestors (itself included) and sits at position
``prefix_len + depth(i)``. Prefill and decode are chains and commit at once; :meth:`verify` writes
the tree's KV past the prefix and :meth:`commit` keeps one accepted root path.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from specfit.models.devices import default_dtype, resolve_device
from specfit.models.experts import DeviceExpertCache, HostExpertStore, check_cache_args, parse_bytes, slots_for_budget
from specfit.models.host_compute import AutoOffloadCache, HostComputeCache, check_offload
from specfit.models.qwen3_moe.checkpoint import CheckpointReader, load_dense, load_experts
from specfit.models.qwen3_moe.config import Qwen3MoeSpec, read_spec
from specfit.core.errors import SpecFitInputError, check_positive_int, check_single_sequence
from specfit.core.tree import DraftTree


class ForwardOutput:
    """What one forward returns, one row per new token (tree node).

    Attributes
    ----------
    logits : torch.Tensor
        (n, V) float32, next-token logits of each node.
    routing : torch.Tensor
        (n, L, k) int64 on the CPU, the router's top-k experts per node and MoE layer, in
        decreasing router probability (the true routing E[v][l] of SPECFIT.md §3). The forward keeps
        it on the device; the host copy is made on first access (on CUDA that access waits for the
        forward), so a forward whose experts are all resident never reads anything back itself.
    routing_device : torch.Tensor
        The same (n, L, k) int64 on the model's device.
    aux_hidden : torch.Tensor
        (n, len(aux_layers) * H) in the model dtype: the concatenated hidden states an EAGLE-3 head
        reads (see :func:`default_aux_layers` for the index convention).
    last_hidden : torch.Tensor
        (n, H) in the model dtype: the final-norm output, the input of ``lm_head``.
    """

    __slots__ = ("logits", "routing_device", "aux_hidden", "last_hidden", "_routing_host")

    def __init__(self, logits: torch.Tensor, routing: torch.Tensor, aux_hidden: torch.Tensor,
                 last_hidden: torch.Tensor):
        self.logits, self.routing_device = logits, routing
        self.aux_hidden, self.last_hidden = aux_hidden, last_hidden
        self._routing_host = routing if routing.device.type == "cpu" else None

    @property
    def routing(self) -> torch.Tensor:
        """(n, L, k) int64 on the CPU (copied from :attr:`routing_device` on first access)."""
        if self._routing_host is None:
            self._routing_host = self.routing_device.cpu()
        return self._routing_host

    def __repr__(self) -> str:
        return (f"ForwardOutput(logits={tuple(self.logits.shape)}, routing={tuple(self.routing_device.shape)}, "
                f"device={self.logits.device})")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default feature layers ``(2, L // 2, L - 3)`` (Li et al. 2025, EAGLE-3, §3.2).

    Index convention: index ``i`` is the hidden state *after* ``i`` decoder layers, i.e. the output
    of 0-based decoder layer ``i - 1`` and the input of layer ``i``; index 0 is the embedding output.
    This equals transformers' ``output_hidden_states=True`` tuple entry ``hidden_states[i]`` for
    ``i < L``, the capture point of the public EAGLE-3 code (the state entering layers 2, L//2 and
    L-3) and SGLang/vLLM's ``eagle_aux_hidden_state_layer_ids``. For targets too shallow for three
    increasing ids (L < 7) it uses ``(1, L // 2, L - 1)``, the rule of
    ``models.eagle3.default_aux_layer_ids``, clipped to ``[0, L]``.
    """
    ids = (2, num_layers // 2, num_layers - 3)
    if not ids[0] < ids[1] < ids[2]:
        ids = (1, num_layers // 2, num_layers - 1)
    return tuple(min(max(i, 0), num_layers) for i in ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 (Zhang & Sennrich 2019, eq. 4).

    On the CPU in float32 through ``torch.rms_norm`` (the same operations in one call: bitwise the expression
    below, with less Python per call); a ``weight`` of the last dim's size goes into that call (it multiplies
    the normalised rows last: the same product), a per-head one (``x`` (n, heads, d), ``weight`` (heads, d))
    multiplies its result."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.is_cpu:
        if weight.ndim == 1:
            return torch.rms_norm(x, weight.shape, weight, eps)
        return weight * torch.rms_norm(x, x.shape[-1:], None, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout; x (n, heads, d), cos/sin (n, 1, d)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A dense layer's SwiGLU MLP (Shazeer 2020, eq. 6): ``down(silu(gate(x)) * up(x))``; x (n, H), ``gate_up``
    (2 * I, H) the gate then the up projection stacked, ``down`` (H, I). Returns (n, H)."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention (Ainslie et al. 2023) without repeating the key/value heads.

    Query head ``h`` reads key/value head ``h // g`` (``g = Hq / Hk``, the layout of transformers'
    ``repeat_kv``), so the ``g`` query heads of one key/value head are stacked as ``g * n`` rows of one
    batched product: ``softmax(bias + scale * q k^T) v`` in three operations (``baddbmm``, ``softmax``,
    ``bmm``) whatever ``g``.

    Parameters
    ----------
    q : torch.Tensor
        (Hq, n, d) queries.
    k, v : torch.Tensor
        (Hk, T, d) keys and values (the KV cache's first T rows).
    bias : torch.Tensor
        (g * n, T) float32 or the model dtype: 0 where row ``j % n``'s token may attend, ``-inf`` where not
        (the same for every head; :meth:`OffloadedQwen3Moe._forward` builds it once per forward).
    scale : float
        The logits' scale, ``d ** -0.5``.

    Returns
    -------
    torch.Tensor
        (Hq, n, d).
    """
    hq, n, d = q.shape
    hk = k.shape[0]
    scores = torch.baddbmm(bias, q.reshape(hk, hq // hk * n, d), k.transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(scores, dim=-1), v).view(hq, n, d)


def grouped_mm_function():
    """The grouped matrix product of this torch, or None.

    Returns
    -------
    callable or None
        ``torch.nn.functional.grouped_mm`` (torch >= 2.10), else the private ``torch._grouped_mm`` it calls
        (the same arguments: ``(mat_a (m, K), mat_b (G, K, N), offs=(G,) int32 row ends)`` -> (m, N)), else None.
    """
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_kernel_available(device: torch.device, dtype: torch.dtype, hidden_size: int,
                             intermediate_size: int) -> bool:
    """Whether the runtime's rounds of experts use a grouped kernel (:func:`grouped_mm_function`): only
    where it has a grouped kernel, bfloat16 on a CUDA device of compute capability 9.x or 10.x (H100/H200,
    B200). Elsewhere (the CPU, float32, other GPUs) its fallback syncs with the device and multiplies every
    group, empty ones included, so the runtime multiplies each used slot itself. Probed once per model on
    small random tensors, in the layout the runtime passes (the slot tensors transposed), against
    ``F.linear``; any error means False.

    Parameters
    ----------
    device : torch.device
        The model's compute device.
    dtype : torch.dtype
        The model's dtype.
    hidden_size, intermediate_size : int
        H and an expert's I: the probe multiplies (3, H) by two (H, 2I) groups and (3, I) by two (I, H).

    Returns
    -------
    bool
        True only where the kernel runs and agrees with ``F.linear`` within bfloat16 rounding.

    References
    ----------
    PyTorch, ``aten/src/ATen/native/cuda/GroupedBlas.cpp`` (2.10): the CUTLASS bf16 path on sm90/sm100,
    ``_grouped_mm_fallback`` (``offs`` copied to the host, one ``mm`` per group) elsewhere.
    """
    if grouped_mm_function() is None or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    try:
        if torch.cuda.get_device_capability(device)[0] not in (9, 10):
            return False
    except _PROBE_ERRORS:
        return False
    return _grouped_mm_agrees(device, dtype, hidden_size, intermediate_size)


def cpu_grouped_mm_available(dtype: torch.dtype, hidden_size: int, intermediate_size: int) -> bool:
    """Whether this torch's CPU ``grouped_mm`` runs the runtime's products of a model with these sizes: it
    multiplies group by group on the host (no sync, one product per group); torch 2.8 has no CPU kernel and
    2.9+ need 16-byte-aligned strides, so it is probed like :func:`grouped_kernel_available`.

    Parameters
    ----------
    dtype : torch.dtype
        The model's dtype.
    hidden_size, intermediate_size : int
        H and an expert's I.

    Returns
    -------
    bool
        True where it runs and agrees with ``F.linear``.

    References
    ----------
    transformers PR #46743 (the CPU ``torch._grouped_mm`` by torch version).
    """
    cpu = torch.device("cpu")
    return grouped_mm_function() is not None and _grouped_mm_agrees(cpu, dtype, hidden_size, intermediate_size)


def _grouped_mm_agrees(device: torch.device, dtype: torch.dtype, hidden_size: int, intermediate_size: int) -> bool:
    """One probe of :func:`grouped_mm_function` in the runtime's layout (the slot tensors transposed): (3, H) by
    two (H, 2I) groups and (3, I) by two (I, H), against ``F.linear``; any error means False."""
    fn = grouped_mm_function()
    gen = torch.Generator().manual_seed(0)
    try:
        offs = torch.tensor([1, 3], dtype=torch.int32, device=device)
        for k, n in ((hidden_size, 2 * intermediate_size), (intermediate_size, hidden_size)):
            x = torch.randn(3, k, generator=gen).to(device, dtype)
            w = torch.randn(2, n, k, generator=gen).to(device, dtype)
            y = fn(x, w.transpose(1, 2), offs=offs)
            ref = torch.cat([F.linear(x[:1], w[0]), F.linear(x[1:], w[1])])
            if y.shape != ref.shape or y.dtype != dtype or not torch.allclose(y.float(), ref.float(), rtol=0.02,
                                                                             atol=0.02 * k ** 0.5):
                return False
    except _PROBE_ERRORS:
        return False
    return True


#: What a probe of a kernel this torch lacks may raise (AssertionError: a torch built without CUDA).
_PROBE_ERRORS = (RuntimeError, TypeError, ValueError, NotImplementedError, AssertionError)


#: The parents of a tree that is its root alone.
_ROOT_PARENTS = np.array([-1], dtype=np.int64)


def _is_root_only(parents) -> bool:
    """Whether ``parents`` is ``[-1]`` (one root node), without building a :class:`DraftTree`."""
    if not isinstance(parents, (list, tuple, np.ndarray)) or len(parents) != 1:
        return False
    p = parents[0]
    return isinstance(p, (int, np.integer)) and not isinstance(p, bool) and p == -1


class _Layer(NamedTuple):
    """One decoder layer's dense weights as the forward reads them (views of :attr:`OffloadedQwen3Moe.w`)."""

    input_norm: torch.Tensor     # (H,)
    qkv: torch.Tensor            # (Hq*d + 2*Hk*d, H): q_proj, k_proj and v_proj stacked (one product)
    qk_norm: torch.Tensor        # (Hq + Hk, d): q_norm per query head, then k_norm per key head
    o_proj: torch.Tensor         # (H, Hq*d)
    post_norm: torch.Tensor      # (H,)
    router: torch.Tensor | None  # (E, H) on a MoE layer
    gate_up: torch.Tensor | None  # (2 * I_dense, H) on a dense layer: gate_proj then up_proj
    down: torch.Tensor | None    # (H, I_dense) on a dense layer


def fuse_rows(weights: dict[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """Stack the (rows, H) matrices ``names`` of ``weights`` into one tensor and put views of it back under
    the same names (no second copy is kept: memory is unchanged). Returns the stacked (sum rows, H) tensor."""
    fused = torch.cat([weights[n] for n in names])
    start = 0
    for n in names:
        rows = weights[n].shape[0]
        weights[n] = fused[start:start + rows]
        start += rows
    return fused


class OffloadedQwen3Moe:
    """A Qwen3-MoE target whose experts stay in host memory behind a device expert cache.

    Build it with :meth:`from_pretrained`. Non-expert weights and the KV cache live on ``device``;
    the experts in :attr:`store` (host) and :attr:`cache` (device slots).

    Attributes
    ----------
    spec : Qwen3MoeSpec
    cache : DeviceExpertCache
        Per-MoE-layer expert cache; ``cache.cached_experts()``, ``cache.prefetch``, ``cache.stats()``.
    kv_len : int
        Tokens whose KV is committed.
    max_len : int
        Capacity of the preallocated KV cache, tokens (committed prefix plus one verify's tree).
    aux_layers : tuple of int
        See :func:`default_aux_layers`.
    profile : bool
        When true, time expert computation (``expert_compute_ms``); off by default (CUDA events
        per expert add overhead).
    grouped_experts : bool
        True (default): each round of a layer's experts (those in the cache's slots together) is run
        together: one gather of its rows ordered by slot, one product per used slot (one grouped kernel,
        ``torch.nn.functional.grouped_mm``, where :func:`grouped_kernel_available`), and the rows added to
        the output in the per-expert path's order, without atomics. False: ~10 eager kernels per expert (the
        per-expert path; each eager expert call pays its host dispatch, BENCHMARKS.md, "Runtime"). A device-slot cache only (the host-compute caches always call
        each expert). The same outputs: bitwise on the CPU, in float32 and bfloat16.
    grouped_kernel : bool
        Whether those rounds use the grouped kernel (:func:`grouped_kernel_available`, probed at load).
    gather_max_tokens, gather_max_bytes : int, int or None
        The resident path (every expert of a layer in the cache, :attr:`grouped_experts`) runs without a
        host sync (:meth:`_experts_resident`): by gathering each (token, expert) row's weights for a forward
        of at most ``gather_max_tokens`` tokens (default 1: an AR step; 0 where the grouped kernel runs, which
        reads the slots in place where the gather would copy 8 experts per layer) whose gathered weights take at most
        ``gather_max_bytes`` (default 4 MiB on the CPU; no limit on CUDA), otherwise with ``grouped_mm`` where
        :attr:`resident_grouped_mm`.
    resident_grouped_mm : bool
        Whether larger resident forwards use ``grouped_mm``: where the grouped kernel runs
        (:func:`grouped_kernel_available`: bfloat16 on compute capability 9.x/10.x) and on the CPU where torch
        has its kernel (:func:`cpu_grouped_mm_available`; it multiplies group by group on the host: no sync,
        one product per group, bitwise the per-expert path). Elsewhere (other GPUs, float32 on CUDA, torch
        without the CPU kernel) they read the routing on the host once per layer and run the rounds path.
    offload : str
        ``"transfer"`` (default): uncached experts are copied host-to-device into the cache;
        ``"host"``: they are computed on the CPU from :attr:`store` and the cache holds a static hot
        set (:mod:`specfit.models.host_compute`); ``"auto"``: per layer and forward, copied or
        computed on the host, whichever is faster on ``offload_cost`` (:class:`AutoOffloadCache`).
        Outputs are the same in every mode.
    hot_experts : list of list of int or None
        ``host``/``auto`` mode: per MoE layer, the experts to place on the device first, most important first.
    decode_graph : str
        How the AR step and verifies run when the expert cache is full (every expert resident) and :attr:`profile`
        is off (:mod:`specfit.models.qwen3_moe.decode_graph`): ``"cuda-graph"`` (default on CUDA) replays one
        captured CUDA graph of a static-shape forward per padded size; ``"static"`` runs those forwards
        uncaptured; ``"compiled"`` runs the AR step's through ``torch.compile`` (inductor; the first step
        compiles), ``"compiled-cuda-graph"`` captures that; ``"off"`` (default elsewhere) runs the eager forwards,
        bitwise on the CPU in float32. Only ``"off"`` is bitwise.
    offload_cost : HostProfile, optional
        ``auto`` mode: the host-regime profile that decides (default:
        :data:`specfit.core.cost.DEFAULT_HOST_PROFILE`).
    """

    def __init__(self, spec: Qwen3MoeSpec, weights: dict[str, torch.Tensor], store: HostExpertStore,
                 device, dtype: torch.dtype, *, cache_slots: int | str | None = None, gpu_memory=None,
                 eviction: str = "lru", max_len: int = 4096, aux_layers: Sequence[int] | None = None,
                 admission: str = "all", offload: str = "transfer",
                 hot_experts: Sequence[Sequence[int]] | None = None, offload_cost=None):
        self.spec, self.w, self.store = spec, weights, store
        self.offload, self.hot_experts = check_offload(offload), hot_experts
        if self.offload == "auto" and offload_cost is None:
            from specfit.core.cost import DEFAULT_HOST_PROFILE, get_host_profile
            offload_cost = get_host_profile(DEFAULT_HOST_PROFILE)
        self.offload_cost = offload_cost
        self.device, self.dtype = resolve_device(device), dtype
        check_positive_int("max_len", max_len)
        self.max_len = max_len
        L = spec.num_layers
        self.aux_layers = tuple(default_aux_layers(L) if aux_layers is None else aux_layers)
        bad = [i for i in self.aux_layers if not 0 <= i <= L]
        if bad:
            raise SpecFitInputError("aux_layers", f"must lie in [0, {L}] (hidden state after i layers), got {bad[0]}")
        kv_shape = (L, spec.num_kv_heads, max_len, spec.head_dim)
        self.k_cache = torch.zeros(kv_shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(kv_shape, dtype=dtype, device=self.device)
        if gpu_memory is not None:
            if cache_slots is not None:
                raise SpecFitInputError("gpu_memory", "give either cache_slots or gpu_memory, not both")
            cache_slots = self._slots_for(parse_bytes(gpu_memory))
        self.cache = self._new_cache(0 if cache_slots is None else cache_slots, eviction, admission)
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim))
        self._inv_freq = inv_freq.to(self.device)
        self._moe_index = {layer: j for j, layer in enumerate(spec.moe_layers)}
        self.kv_len = 0
        self._pending: tuple[int, np.ndarray] | None = None  # (prefix_len, parents) of the last verify
        self.profile = False
        self.expert_compute_ms = 0.0
        self.grouped_experts = True
        self.grouped_kernel = grouped_kernel_available(self.device, dtype, spec.hidden_size, spec.moe_intermediate_size)
        self.gather_max_tokens = 0 if self.grouped_kernel else 1  # the kernel reads weights in place; a gather copies them
        # torch's CPU grouped_mm multiplies group by group on the host (no sync there, bitwise one mm per
        # group); CUDA's fallback reads the group ends back, so there only the grouped kernel itself is used
        self.resident_grouped_mm = self.grouped_kernel or (
            self.device.type == "cpu" and cpu_grouped_mm_available(dtype, spec.hidden_size, spec.moe_intermediate_size))
        self.gather_max_bytes = 4 << 20 if self.device.type == "cpu" else None
        self._layers = self._fuse_layers()
        pos = torch.arange(max_len, dtype=torch.float32, device=self.device)[:, None] * self._inv_freq
        emb = torch.cat((pos, pos), dim=-1)
        self._cos, self._sin = emb.cos().to(dtype), emb.sin().to(dtype)  # (max_len, d) rotary tables
        h = spec.head_dim // 2  # rope(x) = x cos + roll(x, d/2) sin_signed: rotate_half's sign folded into sin
        self._sin_signed = torch.cat((-self._sin[:, :h], self._sin[:, h:]), dim=-1)
        self._row_token: dict[int, torch.Tensor] = {}  # n -> (n*k,) token of each (token, rank) row
        self._slot_range: torch.Tensor | None = None
        self._gathered: dict[int, tuple] = {}  # n*k -> the gathered weights' buffers and their transposes
        self._decode_graph_mode = "cuda-graph" if self.device.type == "cuda" else "off"
        self._static: dict = {}  # rows -> StaticForward of the cache below
        self._static_cache = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device="cpu", dtype: torch.dtype | None = None,
                        pin_memory: bool | None = None, **kwargs) -> "OffloadedQwen3Moe":
        """Load a Hugging Face Qwen3-MoE checkpoint directory, tensor by tensor.

        Parameters
        ----------
        model_dir : str or Path
            Directory with ``config.json`` and safetensors (single or sharded with an index;
            experts per expert or fused, see :mod:`models.qwen3_moe.checkpoint`).
        device : str or torch.device
            Compute device (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        dtype : torch.dtype, optional
            Compute and storage dtype; default float32 on CPU, bfloat16 otherwise.
        pin_memory : bool, optional
            Page-lock the host expert store (default: when the device is CUDA). Pinned copies are
            asynchronous DMA; the whole store (~58 GB for Qwen3-30B-A3B) must fit in lockable RAM.
        **kwargs
            ``cache_slots`` (int in [0, E] or ``"all"``), ``gpu_memory`` (bytes or ``"20GiB"``:
            the slots follow after the resident weights and the KV cache), ``eviction``
            (``"lru"``/``"lfu"``), ``admission`` (``"all"``/``"accepted"``, see
            :meth:`DeviceExpertCache.settle`), ``max_len`` (KV capacity, tokens), ``aux_layers``,
            ``offload`` (``"transfer"``/``"host"``/``"auto"``), ``hot_experts`` (``host``/``auto``
            mode's first device set), ``offload_cost`` (``auto`` mode's host-regime profile).

        Returns
        -------
        OffloadedQwen3Moe

        Raises
        ------
        CheckpointError
            Missing config, shard or tensor, a shape mismatch, or an unsupported architecture;
            the message names the file and the tensor.
        SpecFitInputError
            Bad ``device`` (not one this torch can use), ``cache_slots``, ``gpu_memory``, ``eviction``,
            ``admission``, ``max_len`` or ``aux_layers``.
        """
        device = resolve_device(device)
        check_offload(kwargs.get("offload", "transfer"))
        dtype = dtype or default_dtype(device)
        spec = read_spec(model_dir)
        if kwargs.get("gpu_memory") is None:  # fail before reading gigabytes of weights
            check_cache_args(kwargs.get("cache_slots") or 0, kwargs.get("eviction", "lru"), spec.num_experts,
                             kwargs.get("admission", "all"))
        else:
            parse_bytes(kwargs["gpu_memory"])
        reader = CheckpointReader(model_dir)
        try:
            weights = load_dense(reader, spec, device, dtype)
            store = HostExpertStore(len(spec.moe_layers), spec.num_experts, spec.hidden_size,
                                    spec.moe_intermediate_size, dtype,
                                    pin_memory=device.type == "cuda" if pin_memory is None else pin_memory)
            load_experts(reader, spec, store)
        finally:
            reader.close()
        return cls(spec, weights, store, device, dtype, **kwargs)

    def _fuse_layers(self) -> list[_Layer]:
        """Each layer's weights as the forward reads them: q/k/v projections stacked into one matrix (and a
        dense layer's gate/up), the q/k norms into one (Hq + Hk, d) weight; views of :attr:`w`."""
        s, w, out = self.spec, self.w, []
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            qkv = fuse_rows(w, [p + f"self_attn.{n}_proj.weight" for n in "qkv"])
            qk_norm = torch.cat([w[p + "self_attn.q_norm.weight"].expand(s.num_heads, -1),
                                 w[p + "self_attn.k_norm.weight"].expand(s.num_kv_heads, -1)])
            moe = i in self._moe_index
            gate_up = None if moe else fuse_rows(w, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            out.append(_Layer(w[p + "input_layernorm.weight"], qkv, qk_norm, w[p + "self_attn.o_proj.weight"],
                              w[p + "post_attention_layernorm.weight"], w[p + "mlp.gate.weight"] if moe else None,
                              gate_up, None if moe else w[p + "mlp.down_proj.weight"]))
        return out

    # -- memory ------------------------------------------------------------------------------------
    @property
    def decode_graph(self) -> str:
        """See the class's attributes; setting it drops the captured graphs."""
        return self._decode_graph_mode

    @decode_graph.setter
    def decode_graph(self, mode: str) -> None:
        modes = ("off", "static", "compiled", "cuda-graph", "compiled-cuda-graph")
        if mode not in modes:
            raise SpecFitInputError("decode_graph", f"must be one of {', '.join(modes)}, got {mode!r}")
        if mode.endswith("cuda-graph") and self.device.type != "cuda":
            raise SpecFitInputError("decode_graph", f"{mode!r} needs a CUDA device, the model is on {self.device}")
        self._decode_graph_mode, self._static = mode, {}

    def _static_step(self) -> bool:
        """Whether AR steps (and verifies, where :meth:`_verify_static` applies) run as :attr:`decode_graph` says
        rather than eagerly: not ``"off"``, a full expert cache, the grouped resident path on, :attr:`profile` off."""
        return self._decode_graph_mode != "off" and self._full_cache() and self.grouped_experts and not self.profile

    def _static_forward(self, rows: int):
        """The :class:`~specfit.models.qwen3_moe.decode_graph.StaticForward` of ``rows`` tokens for the current
        expert cache (made on first use; all dropped when the cache changes)."""
        if self._static_cache is not self.cache:
            self._static, self._static_cache = {}, self.cache
        sf = self._static.get(rows)
        if sf is None:
            from specfit.models.qwen3_moe.decode_graph import StaticForward  # it imports this module
            mode = self._decode_graph_mode
            sf = self._static[rows] = StaticForward(self, rows, capture=mode.endswith("cuda-graph"),
                                                    compile=rows == 1 and mode.startswith("compiled"))
        return sf

    def _full_cache(self) -> bool:
        """Whether the expert cache is full: every expert loaded in slot = its id at construction, never evicted."""
        return self.cache.slots == self.spec.num_experts and type(self.cache) is DeviceExpertCache

    def _resident_bytes(self) -> int:
        return sum(t.nbytes for t in self.w.values()) + self.k_cache.nbytes + self.v_cache.nbytes

    def _slots_for(self, budget: int, reserved: int = 0) -> int:
        E, eb = self.spec.num_experts, self.store.expert_bytes
        resident = self._resident_bytes() + reserved
        slots = slots_for_budget(budget, resident, len(self.spec.moe_layers), E, eb)
        if slots == 0:  # the transient staging buffer must still fit
            slots_for_budget(budget, resident + min(E, 8) * eb, 1, E, eb)
        return slots

    def slots_for(self, gpu_memory, reserved_bytes: int = 0) -> int:
        """Expert-cache slots per MoE layer that fit in a device memory budget.

        ``slots = min(E, floor((budget - resident - reserved) / (L_moe * expert_bytes)))`` where
        ``resident`` is the non-expert weights plus the preallocated KV cache (:meth:`memory`);
        with 0 slots the 8-expert staging buffer must still fit.

        Parameters
        ----------
        gpu_memory : int or str
            Device memory budget, bytes or a size like ``"20GiB"``.
        reserved_bytes : int
            Further device bytes to keep free (e.g. a draft head's weights).

        Returns
        -------
        int
            Slots per layer in [0, E].

        Raises
        ------
        SpecFitInputError
            If the budget is not a size or cannot hold the resident bytes (field ``gpu_memory``).
        """
        return self._slots_for(parse_bytes(gpu_memory), reserved_bytes)

    def memory(self) -> dict:
        """Bytes the runtime holds.

        Returns
        -------
        dict
            ``{"device_bytes", "dense_bytes", "kv_bytes", "expert_cache_bytes", "host_bytes"}``;
            ``host_bytes`` is the host expert store.
        """
        dense = sum(t.nbytes for t in self.w.values())
        kv = self.k_cache.nbytes + self.v_cache.nbytes
        return {"device_bytes": dense + kv + self.cache.device_bytes, "dense_bytes": dense, "kv_bytes": kv,
                "expert_cache_bytes": self.cache.device_bytes, "host_bytes": self.store.nbytes}

    # -- public forward modes ---------------------------------------------------------------------
    def prefill(self, input_ids) -> ForwardOutput:
        """Run ``input_ids`` (T,) or (1, T) after the committed prefix and commit all of them.

        Batch size 1 only: a (B, T) tensor with B > 1 is refused, never flattened.

        Returns
        -------
        ForwardOutput
            One row per input token; ``logits[-1]`` predicts the next token.

        Raises
        ------
        SpecFitInputError
            If the ids are empty, not integers, a batch of more than one sequence, out of the
            vocabulary, or overflow ``max_len``.
        """
        return self._chain(self._ids(input_ids))

    def _chain(self, ids: torch.Tensor) -> ForwardOutput:
        """Forward ``ids`` (n,) on the device as a chain after the committed prefix and commit them."""
        n, P = len(ids), self.kv_len
        self._check_room(n)
        mask = None
        if n > 1:  # token i sees the prefix and new tokens 0..i: a lower triangle shifted by P, made on the device
            mask = torch.ones(n, P + n, dtype=torch.bool, device=self.device).tril(P)
        out = self._forward(ids, self._cos[P:P + n], self._sin_signed[P:P + n], mask)
        self.kv_len += n
        self._pending = None
        self.cache.settle(None)                         # a pending verify's record is abandoned
        return out

    def decode(self, token_id) -> ForwardOutput:
        """Run one token after the committed prefix and commit it (AR decoding step).

        Returns
        -------
        ForwardOutput
            n = 1.
        """
        try:
            tok = int(token_id)
        except (TypeError, ValueError, RuntimeError):
            raise SpecFitInputError("token_id", f"must be one integer token id, got {token_id!r}") from None
        if not 0 <= tok < self.spec.vocab_size:
            raise SpecFitInputError("input_ids", f"must lie in [0, {self.spec.vocab_size})")
        return self._chain(self._to_device(torch.tensor([tok])))

    def verify(self, tokens, parents: Sequence[int]) -> ForwardOutput:
        """One forward over a draft tree after the committed prefix; nothing is committed.

        Parameters
        ----------
        tokens : LongTensor or sequence of int
            (n,) node tokens; node 0 is the root, the last committed token whose KV is not yet
            in the cache (the previous bonus token).
        parents : sequence of int
            ``parents[0] = -1``, ``parents[i] < i`` (SPECFIT.md §2).

        Returns
        -------
        ForwardOutput
            One row per node. Node v attends to the prefix and to its root path, at position
            ``kv_len + depth(v)``, so its logits equal sequential decoding of its root path.

        Raises
        ------
        SpecFitInputError
            Bad parents, a length mismatch, token ids out of range, or KV overflow.
        """
        ids = self._ids(tokens)
        if ids.shape[0] == 1 and (self.dtype == torch.float32 or self._static_step()) and _is_root_only(parents):
            return self._verify_root(ids)
        tree = DraftTree(parents, q=np.ones(len(parents)))
        if tree.n != len(ids):
            raise SpecFitInputError("parents", f"must have one entry per token ({len(ids)}), got {tree.n}")
        n, P = tree.n, self.kv_len
        self._check_room(n)
        if self._static_step():
            out = self._verify_static(ids, tree)
            if out is not None:
                return out
        # the tree's positions and its ancestor mask come from the host: one copy of both (from page-locked
        # memory on CUDA, so the host does not wait)
        host = torch.empty(n, 1 + n, dtype=torch.long, pin_memory=self.device.type == "cuda")
        host[:, 0] = torch.from_numpy(tree.depth + P)
        host[:, 1:] = torch.from_numpy(tree.ancestor_mask)
        dev = host.to(self.device, non_blocking=True)
        pos = dev[:, 0]
        mask = torch.ones(n, P + n, dtype=torch.bool, device=self.device)
        mask[:, P:] = dev[:, 1:].bool()
        self.cache.begin_tentative()
        try:
            out = self._forward(ids, self._cos[pos], self._sin_signed[pos], mask)
        finally:
            self.cache.end_tentative()
        self._pending = (self.kv_len, tree.parents, out)
        return out

    def _verify_static(self, ids: torch.Tensor, tree: DraftTree) -> ForwardOutput | None:
        """:meth:`verify` as a static forward padded to a size of
        :data:`~specfit.models.qwen3_moe.decode_graph.VERIFY_SIZES` (:attr:`decode_graph`), or None where that
        does not apply: a tree too large, too few KV rows left for the padding, or no sync-free grouped product."""
        from specfit.models.qwen3_moe.decode_graph import verify_size

        b = verify_size(tree.n)
        if b is None or not self.resident_grouped_mm or self.kv_len + b > self.max_len:
            return None
        self.cache.begin_tentative()
        try:
            out = self._static_forward(b).verify(ids, tree.depth, tree.ancestor_mask, self.kv_len)
        finally:
            self.cache.end_tentative()
        self._pending = (self.kv_len, tree.parents, out)
        return out

    def _verify_root(self, ids: torch.Tensor) -> ForwardOutput:
        """:meth:`verify` of a tree that is its root alone (an AR step through the verify interface): the
        forward of :meth:`decode` (position ``kv_len``, every KV row visible; in float32 bitwise the masked
        forward, whose mask hides nothing; in other dtypes taken only for the static step, :attr:`decode_graph`),
        without building a tree, its mask or its positions. Nothing is journalled for the expert cache to rank:
        the one node is the accepted path (:meth:`commit`)."""
        P = self.kv_len
        self._check_room(1)
        self.cache.end_tentative()  # an earlier verify's record, never committed, is dropped
        out = self._forward(ids, self._cos[P:P + 1], self._sin_signed[P:P + 1], None)
        self._pending = (P, _ROOT_PARENTS, out)
        return out

    def commit(self, path: Sequence[int]) -> None:
        """Keep the KV of an accepted root path of the last :meth:`verify` tree, drop the rest.

        The expert cache learns the accepted path too (:meth:`DeviceExpertCache.settle`): experts
        that only rejected nodes routed to are not counted as used, so they are evicted first.

        Parameters
        ----------
        path : sequence of int
            Node indices ``[0, v1, v2, ...]`` with ``parents[v_j] = v_{j-1}``; any root path, not
            only the leftmost. Their KV rows move to ``kv_len, kv_len + 1, ...``.

        Raises
        ------
        SpecFitInputError
            If there is no pending verify or ``path`` is not a root path of its tree.
        """
        if self._pending is None:
            raise SpecFitInputError("path", "commit needs a preceding verify (nothing pending)")
        prefix, par, verified = self._pending
        path = [int(v) for v in path]
        if not path or path[0] != 0:
            raise SpecFitInputError("path", f"must start at the root node 0, got {path}")
        for a, b in zip(path, path[1:]):
            if not 0 < b < len(par) or par[b] != a:
                raise SpecFitInputError("path", f"node {b} is not a child of node {a} in the verified tree")
        n = len(path)
        if path != list(range(n)):  # a path of the first n nodes (a chain, an AR step) is in place already
            src = torch.tensor(path, device=self.device) + prefix
            self.k_cache[:, :, prefix:prefix + n] = self.k_cache[:, :, src]
            self.v_cache[:, :, prefix:prefix + n] = self.v_cache[:, :, src]
        self.kv_len = prefix + n
        self._pending = None
        if n == len(par):  # every verified node accepted (an AR step): every expert it touched was used, none to rank
            self.cache.settle(None)
            return
        routing = verified.routing.numpy()[path]
        self.cache.settle([set(routing[:, j].ravel().tolist()) for j in range(routing.shape[1])])

    def reset(self) -> None:
        """Forget the KV prefix (the expert cache keeps its contents and counters)."""
        self.kv_len = 0
        self._pending = None
        self.cache.settle(None)

    def reset_cache(self, cache_slots: int | str, eviction: str | None = None,
                    admission: str | None = None) -> None:
        """Replace the expert cache by an empty one with ``cache_slots`` slots per MoE layer.

        The old slots are released before the new ones are allocated, so the device never holds
        both. ``"all"`` loads every expert (not counted in the new counters). When the cache already has
        these settings (a transfer cache), it is cleared in place instead (:meth:`DeviceExpertCache.clear`):
        the same state, without allocating the slots again or copying every expert again.

        Parameters
        ----------
        cache_slots : int or "all"
            Slots per MoE layer, in [0, E]; 0 transfers every needed expert each forward.
        eviction : str, optional
            ``"lru"``/``"lfu"``; default: the current cache's policy.
        admission : str, optional
            ``"all"``/``"accepted"``; default: the current cache's.

        Raises
        ------
        SpecFitInputError
            If ``cache_slots``, ``eviction`` or ``admission`` is invalid (checked before the old
            cache is freed).
        """
        policy = eviction or self.cache.policy.name
        admission = admission or self.cache.admission
        slots = check_cache_args(cache_slots, policy, self.spec.num_experts, admission)
        c = self.cache
        if (type(c) is DeviceExpertCache and self.offload == "transfer" and c.slots == slots
                and c.policy.name == policy and c.admission == admission):
            c.clear()
            return
        self._static, self._static_cache = {}, None  # the static forwards hold the old cache's slots
        self.cache = None
        self.cache = self._new_cache(cache_slots, policy, admission)

    def _new_cache(self, cache_slots: int | str, policy: str, admission: str = "all") -> DeviceExpertCache:
        """The expert cache of the offload mode: LRU/LFU transfers (with ``admission``), the host
        mode's static hot set (nothing is admitted there, so ``admission`` does not apply), or the
        auto mode's hot set that then admits what it copies."""
        if self.offload == "host":
            return HostComputeCache(self.store, self.device, cache_slots, policy, hot=self.hot_experts)
        if self.offload == "auto":
            return AutoOffloadCache(self.store, self.device, cache_slots, policy, hot=self.hot_experts,
                                    admission=admission, cost=self.offload_cost)
        return DeviceExpertCache(self.store, self.device, cache_slots, policy, admission=admission)

    @property
    def embed_weight(self) -> torch.Tensor:
        """(V, H) input embedding matrix on the device, in the model dtype (an EAGLE-3 head
        without its own ``embed_tokens`` shares it)."""
        return self.w["model.embed_tokens.weight"]

    # -- internals --------------------------------------------------------------------------------
    def _ids(self, ids) -> torch.Tensor:
        try:
            t = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError):
            raise SpecFitInputError("input_ids", "must be integer token ids of shape (T,) or (1, T)") from None
        check_single_sequence("input_ids", tuple(t.shape))
        if t.numel() == 0:
            raise SpecFitInputError("input_ids", "must contain at least one token")
        if t.is_floating_point() or t.is_complex():
            raise SpecFitInputError("input_ids", f"must be integer token ids, got dtype {t.dtype}")
        t = t.reshape(-1).to(torch.long)
        if t.device.type == "cpu":  # host ids are checked on the host (a few, the verify's, as Python ints)
            values = t.tolist() if t.shape[0] <= 64 else t.numpy()
            lo, hi = min(values), max(values)
        else:
            lo, hi = t.min(), t.max()
        if int(lo) < 0 or int(hi) >= self.spec.vocab_size:
            raise SpecFitInputError("input_ids", f"must lie in [0, {self.spec.vocab_size})")
        return self._to_device(t)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the model's device; from a host tensor on CUDA through page-locked memory without
        waiting (a copy from pageable memory would synchronise the stream first)."""
        if self.device.type == "cuda" and t.device.type == "cpu":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _check_room(self, n: int) -> None:
        if self.kv_len + n > self.max_len:
            raise SpecFitInputError("max_len", f"KV cache of {self.max_len} tokens cannot hold {self.kv_len} + {n}")

    def _forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 mask: torch.Tensor | None) -> ForwardOutput:
        """Forward ``ids`` (n,) after the committed prefix of P = ``kv_len`` tokens and write their KV rows
        ``P .. P+n-1``. ``cos``/``sin`` (n, d): the rotary rows of each token's position, ``sin`` with the
        sign of rotate-half folded in (``-sin`` on the first half: bitwise :func:`rope`); ``mask`` (n, P+n)
        bool on the device, which KV rows each token attends to (None: all of them, an AR step).

        Per layer: one product for q, k and v; one RMSNorm over the q and k heads together, one rotary
        embedding of both; attention over the KV cache without repeating the key/value heads (float32:
        :func:`gqa_attention`, three operations; other dtypes: ``scaled_dot_product_attention`` with
        ``enable_gqa``, whose kernels accumulate in float32); the MoE block (:meth:`_moe`)."""
        s, n, P = self.spec, len(ids), self.kv_len
        if n == 1 and mask is None and self._static_step():
            return self._static_forward(1).decode(ids, P)
        d, hq, hk = s.head_dim, s.num_heads, s.num_kv_heads
        qk_cols, eps, T = (hq + hk) * d, s.rms_norm_eps, P + n
        cos, sin = cos[:, None, :], sin[:, None, :]
        bias = None
        if self.dtype == torch.float32:
            bias = torch.zeros(hq // hk * n, T, dtype=self.dtype, device=self.device)  # every head's mask, once
            if mask is not None:
                bias.view(hq // hk, n, T).masked_fill_(~mask, float("-inf"))
        w = self.w
        with torch.inference_mode():  # the layers' intermediates skip autograd's view and version tracking
            x = torch.embedding(w["model.embed_tokens.weight"], ids)
            hidden = {0: x} if 0 in self.aux_layers else {}
            routing = []
            # every layer's KV rows P..T-1 (written) and 0..T-1 (read), (Hk, n, d) and (Hk, T, d): one call each
            k_new, v_new = self.k_cache[:, :, P:T].unbind(0), self.v_cache[:, :, P:T].unbind(0)
            k_all, v_all = self.k_cache[:, :, :T].unbind(0), self.v_cache[:, :, :T].unbind(0)
            for i, lw in enumerate(self._layers):
                h = rms_norm(x, lw.input_norm, eps)
                qk, v = F.linear(h, lw.qkv).split_with_sizes((qk_cols, hk * d), dim=-1)
                qk = rms_norm(qk.view(n, hq + hk, d), lw.qk_norm, eps)
                qk = (qk * cos + qk.roll(d // 2, dims=-1) * sin).transpose(0, 1)
                k_new[i].copy_(qk[hq:])
                v_new[i].copy_(v.view(hk, 1, d) if n == 1 else v.view(n, hk, d).transpose(0, 1))
                if bias is not None:
                    att = gqa_attention(qk[:hq], k_all[i], v_all[i], bias, d ** -0.5)
                else:  # bfloat16: the fused kernel, which accumulates in float32
                    att = F.scaled_dot_product_attention(qk[:hq], k_all[i], v_all[i], attn_mask=mask, scale=d ** -0.5,
                                                         enable_gqa=True)
                x = x + F.linear(att.view(1, -1) if n == 1 else att.transpose(0, 1).reshape(n, -1), lw.o_proj)
                h = rms_norm(x, lw.post_norm, eps)
                if lw.router is not None:
                    y, top_i = self._moe(self._moe_index[i], h, lw.router)
                    routing.append(top_i)
                else:
                    y = swiglu(h, lw.gate_up, lw.down)
                x = x + y
                if i + 1 in self.aux_layers:
                    hidden[i + 1] = x
        return ForwardOutput(*self._outputs(x, hidden, routing))

    def _outputs(self, x: torch.Tensor, hidden: dict, routing: list) -> tuple[torch.Tensor, ...]:
        """A forward's outputs from the last layer's ``x`` (n, H), the auxiliary layers' states ``hidden`` and each
        MoE layer's top-k ids ``routing`` (n, k): logits (n, V) float32, routing (n, L_moe, k), the auxiliary
        states (n, len(aux_layers) * H) and the final normed state (n, H). Call it outside inference mode: what a
        forward returns are ordinary tensors (a caller may train on them)."""
        s = self.spec
        last = rms_norm(x, self.w["model.norm.weight"], s.rms_norm_eps)
        head = self.w["model.embed_tokens.weight"] if s.tie_word_embeddings else self.w["lm_head.weight"]
        logits = F.linear(last, head).float()
        aux = torch.cat([hidden[i] for i in self.aux_layers], dim=-1)
        routing = (torch.stack(routing, dim=1) if routing else
                   torch.empty(x.shape[0], 0, s.top_k, dtype=torch.long, device=self.device))
        return logits, routing, aux, last

    def _moe(self, layer: int, h: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse MoE block of MoE layer ``layer``: route, then run the needed experts via the cache.

        Returns the block output (n, H) and the top-k expert ids (n, k) on the device. When every expert of
        the layer is resident (known on the host) and :attr:`grouped_experts`, the experts run without the
        host reading the routing (:meth:`_experts_resident`); otherwise the host reads the layer's routing
        once (the one device-to-host sync of the layer) and the cache runs the needed experts in rounds
        (:meth:`_experts_grouped`, or one call per expert).
        """
        top_w, top_i = self._route(h, router)
        cache = self.cache
        resident = self.grouped_experts and (self._full_cache() or (cache.grouped and cache.all_resident(layer)))
        n = h.shape[0]
        gather = n <= self.gather_max_tokens and (self.gather_max_bytes is None or
                                                 n * self.spec.top_k * self.store.expert_bytes <= self.gather_max_bytes)
        if resident and (gather or self.resident_grouped_mm):
            return self._experts_resident(layer, h, top_w, top_i, grouped=not gather), top_i
        out = torch.zeros_like(h)
        top_cpu = top_i.cpu()
        ids, rows = torch.unique(top_cpu, return_counts=True)
        ids, rows = ids.tolist(), rows.tolist()
        if self.grouped_experts and self.cache.grouped:
            top_np = top_cpu.numpy()
            flat = top_np.reshape(-1)
            rank = np.argsort(np.argsort(top_np, axis=1, kind="stable"), axis=1).reshape(-1)  # by id, per token

            def compute_round(experts: list, slots: list, gate_up: torch.Tensor, down: torch.Tensor) -> None:
                self._experts_grouped(h, top_w, flat, rank, experts, slots, gate_up, down, out)

            self.cache.run_rounds(layer, ids, compute_round)
            return out, top_i
        timer = self.cache.timer
        # The (token, slot) pairs of every expert, grouped by expert id in row-major order, on the device:
        # each expert takes a slice of them (bounds from the host copy of top_i), so no expert waits
        # for the GPU the way a per-expert torch.nonzero would (one host sync per expert).
        pairs = torch.argsort(top_i.flatten(), stable=True)
        k = top_i.shape[1]
        ends = np.cumsum(rows).tolist()
        span = {e: (end - r, end) for e, r, end in zip(ids, rows, ends)}

        def compute(e: int, gate_up: torch.Tensor, down: torch.Tensor) -> int:
            # Weights on the host (host offload mode) compute there: rows go over, results come back.
            t0 = timer.start() if self.profile else None
            start, end = span[e]
            flat = pairs[start:end]
            tok, slot = flat // k, flat % k
            gate, up = F.linear(h[tok].to(gate_up.device), gate_up).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, down).to(h.device) * top_w[tok, slot, None]
            out.index_add_(0, tok, y)
            if self.profile:
                timer.stop(t0, self._add_expert_ms)
            return len(flat)

        self.cache.run(layer, ids, compute, rows=rows, num_tokens=h.shape[0])
        return out, top_i

    def _route(self, h: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's top-k of ``h`` (n, H): weights (n, k) in ``h``'s dtype (softmax in float32, divided by
        their sum when ``norm_topk_prob``) and expert ids (n, k), on the device."""
        probs = torch.softmax(F.linear(h, router), dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if top_w.dtype != h.dtype:
            top_w = top_w.to(h.dtype)
        return top_w, top_i

    def _experts_resident(self, layer: int, h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor,
                          grouped: bool) -> torch.Tensor:
        """:meth:`_resident_sum` with the expert cache's bookkeeping: the use of ``layer``'s experts counted
        without reading the routing now (:meth:`DeviceExpertCache.touch_resident`), timed when :attr:`profile`."""
        t0 = self.cache.timer.start() if self.profile else None
        self.cache.touch_resident(layer, top_i)
        out = self._resident_sum(layer, h, top_w, top_i, grouped)
        if self.profile:
            self.cache.timer.stop(t0, self._add_expert_ms)
        return out

    def _resident_sum(self, layer: int, h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor,
                      grouped: bool) -> torch.Tensor:
        """The MoE block's expert sum when every expert of ``layer`` is in a device slot, without a host sync.

        ``h`` (n, H), ``top_w``/``top_i`` (n, k) the routing weights and ids. Each token's experts are sorted
        by id (the order of the per-expert path's adds) and mapped to slots by the cache's device table
        (:meth:`DeviceExpertCache.slot_table`); the (token, expert) rows then go through their experts:

        * ``grouped``: rows ordered by slot, group ends found by ``searchsorted`` on the device, two
          ``grouped_mm`` products (:attr:`resident_grouped_mm`);
        * otherwise (a forward within :attr:`gather_max_tokens` and :attr:`gather_max_bytes`: an AR step): each
          row's expert weights gathered (``index_select`` of the slot tensors) and two batched products
          (``bmm``), one row per batch entry.

        The weighted rows are summed per token in increasing expert id by a sum over the k rows (no atomics; on
        the CPU in float32 torch reduces that outer dimension row after row from zero, so bitwise the per-expert
        path's ``index_add_`` calls), on the CPU in bfloat16 rank by rank (a wider accumulator would round
        differently). Returns (n, H).
        """
        n, k = top_i.shape
        ids, order = torch.topk(top_i, k, dim=1, largest=False)  # each row's k distinct ids ascending (a sort)
        w = top_w.gather(1, order)  # (n, k): each row's weight, in the rows' order
        if self._full_cache():
            self.cache.wait_copies(layer)
            slots = ids.reshape(-1)  # a full cache keeps expert e in slot e (loaded so, nothing is ever evicted)
        else:
            slots = self.cache.slot_table(layer)[ids.reshape(-1)]  # (n*k,) in (token, rank) order
        gu, dn = self.cache.gate_up[layer], self.cache.down[layer]
        S, H = gu.shape[0], h.shape[1]
        if grouped:
            tok = self._row_token.get(n)
            if tok is None:
                tok = self._row_token[n] = torch.arange(n * k, device=h.device) // k
            if self._slot_range is None or len(self._slot_range) != S:
                self._slot_range = torch.arange(S, device=h.device)
            by_slot, perm = torch.sort(slots, stable=True)
            offs = torch.searchsorted(by_slot, self._slot_range, right=True).to(torch.int32)
            grouped_mm = grouped_mm_function()
            gate, up = grouped_mm(h[tok[perm]], gu.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            y = grouped_mm(F.silu(gate) * up, dn.transpose(1, 2), offs=offs) * w.reshape(n * k, 1)[perm]
            y = torch.empty_like(y).index_copy_(0, perm, y)  # back to (token, rank) order
        else:
            bufs = self._gathered.get(n * k)  # the gathered weights' memory, the same every layer, and its transposes
            if bufs is None:  # (the model's dtype and device, which never change; ordinary tensors, not inference
                with torch.inference_mode(False):  # ones: the static AR step writes them outside inference mode)
                    w1, w2 = gu.new_empty(n * k, *gu.shape[1:]), dn.new_empty(n * k, *dn.shape[1:])
                bufs = self._gathered[n * k] = (w1, w2, w1.transpose(1, 2), w2.transpose(1, 2))
            torch.index_select(gu, 0, slots, out=bufs[0])  # (n*k, 2I, H)
            torch.index_select(dn, 0, slots, out=bufs[1])  # (n*k, H, I)
            x = h.expand(k, 1, H) if n == 1 else h[:, None, :].expand(n, k, H).reshape(n * k, 1, H)
            gate, up = torch.bmm(x, bufs[2]).chunk(2, dim=-1)
            y = torch.bmm(F.silu(gate) * up, bufs[3]) * w.view(n * k, 1, 1)  # (n*k, 1, H)
        if not h.is_cpu or h.dtype == torch.float32:
            out = y.view(n, k, H).sum(dim=1)  # on the CPU in float32 one row after the other, from 0
        else:  # bfloat16's index_add_ accumulates wider; add rank by rank, rounding after each add
            y = y.view(n, k, H)
            out = y[:, 0]
            for j in range(1, k):
                out = out + y[:, j]
        return out

    def _experts_grouped(self, h: torch.Tensor, top_w: torch.Tensor, flat: np.ndarray, rank: np.ndarray,
                         experts: list, slots: list, gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor) -> None:
        """Add one round's experts to ``out`` (n, H) together (:attr:`grouped_experts`).

        ``flat`` (n * k,) is the host copy of the routing's top-k ids, row-major, and ``rank`` (n * k,) each
        one's rank among its token's k ids; ``gate_up`` (S, 2I, H) and ``down`` (S, H, I) the slot tensors.
        The round's (token, expert) rows are gathered once, ordered by slot; each used slot's rows go through
        its expert (one grouped kernel for all of them where :func:`grouped_kernel_available`); each row is
        written to its (token, rank) place of an (n * k, H) buffer, and ``out`` adds the buffer's columns that
        hold rows, in rank order: each token's experts in increasing id, the order of the per-expert path's adds, so the
        result is bitwise that path's on the CPU (in float32 and bfloat16) and no two rows meet in one add.
        """
        t0 = self.cache.timer.start() if self.profile else None
        k, n = self.spec.top_k, h.shape[0]
        slot_of = np.full(self.spec.num_experts, -1, dtype=np.int64)
        slot_of[experts] = slots
        row_slot = slot_of[flat]
        mine = np.flatnonzero(row_slot >= 0)  # this round's (token, k) pairs, row-major
        by_slot = mine[np.argsort(row_slot[mine], kind="stable")]
        counts = np.bincount(row_slot[by_slot], minlength=gate_up.shape[0])
        dest = by_slot - by_slot % k + rank[by_slot]  # (token, rank) place of each row
        m = len(by_slot)
        index = torch.from_numpy(np.concatenate([by_slot, dest, np.cumsum(counts)]))  # one copy per round
        if h.device.type == "cuda":  # from page-locked memory, so the host does not wait for the stream
            index = index.pin_memory().to(h.device, non_blocking=True)
        pair, dest_t = index[:m], index[m:2 * m]
        tok, kth = pair // k, pair % k
        x = h[tok]
        if self.grouped_kernel:
            grouped_mm, offs = grouped_mm_function(), index[2 * m:].to(torch.int32)
            gate, up = grouped_mm(x, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            y = grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)
        else:
            y = torch.empty_like(x)
            start = 0
            for s in np.flatnonzero(counts).tolist():
                end = start + int(counts[s])
                gate, up = F.linear(x[start:end], gate_up[s]).chunk(2, dim=-1)
                y[start:end] = F.linear(F.silu(gate) * up, down[s])
                start = end
        buf = torch.zeros(n * k, h.shape[1], dtype=h.dtype, device=h.device)
        buf.index_copy_(0, dest_t, y * top_w[tok, kth, None])
        buf = buf.view(n, k, -1)
        for j in np.unique(rank[by_slot]).tolist():  # the ranks this round has rows at (the others add 0)
            out += buf[:, j]
        if self.profile:
            self.cache.timer.stop(t0, self._add_expert_ms)

    def _add_expert_ms(self, ms: float) -> None:
        self.expert_compute_ms += ms

