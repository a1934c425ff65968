"""The AR step with every expert resident as one static-shape forward, replayed as a CUDA graph.

An eager AR step launches ~50 kernels per decoder layer (BENCHMARKS.md, "Runtime"); at Qwen3-30B-A3B's 48
layers their launch cost alone exceeds the profile's whole modeled step. A CUDA graph replays every kernel of a
captured forward with one launch (NVIDIA, CUDA C++ Programming Guide, "CUDA Graphs"; PyTorch,
``torch.cuda.CUDAGraph``). Capture needs a forward whose shapes, addresses and kernels do not depend on the
step: here the token and its position are read from two device buffers, the rotary rows are gathered at that
position, the new KV row is written by index, and attention runs over the whole preallocated KV cache with the
rows past the position masked out (the layout of gpt-fast's decode step), so one graph serves every position.
The experts come from a full expert cache (every expert in slot = its id, never evicted): the resident path of
:meth:`OffloadedQwen3Moe._resident_sum`, which reads no routing back.

Used by :meth:`OffloadedQwen3Moe.decode` and a one-node :meth:`OffloadedQwen3Moe.verify` when
:attr:`OffloadedQwen3Moe.decode_graph` is not ``"off"`` (``"cuda-graph"``, the default on CUDA; ``"static"``: the
same forward without capture, any device, what the CPU tests run; ``"compiled"`` and ``"compiled-cuda-graph"``:
through ``torch.compile`` first, which fuses kernels), the expert cache is full and :attr:`profile` is off.
Outputs equal the eager step's within rounding, not bitwise (softmax and products over the longer masked rows).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from specfit.models.qwen3_moe.model import ForwardOutput, gqa_attention, rms_norm

class DecodeGraph:
    """The static AR step of one model and one expert cache.

    Parameters
    ----------
    model : OffloadedQwen3Moe
        Its weights, KV cache, rotary tables and expert cache are read in place (their addresses are captured).
    capture : bool
        True (CUDA only): capture the forward as a CUDA graph on the first :meth:`step` (two warm-up forwards
        on a side stream, then the capture) and replay it after; False: call it each step. A capture that
        fails warns once (``RuntimeWarning``) and leaves the forward uncaptured.
    compile : bool
        Run the forward through ``torch.compile`` (inductor, ``fullgraph=True``, ``dynamic=False``: fused
        kernels; the first call compiles, seconds to minutes) after one eager forward that builds the lazily
        made buffers; captured after that when ``capture``.
    grouped : bool, optional
        The experts through ``grouped_mm`` over every slot (default where the grouped kernel runs,
        :attr:`OffloadedQwen3Moe.grouped_kernel`) rather than gathered weights and two ``bmm``.

    Attributes
    ----------
    cache : DeviceExpertCache
        The cache captured; a model whose cache changed needs a new :class:`DecodeGraph`.
    """

    def __init__(self, model, capture: bool, compile: bool = False, grouped: bool | None = None):
        self.model, self.cache, self.capture = model, model.cache, capture
        self._fn, self._compile = self.forward, compile  # what each step calls; compiled on the first step
        self.grouped = model.grouped_kernel if grouped is None else grouped
        dev = model.device
        self._ids = torch.zeros(1, dtype=torch.long, device=dev)
        self._pos = torch.zeros(1, dtype=torch.long, device=dev)
        self._rows = torch.arange(model.max_len, device=dev)
        self._graph = None
        self._out: tuple[torch.Tensor, ...] | None = None

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One AR step of the token in ``_ids`` at position ``_pos``: writes its KV row; returns logits (1, V)
        float32, routing (1, L_moe, k), the auxiliary hidden states (1, len(aux_layers) * H) and the final
        normed hidden state (1, H). Static shapes, no host sync, no allocation outside the forward."""
        m, s = self.model, self.model.spec
        d, hq, hk, eps = s.head_dim, s.num_heads, s.num_kv_heads, s.rms_norm_eps
        qk_cols, w = (hq + hk) * d, m.w
        cos = m._cos.index_select(0, self._pos)[:, None, :]
        sin = m._sin_signed.index_select(0, self._pos)[:, None, :]
        visible = self._rows <= self._pos  # (max_len,): the committed prefix and the new row
        if m.dtype == torch.float32:
            bias = torch.zeros(hq // hk, m.max_len, dtype=m.dtype, device=m.device).masked_fill_(~visible, float("-inf"))
        # inference mode as the eager forward, but not under torch.compile: inductor cannot compile the KV
        # cache's in-place writes in it
        with torch.no_grad() if torch.compiler.is_compiling() else torch.inference_mode():
            x = torch.embedding(w["model.embed_tokens.weight"], self._ids)
            hidden = {0: x} if 0 in m.aux_layers else {}
            routing = []
            for i, lw in enumerate(m._layers):
                h = rms_norm(x, lw.input_norm, eps)
                qk, v = F.linear(h, lw.qkv).split_with_sizes((qk_cols, hk * d), dim=-1)
                qk = rms_norm(qk.view(1, hq + hk, d), lw.qk_norm, eps)
                qk = (qk * cos + qk.roll(d // 2, dims=-1) * sin).transpose(0, 1)
                k_all, v_all = m.k_cache[i], m.v_cache[i]  # (Hk, max_len, d)
                k_all.index_copy_(1, self._pos, qk[hq:])
                v_all.index_copy_(1, self._pos, v.view(hk, 1, d))
                if m.dtype == torch.float32:
                    att = gqa_attention(qk[:hq], k_all, v_all, bias, d ** -0.5)
                else:
                    att = F.scaled_dot_product_attention(qk[:hq], k_all, v_all, attn_mask=visible[None, :],
                                                         scale=d ** -0.5, enable_gqa=True)
                x = x + F.linear(att.view(1, -1), lw.o_proj)
                h = rms_norm(x, lw.post_norm, eps)
                if lw.router is not None:
                    top_w, top_i = m._route(h, lw.router)
                    y = m._resident_sum(m._moe_index[i], h, top_w, top_i, grouped=self.grouped)
                    routing.append(top_i)
                else:
                    gate, up = F.linear(h, lw.gate_up).chunk(2, dim=-1)
                    y = F.linear(F.silu(gate) * up, lw.down)
                x = x + y
                if i + 1 in m.aux_layers:
                    hidden[i + 1] = x
        # outside inference mode, as the eager forward: ordinary tensors
        last = rms_norm(x, w["model.norm.weight"], eps)
        head = w["model.embed_tokens.weight"] if s.tie_word_embeddings else w["lm_head.weight"]
        logits = F.linear(last, head).float()
        aux = torch.cat([hidden[i] for i in m.aux_layers], dim=-1)
        routing = (torch.stack(routing, dim=1) if routing else
                   torch.empty(1, 0, s.top_k, dtype=torch.long, device=m.device))
        return logits, routing, aux, last

    def _capture(self) -> None:
        dev = self.model.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up: lazily built buffers and kernels' workspaces exist before capture
            for _ in range(2):
                self._fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._out = self._fn()
        self._graph = graph

    def step(self, ids: torch.Tensor, position: int) -> ForwardOutput:
        """Run token ``ids`` (1,) on the device at ``position`` (the committed prefix's length): its KV row is
        written; the caller commits it. The expert cache counts the step's uses as the eager path does
        (:meth:`DeviceExpertCache.touch_resident`). Returns ordinary tensors (a replay's are copied out)."""
        m = self.model
        for layer in range(self.cache.num_layers):  # copies still loading the slots: the stream waits (no-op after)
            self.cache.wait_copies(layer)
        self._ids.copy_(ids)
        self._pos.fill_(position)
        if self._compile:  # one eager forward first: the lazily built buffers exist before tracing
            self.forward()
            self._fn, self._compile = torch.compile(self.forward, fullgraph=True, dynamic=False), False
        if self.capture and self._graph is None:
            try:
                self._capture()
            except RuntimeError as err:  # a kernel this torch cannot capture: the same forward, eagerly
                warnings.warn(f"decode_graph: CUDA graph capture failed ({err}); AR steps run the static forward "
                              "without a graph", RuntimeWarning, stacklevel=2)
                self.capture, self._out = False, None
        if self.capture:
            self._graph.replay()
            logits, routing, aux, last = (t.clone() for t in self._out)
        else:
            logits, routing, aux, last = self._fn()
        for j in range(routing.shape[1]):
            self.cache.touch_resident(j, routing[:, j])
        return ForwardOutput(logits=logits, routing=routing, aux_hidden=aux, last_hidden=last)
