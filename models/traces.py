"""Routing traces: the target's true routing of real text, recorded to build and test expert predictors.

A :class:`RoutingTrace` holds, for every recorded token, its id, the target's top-k experts per MoE
layer (the true routing E[v][l] of SPECFIT.md §3) and optionally the draft hidden state paired with
the token, grouped by prompt so that predictors can be built on some prompts and measured on others.

Draft hidden state of a token (the input of the ``probe`` predictor): the hidden state the drafter
attaches to a draft node whose token it is, i.e. the EAGLE-3 head's output that produced the
token's draft distribution. With EAGLE's one-step shift (Li et al. 2025, EAGLE-3, §3; see
:mod:`models.eagle3`) head slot ``s`` reads ``(embed(x[s+1]), fc(f[s]))`` and predicts ``x[s+2]``, so
the teacher-forced draft hidden state of token ``x[j]`` is the head output at slot ``j - 2``: exactly
what :meth:`models.eagle3.Eagle3Drafter.draft_levels` attaches to a depth-1 node. Tokens 0 and 1 of
a prompt have none; their rows are NaN (``has_hidden`` says which rows are usable).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from specfit.core.errors import SpecFitInputError, check_positive_int, check_single_sequence
from specfit.core.io import atomic_write

#: Format tag written into every saved trace.
FORMAT = "specfit-routing-trace-v1"


def routing_array(routing, field: str = "routing", copy: bool = True) -> np.ndarray:
    """A routing array's shape and dtype checked, its ids not: (T, L, k) integers, returned as int64 (a
    copy, unless ``copy`` is False and ``routing`` is an int64 array already).

    Raises
    ------
    SpecFitInputError
        If it is not 3-D or not integer (field ``field``).
    """
    r = np.asarray(routing)
    if r.ndim != 3:
        raise SpecFitInputError(field, f"must have shape (T, L, k), got {r.shape}")
    if r.size and not np.issubdtype(r.dtype, np.integer):
        raise SpecFitInputError(field, f"must hold integer expert ids, got dtype {r.dtype}")
    return r.astype(np.int64, copy=copy)


def check_routing(routing, num_experts: int | None = None, field: str = "routing") -> np.ndarray:
    """Validate a routing array and return it as int64.

    Parameters
    ----------
    routing : array_like
        (T, L, k) expert ids per token and MoE layer.
    num_experts : int, optional
        When given, every id must lie in ``[0, num_experts)``.
    field : str
        Name used in the error.

    Returns
    -------
    numpy.ndarray
        (T, L, k) int64.

    Raises
    ------
    SpecFitInputError
        If it is not 3-D, not integer, has an id out of range, or repeats an expert within a
        (token, layer) row.
    """
    r = routing_array(routing, field)
    if r.size:
        hi = num_experts if num_experts is not None else np.iinfo(np.int64).max
        if r.min() < 0 or r.max() >= hi:
            raise SpecFitInputError(field, f"expert ids must lie in [0, {num_experts})")
        s = np.sort(r, axis=-1)
        if (s[..., 1:] == s[..., :-1]).any():
            raise SpecFitInputError(field, "each (token, layer) row must list k distinct experts")
    return r


def check_tokens(tokens, n: int | None = None, field: str = "tokens") -> np.ndarray:
    """Validate token ids: (T,) non-negative integers, ``T == n`` when given; returns int64 (``tokens``
    itself when it is an int64 array: the engine's, checked per predictor call)."""
    t = np.asarray(tokens)
    if t.ndim != 1:
        raise SpecFitInputError(field, f"must have shape (T,), got {t.shape}")
    if t.dtype != np.int64 and t.size:
        if not np.issubdtype(t.dtype, np.integer):
            raise SpecFitInputError(field, f"must hold integer token ids, got dtype {t.dtype}")
        if t.dtype.kind == "u" and t.max() > np.iinfo(np.int64).max:
            raise SpecFitInputError(field, "token ids must be < 2**63")
    if t.size and t.min() < 0:
        raise SpecFitInputError(field, "token ids must be non-negative")
    if n is not None and t.shape[0] != n:
        raise SpecFitInputError(field, f"must have one entry per row ({n}), got {t.shape[0]}")
    return t.astype(np.int64, copy=False)


def check_hidden(hidden, n: int, width: int | None = None, field: str = "draft_hidden") -> np.ndarray | None:
    """Validate draft hidden states: None or (n, Hd) floats (NaN rows allowed); returns float32."""
    if hidden is None:
        return None
    h = np.asarray(hidden)
    if h.ndim != 2 or h.shape[0] != n:
        raise SpecFitInputError(field, f"must have shape ({n}, Hd), got {h.shape}")
    if not np.issubdtype(h.dtype, np.floating):
        raise SpecFitInputError(field, f"must be floating point, got dtype {h.dtype}")
    if width is not None and h.shape[1] != width:
        raise SpecFitInputError(field, f"must have width Hd = {width}, got {h.shape[1]}")
    if np.isinf(h).any():
        raise SpecFitInputError(field, "must be finite (NaN marks a missing row)")
    return h.astype(np.float32)


def save_npz(path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` as a compressed ``.npz``, atomically (temporary file, then rename)."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)

    atomic_write(path, write)


class RoutingTrace:
    """Recorded tokens, true routing and (optionally) draft hidden states, grouped by prompt.

    Parameters
    ----------
    num_experts : int
        Routed experts per MoE layer E (ids lie in ``[0, E)``).
    hidden_source : str, optional
        What the ``draft_hidden`` rows are (``"eagle3"`` or a stand-in such as ``"target-aux"``);
        kept with the trace so reports can label it.

    Attributes
    ----------
    tokens : numpy.ndarray
        (N,) int64, all prompts concatenated.
    routing : numpy.ndarray
        (N, L, k) int64.
    draft_hidden : numpy.ndarray or None
        (N, Hd) float32; NaN rows have no draft hidden state.
    offsets : numpy.ndarray
        (P + 1,) int64; prompt p is rows ``offsets[p]:offsets[p+1]``.
    """

    def __init__(self, num_experts: int, hidden_source: str | None = None):
        check_positive_int("num_experts", num_experts)
        self.num_experts = int(num_experts)
        self.hidden_source = hidden_source
        self._tok: list[np.ndarray] = []
        self._rout: list[np.ndarray] = []
        self._hid: list[np.ndarray | None] = []

    def add(self, tokens, routing, draft_hidden=None) -> None:
        """Append one prompt.

        Parameters
        ----------
        tokens : array_like
            (T,) token ids.
        routing : array_like
            (T, L, k) true experts; L and k must match earlier prompts.
        draft_hidden : array_like, optional
            (T, Hd) draft hidden states (NaN rows allowed); all prompts have them or none does.

        Raises
        ------
        SpecFitInputError
            On a shape, dtype or range error (field ``tokens``, ``routing`` or ``draft_hidden``).
        """
        r = check_routing(routing, self.num_experts)
        t = check_tokens(tokens, r.shape[0]).copy()  # kept: not the caller's array
        if self._rout and r.shape[1:] != self._rout[0].shape[1:]:
            raise SpecFitInputError("routing", f"must have (L, k) = {self._rout[0].shape[1:]} like earlier prompts, got {r.shape[1:]}")
        width = next((h.shape[1] for h in self._hid if h is not None), None)
        h = check_hidden(draft_hidden, len(t), width)
        if self._tok and (h is None) != (self._hid[0] is None):
            raise SpecFitInputError("draft_hidden", "give it for every prompt of a trace or for none")
        self._tok.append(t)
        self._rout.append(r)
        self._hid.append(h)

    # -- views ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(t) for t in self._tok)

    @property
    def num_prompts(self) -> int:
        return len(self._tok)

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate(self._tok) if self._tok else np.zeros(0, np.int64)

    @property
    def routing(self) -> np.ndarray:
        if not self._rout:
            raise SpecFitInputError("trace", "is empty (record at least one prompt)")
        return np.concatenate(self._rout)

    @property
    def draft_hidden(self) -> np.ndarray | None:
        return None if not self._hid or self._hid[0] is None else np.concatenate(self._hid)

    @property
    def has_hidden(self) -> np.ndarray:
        """(N,) bool, rows with a draft hidden state."""
        h = self.draft_hidden
        return np.zeros(len(self), bool) if h is None else ~np.isnan(h).any(axis=1)

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([len(t) for t in self._tok])]).astype(np.int64)

    @property
    def num_layers(self) -> int:
        return self.routing.shape[1]

    @property
    def top_k(self) -> int:
        return self.routing.shape[2]

    def prompts(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """Yield ``(tokens (T,), routing (T, L, k), draft_hidden (T, Hd) or None)`` per prompt."""
        yield from zip(self._tok, self._rout, self._hid)

    def subset(self, prompt_ids) -> "RoutingTrace":
        """A new trace with the given prompts (indices into this trace), in that order."""
        out = RoutingTrace(self.num_experts, self.hidden_source)
        for p in prompt_ids:
            out.add(self._tok[p], self._rout[p], self._hid[p])
        return out

    # -- files ---------------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the trace to ``path`` (``.npz``), atomically (temporary file, then rename).

        Raises
        ------
        SpecFitInputError
            If the trace is empty.
        """
        arrays = dict(format=np.array(FORMAT), num_experts=np.array(self.num_experts), tokens=self.tokens,
                      routing=self.routing, offsets=self.offsets,
                      hidden_source=np.array(self.hidden_source or ""))
        if self.draft_hidden is not None:
            arrays["draft_hidden"] = self.draft_hidden
        save_npz(path, arrays)

    @classmethod
    def load(cls, path) -> "RoutingTrace":
        """Read a trace written by :meth:`save`.

        Raises
        ------
        SpecFitInputError
            If the file is missing or is not a routing trace (field ``trace``).
        """
        from specfit.core.readers import read_npz

        path = Path(path)
        z = read_npz(path, "trace", required=("format", "hidden_source", "num_experts", "offsets", "tokens", "routing"))
        if str(z["format"]) != FORMAT:
            raise SpecFitInputError("trace", f"{path} is not a {FORMAT} file")
        src = str(z["hidden_source"]) or None
        out = cls(int(z["num_experts"]), src)
        hid = z.get("draft_hidden")
        off = z["offsets"]
        for a, b in zip(off[:-1], off[1:]):
            out.add(z["tokens"][a:b], z["routing"][a:b], None if hid is None else hid[a:b])
        return out


def teacher_forced_draft_hidden(head, prompt_ids, aux_hidden) -> np.ndarray:
    """Draft hidden state of every prompt token from an EAGLE-3 head, teacher-forced on the target.

    Parameters
    ----------
    head : models.eagle3.Eagle3Head
        The draft head.
    prompt_ids : torch.Tensor
        (T,) token ids.
    aux_hidden : torch.Tensor
        (T, 3·H_target) the target's features of those tokens (``ForwardOutput.aux_hidden`` of a
        runtime built with the head's aux layers).

    Returns
    -------
    numpy.ndarray
        (T, Hd) float32; row ``j >= 2`` is the head output at slot ``j - 2`` (see the module
        docstring), rows 0 and 1 are NaN.
    """
    import torch

    ids = torch.as_tensor(prompt_ids)
    check_single_sequence("prompt_ids", tuple(ids.shape))
    ids = ids.reshape(-1)
    T = ids.shape[0]
    out = np.full((T, head.cfg.hidden_size), np.nan, np.float32)
    if T >= 3:
        dev = head.fc.weight.device
        with torch.no_grad():
            _, h = head(ids[1:-1][None].to(dev), aux_hidden[:-2][None].to(dev))
        out[2:] = h[0].float().cpu().numpy()
    return out


def record_prompt(model, prompt_ids, trace: RoutingTrace | None = None, head=None,
                  hidden_source: str | None = None) -> RoutingTrace:
    """Prefill ``prompt_ids`` on the offloaded target and append its true routing to a trace.

    Parameters
    ----------
    model : models.qwen3_moe.OffloadedQwen3Moe
        The target (any cache size; routing does not depend on it). Its KV prefix is reset first
        and left holding the prompt.
    prompt_ids : sequence of int or torch.Tensor
        (T,) token ids.
    trace : RoutingTrace, optional
        Trace to append to (a new one is made when None).
    head : models.eagle3.Eagle3Head, optional
        When given, the draft hidden state of each token is recorded (teacher-forced, see
        :func:`teacher_forced_draft_hidden`); ``model.aux_layers`` must equal the head's.
    hidden_source : str, optional
        ``"target-aux"`` records the target's own ``aux_hidden`` of the previous token as a
        *stand-in* for the draft hidden state (row j = aux of token j-1, row 0 NaN) when no head
        exists; ignored when ``head`` is given. The stand-in is optimistic: at draft time the
        target has not yet run the root (token j-1), so a real drafter never sees these features.

    Returns
    -------
    RoutingTrace
        ``trace`` (or the new trace) with one more prompt.

    Raises
    ------
    SpecFitInputError
        Bad ids (from the runtime), a head whose aux layers differ from the model's, or an
        unknown ``hidden_source``.
    """
    import torch

    if hidden_source not in (None, "target-aux"):
        raise SpecFitInputError("hidden_source", f"must be None or 'target-aux', got {hidden_source!r}")
    source = "eagle3" if head is not None else hidden_source
    if head is not None:
        aux_ids = getattr(head, "aux_layer_ids", None)
        if aux_ids is not None and tuple(aux_ids) != tuple(model.aux_layers):
            raise SpecFitInputError("aux_layers", f"the model records {tuple(model.aux_layers)} but the head reads {tuple(aux_ids)}")
    if trace is None:
        trace = RoutingTrace(model.spec.num_experts, source)
    ids = torch.as_tensor(prompt_ids)
    check_single_sequence("prompt_ids", tuple(ids.shape))
    ids = ids.reshape(-1).long()
    model.reset()
    with torch.no_grad():
        out = model.prefill(ids)
    hidden = None
    if head is not None:
        hidden = teacher_forced_draft_hidden(head, ids, out.aux_hidden.float())
    elif source == "target-aux":
        aux = out.aux_hidden.float().cpu().numpy()
        hidden = np.full_like(aux, np.nan)
        hidden[1:] = aux[:-1]
    trace.add(ids.numpy(), out.routing.numpy(), hidden)
    return trace
