"""Forwards with every expert resident as static-shape forwards, replayed as CUDA graphs: the AR step and
tree verifies padded to a few sizes.

An eager forward launches ~50 kernels per decoder layer (BENCHMARKS.md, "Runtime"); at Qwen3-30B-A3B's 48
layers their launch cost alone exceeds the profile's whole modeled AR step. A CUDA graph replays every kernel of a
captured forward with one launch (NVIDIA, CUDA C++ Programming Guide, "CUDA Graphs"; PyTorch,
``torch.cuda.CUDAGraph``). Capture needs a forward whose shapes, addresses and kernels do not depend on the
step: here the tokens, their positions, the KV rows they write, the committed prefix's length and the tree's
ancestor mask are read from one device buffer; the rotary rows are gathered at those positions, the KV rows
written by index, and attention runs over the whole preallocated KV cache with a mask (the prefix, then each
row's ancestors; the layout of gpt-fast's decode step), so one graph serves every position, and each forward
reads all ``max_len`` KV rows (size ``max_len`` to what a run needs). A tree of ``n`` nodes runs in the graph of the
smallest size of :data:`VERIFY_SIZES` that holds it, the extra rows (each sees the prefix and itself) discarded.
The experts come from a full expert cache (every expert in slot = its id, never evicted) on the resident path of
:meth:`OffloadedQwen3Moe._resident_sum`, which reads no routing back.

Used by :meth:`OffloadedQwen3Moe.decode` and :meth:`OffloadedQwen3Moe.verify` when
:attr:`OffloadedQwen3Moe.decode_graph` is not ``"off"`` (``"cuda-graph"``, the default on CUDA; ``"static"``: the
same forwards without capture, any device, what the CPU tests run; ``"compiled"`` and ``"compiled-cuda-graph"``:
the AR step through ``torch.compile`` first, which fuses kernels), the expert cache is full and
:attr:`OffloadedQwen3Moe.profile` is off; trees (2 or more nodes) where the resident path multiplies them without a
host sync (:attr:`OffloadedQwen3Moe.resident_grouped_mm`). Outputs equal the eager forwards' within rounding, not
bitwise (softmax and products over the longer masked rows; padded rows in the grouped products).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

from specfit.models.qwen3_moe.model import ForwardOutput, gqa_attention, rms_norm, swiglu

#: The tree sizes a verify is padded to (the smallest that holds it); larger trees run eagerly.
VERIFY_SIZES = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def verify_size(n: int) -> int | None:
    """The padded size of an ``n``-node verify, or None when ``n`` exceeds :data:`VERIFY_SIZES`."""
    return next((b for b in VERIFY_SIZES if b >= n), None)


class StaticForward:
    """The static forward of ``rows`` tokens of one model and one expert cache.

    Parameters
    ----------
    model : OffloadedQwen3Moe
        Its weights, KV cache, rotary tables and expert cache are read in place (their addresses are captured).
    rows : int
        Tokens per forward: 1 (the AR step) or a size of :data:`VERIFY_SIZES`.
    capture : bool
        True (CUDA only): capture the forward as a CUDA graph on its first call (two warm-up forwards on a side
        stream, then the capture) and replay it after; False: call it each time. A capture that fails warns
        (``RuntimeWarning``) and leaves the forward uncaptured.
    compile : bool
        Run the forward through ``torch.compile`` (inductor, ``fullgraph=True``, ``dynamic=False``: fused
        kernels; the first call compiles, seconds to minutes) after one eager forward that builds the lazily
        made buffers; captured after that when ``capture``.
    grouped : bool, optional
        The experts through ``grouped_mm`` over every slot (default: where the grouped kernel runs,
        :attr:`OffloadedQwen3Moe.grouped_kernel`, and always for more than one row) rather than gathered weights
        and two ``bmm``.

    Attributes
    ----------
    cache : DeviceExpertCache
        The cache captured; a model whose cache changed needs new static forwards.
    """

    def __init__(self, model, rows: int, capture: bool, compile: bool = False, grouped: bool | None = None):
        self.model, self.cache, self.rows, self.capture = model, model.cache, rows, capture
        self._fn, self._compile = self.forward, compile  # what each call runs; compiled on the first call
        self.grouped = rows > 1 or (model.grouped_kernel if grouped is None else grouped)
        dev = model.device
        # per row: token id, position, KV row written, the committed prefix's length, then the row's ancestors
        self._inputs = torch.zeros(rows, 4 + rows, dtype=torch.long, device=dev)
        self._inputs[:, 4:] = torch.eye(rows, dtype=torch.long, device=dev)
        self._cols = torch.arange(model.max_len, device=dev)
        self._graph = None
        self._out: tuple[torch.Tensor, ...] | None = None

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward of the rows in the input buffer: writes their KV rows; returns logits (b, V) float32,
        routing (b, L_moe, k), the auxiliary hidden states (b, len(aux_layers) * H) and the final normed hidden
        state (b, H). Static shapes, no host sync."""
        m, s, b = self.model, self.model.spec, self.rows
        d, hq, hk, eps = s.head_dim, s.num_heads, s.num_kv_heads, s.rms_norm_eps
        qk_cols, w, T = (hq + hk) * d, m.w, m.max_len
        ids, pos, kv_rows = self._inputs[:, 0], self._inputs[:, 1], self._inputs[:, 2]
        cos = m._cos.index_select(0, pos)[:, None, :]
        sin = m._sin_signed.index_select(0, pos)[:, None, :]
        # (b, T): the committed prefix, then each row's ancestors (itself included) at the KV rows they write
        visible = (self._cols < self._inputs[:1, 3:4]).long().expand(b, T).contiguous()  # (inductor: not bool)
        visible = visible.index_copy_(1, kv_rows, self._inputs[:, 4:]).bool()
        if m.dtype == torch.float32:  # every head's mask, once: row j of the (g * b) rows is token j % b
            bias = torch.zeros(hq // hk, b, T, dtype=m.dtype, device=m.device).masked_fill_(~visible, float("-inf"))
            bias = bias.view(hq // hk * b, T)
        # inference mode as the eager forward, but not under torch.compile: inductor cannot compile the KV
        # cache's in-place writes in it
        with torch.no_grad() if torch.compiler.is_compiling() else torch.inference_mode():
            x = torch.embedding(w["model.embed_tokens.weight"], ids)
            hidden = {0: x} if 0 in m.aux_layers else {}
            routing = []
            for i, lw in enumerate(m._layers):
                h = rms_norm(x, lw.input_norm, eps)
                qk, v = F.linear(h, lw.qkv).split_with_sizes((qk_cols, hk * d), dim=-1)
                qk = rms_norm(qk.view(b, hq + hk, d), lw.qk_norm, eps)
                qk = (qk * cos + qk.roll(d // 2, dims=-1) * sin).transpose(0, 1)
                k_all, v_all = m.k_cache[i], m.v_cache[i]  # (Hk, max_len, d)
                k_all.index_copy_(1, kv_rows, qk[hq:])
                v_all.index_copy_(1, kv_rows, v.view(b, hk, d).transpose(0, 1))
                if m.dtype == torch.float32:
                    att = gqa_attention(qk[:hq], k_all, v_all, bias, d ** -0.5)
                else:
                    att = F.scaled_dot_product_attention(qk[:hq], k_all, v_all, attn_mask=visible, scale=d ** -0.5,
                                                         enable_gqa=True)
                x = x + F.linear(att.transpose(0, 1).reshape(b, -1), lw.o_proj)
                h = rms_norm(x, lw.post_norm, eps)
                if lw.router is not None:
                    top_w, top_i = m._route(h, lw.router)
                    y = m._resident_sum(m._moe_index[i], h, top_w, top_i, grouped=self.grouped)
                    routing.append(top_i)
                else:
                    y = swiglu(h, lw.gate_up, lw.down)
                x = x + y
                if i + 1 in m.aux_layers:
                    hidden[i + 1] = x
        return m._outputs(x, hidden, routing)  # outside inference mode, as the eager forward

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

    def _run(self, n: int) -> ForwardOutput:
        """Run the forward on the inputs set, the first ``n`` rows kept; the expert cache counts their uses as the
        eager path does (:meth:`DeviceExpertCache.touch_resident`). Returns ordinary tensors."""
        if self._compile:  # one eager forward first: the lazily built buffers exist before tracing
            self.forward()
            self._fn, self._compile = torch.compile(self.forward, fullgraph=True, dynamic=False), False
        if self.capture and self._graph is None:
            try:
                self._capture()
            except RuntimeError as err:  # a kernel this torch cannot capture: the same forward, uncaptured
                warnings.warn(f"decode_graph: CUDA graph capture of {self.rows} rows failed ({err}); they run "
                              "without a graph", RuntimeWarning, stacklevel=3)
                self.capture, self._out = False, None
        if self.capture:
            self._graph.replay()
            logits, routing, aux, last = (t[:n].clone() for t in self._out)
        else:
            logits, routing, aux, last = (t[:n] for t in self._fn())
        for j in range(routing.shape[1]):
            self.cache.touch_resident(j, routing[:, j])
        return ForwardOutput(logits=logits, routing=routing, aux_hidden=aux, last_hidden=last)

    def decode(self, ids: torch.Tensor, position: int) -> ForwardOutput:
        """The AR step (``rows`` = 1): token ``ids`` (1,) on the device at ``position`` (the committed prefix's
        length), its KV row written there; the caller commits it."""
        self._inputs[:, 0].copy_(ids)
        self._inputs[:, 1:4].fill_(position)  # position, KV row and prefix length are all P
        return self._run(1)

    def verify(self, ids: torch.Tensor, depth: np.ndarray, ancestors: np.ndarray, prefix: int) -> ForwardOutput:
        """A tree of ``n <= rows`` nodes after a committed prefix of ``prefix`` tokens: token ids ``ids`` (n,) on
        the device, node depths ``depth`` (n,) and the ancestor mask ``ancestors`` (n, n) (node i sees node j
        where 1, itself included); node i at position ``prefix + depth[i]`` writes KV row ``prefix + i``. The
        rows past ``n`` see the prefix and themselves. One host-to-device copy (from page-locked memory on CUDA,
        not waited for). Returns ``n`` rows."""
        n, b = len(depth), self.rows
        host = torch.zeros(b, 4 + b, dtype=torch.long, pin_memory=self.model.device.type == "cuda")
        host[:, 1] = prefix
        host[:n, 1] += torch.from_numpy(np.asarray(depth, dtype=np.int64))
        host[:, 2] = torch.arange(prefix, prefix + b)
        host[:, 3] = prefix
        host[:, 4:] = torch.eye(b, dtype=torch.long)
        host[:n, 4:4 + n] = torch.from_numpy(np.asarray(ancestors, dtype=np.int64))
        self._inputs.copy_(host, non_blocking=True)
        self._inputs[:n, 0].copy_(ids)
        return self._run(n)
