"""EAGLE-3 draft head and level-by-level draft-tree growth (EAGLE-2 dynamic tree).

The head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", §3) reads three hidden states of the target (low, middle, high layers), fuses
them with ``fc`` (3·H_target → H), and runs one decoder layer whose attention input is the
concatenation of the normed token embedding and the normed feature (2H → attention). A final norm
and an ``lm_head`` over a reduced *draft vocabulary* give the draft distribution q; ``d2t`` maps a
draft id d to the target id ``d + d2t[d]`` and ``t2d`` marks which target ids the draft can emit.

Checkpoint layout (the public one, as published for Qwen3 targets, e.g. AngelSlim/Qwen3-a3B_eagle3):
``config.json`` with Llama-style keys plus ``draft_vocab_size``, optional ``target_hidden_size``
and ``eagle_config.eagle_aux_hidden_state_layer_ids``; weights ``fc.weight``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 offsets), ``t2d`` (bool) and optionally
``embed_tokens.weight`` (otherwise the target's input embedding is used, as EAGLE does). Also read:
vLLM's ``layers.0.*`` names for ``midlayer.*``, a ``model.`` prefix, a missing ``t2d`` (rebuilt from
``d2t``) and the speculators ``config.json`` (:meth:`Eagle3Config.from_dict`,
:func:`canonical_weight_names`, :func:`inspect_eagle3`).

Aux layer ids index the target's ``output_hidden_states`` tuple (0 = embedding output, i = output
of decoder layer i-1 = input of layer i), the convention of SGLang/vLLM's
``eagle_aux_hidden_state_layer_ids``. EAGLE-3's default is ``(2, L//2, L-3)``; for targets too
shallow for it to give three distinct layers (L < 7) :func:`default_aux_layer_ids` uses
``(1, L//2, L-1)`` (``(0, 1, 2)`` for L = 3), the same low/middle/high spread.

Drafting (:class:`Eagle3Drafter`): the drafter's KV cache holds committed tokens only, each paired
with the *target's* feature of the previous token (EAGLE's one-step shift: slot s holds
``(embed(x[s+1]), fc(f[s]))`` at position s+1 and predicts x[s+2]). Tree nodes live in a temporary
cache that is dropped after each :meth:`Eagle3Drafter.draft_levels` call, so rejected branches
never stay visible (no ghost KV).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specfit.core.errors import SpecFitInputError, check_positive_int, check_single_sequence
from specfit.core.io import dumps
from specfit.core.readers import read_json

#: Weight names of the public EAGLE-3 layout (besides the optional ``embed_tokens.weight``).
WEIGHT_NAMES = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's aux layers ``(2, L//2, L-3)``; ``(1, L//2, L-1)`` (or ``(0, 1, 2)``) when not distinct.

    Parameters
    ----------
    num_layers : int
        Decoder layers L of the target.

    Returns
    -------
    tuple of three int
        Indices into the target's ``output_hidden_states`` (0 = embeddings).

    Raises
    ------
    SpecFitInputError
        If ``num_layers < 3`` (three distinct layers do not exist).
    """
    if num_layers < 3:
        raise SpecFitInputError("num_hidden_layers", f"an EAGLE-3 head needs a target with >= 3 layers, got {num_layers}")
    for ids in ((2, num_layers // 2, num_layers - 3), (1, num_layers // 2, num_layers - 1), (0, 1, 2)):
        if ids[0] < ids[1] < ids[2]:
            return ids


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of an EAGLE-3 head (one decoder layer).

    ``vocab_size`` is the target's vocabulary; ``draft_vocab_size`` the lm_head's rows;
    ``aux_layer_ids`` may be ``None`` (then :func:`default_aux_layer_ids` of the target applies).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False

    @classmethod
    def from_dict(cls, d: Mapping) -> "Eagle3Config":
        """Read a public EAGLE-3 ``config.json`` (Llama keys + EAGLE-3 keys).

        Two published layouts are read: SpecForge/EAGLE's flat ``LlamaForCausalLMEagle3`` config
        (aux ids in ``eagle_config.eagle_aux_hidden_state_layer_ids``, a top-level
        ``eagle_aux_hidden_state_layer_ids``, or absent = the target's default low/middle/high
        layers) and the vLLM *speculators* format (``speculators_model_type: "eagle3"``, the Llama
        keys nested in ``transformer_layer_config``; ``norm_before_residual`` defaults to true there,
        as in vLLM's ``speculators/algos.py``, and to false in the flat layout).

        Raises
        ------
        SpecFitInputError
            If a required key is missing or not a positive integer, ``num_hidden_layers != 1``,
            ``rope_scaling`` asks for anything but default RoPE, or a speculators config is not EAGLE-3.
        """
        speculators = isinstance(d.get("transformer_layer_config"), Mapping)
        if speculators:
            kind = d.get("speculators_model_type", "eagle3")
            if kind != "eagle3":
                raise SpecFitInputError("config.speculators_model_type", f"only 'eagle3' heads load, got {kind!r}")
            d = {**d["transformer_layer_config"], **{k: v for k, v in d.items() if k != "transformer_layer_config"}}

        def need(key):
            if key not in d:
                raise SpecFitInputError(f"config.{key}", "required in an EAGLE-3 config.json")
            return check_positive_int(f"config.{key}", d[key])

        if int(d.get("num_hidden_layers", 1)) != 1:
            raise SpecFitInputError("config.num_hidden_layers", f"must be 1 for an EAGLE-3 head, got {d['num_hidden_layers']}")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        scaling = d.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise SpecFitInputError("config.rope_scaling", f"only default RoPE is supported, got {scaling}")
        eagle = d.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids", d.get("eagle_aux_hidden_state_layer_ids"))
        rope = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        vocab = need("vocab_size")
        kv = check_positive_int("config.num_key_value_heads", d.get("num_key_value_heads", heads))
        if heads % kv:
            raise SpecFitInputError("config.num_key_value_heads", f"must divide num_attention_heads ({heads}), got {kv}")
        if (d.get("head_dim") or hidden // heads) % 2:
            raise SpecFitInputError("config.head_dim", "must be even (rotary embeddings rotate pairs)")
        return cls(
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=check_positive_int("config.num_key_value_heads", d.get("num_key_value_heads", heads)),
            head_dim=check_positive_int("config.head_dim", d.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=check_positive_int("config.draft_vocab_size", d.get("draft_vocab_size") or vocab),
            target_hidden_size=check_positive_int("config.target_hidden_size", d.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(int(i) for i in aux) if aux is not None else None,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            norm_before_residual=bool(d.get("norm_before_residual", speculators)),
        )

    def to_dict(self) -> dict:
        """The public ``config.json`` layout (``LlamaForCausalLMEagle3``)."""
        d = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if self.norm_before_residual:
            d["norm_before_residual"] = True
        if self.aux_layer_ids is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids), "use_aux_hidden_state": True}
        return d


def _cfg_get(cfg, key):
    return cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key, None)


def check_target(cfg: Eagle3Config, target_config) -> tuple[int, int, int]:
    """Check that a head fits a target and return the aux layer ids to read.

    Parameters
    ----------
    cfg : Eagle3Config
        The head's configuration.
    target_config : transformers.PretrainedConfig or Mapping
        The target's config (``hidden_size``, ``num_hidden_layers``, ``vocab_size``).

    Returns
    -------
    tuple of int
        Three indices into the target's ``output_hidden_states``.

    Raises
    ------
    SpecFitInputError
        ``target_hidden_size`` differs from the target's hidden size; the aux layer ids are not
        three distinct ids in ``[0, num_hidden_layers)``; ``vocab_size`` differs from the target's.
    """
    hidden, layers, vocab = (_cfg_get(target_config, k) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    if cfg.target_hidden_size != hidden:
        raise SpecFitInputError("target_hidden_size", f"head expects target hidden size {cfg.target_hidden_size}, target has {hidden}")
    if cfg.vocab_size != vocab:
        raise SpecFitInputError("vocab_size", f"head maps draft ids into a vocabulary of {cfg.vocab_size}, target has {vocab}")
    ids = cfg.aux_layer_ids if cfg.aux_layer_ids is not None else default_aux_layer_ids(layers)
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= i < layers for i in ids):
        raise SpecFitInputError(
            "eagle_config.eagle_aux_hidden_state_layer_ids",
            f"must be 3 distinct ids in [0, {layers}) for a {layers}-layer target, got {list(ids)}",
        )
    return tuple(ids)


def select_aux_hidden(hidden_states, layer_ids) -> torch.Tensor:
    """Concatenate the target's hidden states at ``layer_ids`` into the head's input feature.

    Parameters
    ----------
    hidden_states : sequence of torch.Tensor
        The target's ``output_hidden_states``, each (..., T, H).
    layer_ids : sequence of int
        Indices into ``hidden_states`` (see :func:`check_target`).

    Returns
    -------
    torch.Tensor
        (..., T, 3H), the layers in the given order.
    """
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021), half-split (Llama/Qwen) layout.

    Parameters
    ----------
    x : torch.Tensor
        (B, n, heads, head_dim).
    positions : torch.Tensor
        (n,) or (B, n) integer positions.
    """
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = positions.to(torch.float32)[..., None] * inv  # (B?, n, half)
    if ang.dim() == 2:
        ang = ang[None]
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over concat(norm(embed), norm(feature)), then a SwiGLU MLP."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, embeds, hidden, positions, past_k, past_v, mask):
        """One layer step for n new slots attending to ``past`` + themselves.

        Parameters
        ----------
        embeds, hidden : torch.Tensor
            (B, n, H) token embeddings and features (fused target feature or draft hidden state).
        positions : torch.Tensor
            (n,) or (B, n) rotary positions.
        past_k, past_v : torch.Tensor
            (B, P, kv_heads, head_dim) keys/values already cached (P may be 0).
        mask : torch.Tensor
            (n, P + n) bool, True where a new slot may attend.

        Returns
        -------
        tuple of torch.Tensor
            Output hidden (B, n, H) before the final norm, and the new keys/values (B, n, kv_heads, head_dim).
        """
        cfg = self.cfg
        b, n, _ = hidden.shape
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        a = self.self_attn
        q = apply_rope(a.q_proj(x).view(b, n, cfg.num_attention_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = apply_rope(a.k_proj(x).view(b, n, cfg.num_key_value_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = a.v_proj(x).view(b, n, cfg.num_key_value_heads, cfg.head_dim)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        keys = torch.cat([past_k, k], dim=1).repeat_interleave(rep, dim=2).transpose(1, 2)
        vals = torch.cat([past_v, v], dim=1).repeat_interleave(rep, dim=2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask)
        residual = normed if cfg.norm_before_residual else hidden  # vLLM's norm_before_residual
        h = residual + a.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        m = self.mlp
        y = self.post_attention_layernorm(h)
        h = h + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))
        return h, k, v


class Eagle3Head(nn.Module):
    """EAGLE-3 draft head (fc, one decoder layer, norm, lm_head over the draft vocabulary).

    Parameters
    ----------
    cfg : Eagle3Config
        Head shape.

    Attributes
    ----------
    d2t : torch.Tensor
        (draft_vocab_size,) int64; target id = draft id + ``d2t[draft id]``.
    t2d : torch.Tensor
        (vocab_size,) bool; True for target ids in the draft vocabulary.
    """

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Fuse target features (..., 3·H_target) → (..., H).

        Raises
        ------
        SpecFitInputError
            If the last dimension is not ``3 * target_hidden_size``.
        """
        self.check_features(aux_hidden)
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def check_features(self, aux_hidden: torch.Tensor) -> None:
        """Check that target features (..., 3·H_target) have the width :meth:`fuse` reads.

        Raises
        ------
        SpecFitInputError
            If the last dimension is not ``3 * target_hidden_size`` (field ``target_aux_hidden``).
        """
        if aux_hidden.shape[-1] != 3 * self.cfg.target_hidden_size:
            raise SpecFitInputError(
                "target_aux_hidden", f"last dimension must be 3 * {self.cfg.target_hidden_size}, got shape {tuple(aux_hidden.shape)}"
            )

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids with ``d2t``."""
        return draft_ids + self.d2t[draft_ids]

    def step(self, tokens, hidden, positions, past_k, past_v, mask, logits_from: int = 0):
        """Run the layer for new slots and return (hidden (B,n,H), draft logits (B,n-logits_from,Vd), k, v).

        ``tokens`` are target ids (B, n); other arguments as :meth:`Eagle3Layer.forward`. The LM head
        runs on slots ``logits_from:`` only (a catch-up's committed slots need no logits).
        """
        h, k, v = self.midlayer(self.embed_tokens(tokens), hidden, positions, past_k, past_v, mask)
        return h, self.lm_head(self.norm(h[:, logits_from:])), k, v

    def empty_kv(self, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty key/value caches of shape (batch, 0, kv_heads, head_dim)."""
        w = self.fc.weight
        z = w.new_zeros(batch, 0, self.cfg.num_key_value_heads, self.cfg.head_dim)
        return z, z.clone()

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor):
        """Teacher-forced causal pass (training and tests).

        Parameters
        ----------
        input_ids : torch.Tensor
            (B, T) target ids; slot s holds token ``input_ids[:, s]``.
        aux_hidden : torch.Tensor
            (B, T, 3·H_target) target features paired with each slot (the feature of the
            *previous* token in EAGLE's shift; the caller aligns them).

        Returns
        -------
        tuple of torch.Tensor
            Draft logits (B, T, draft_vocab_size) and output hidden states (B, T, H).
        """
        b, t = input_ids.shape
        mask = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        pk, pv = self.empty_kv(b)
        h, logits, _, _ = self.step(input_ids, self.fuse(aux_hidden), torch.arange(t, device=input_ids.device), pk, pv, mask)
        return logits, h


def write_dir_atomically(out_dir: Path, write) -> None:
    """Rebuild ``out_dir`` in a temporary sibling, then swap it in with renames.

    Parameters
    ----------
    out_dir : pathlib.Path
        Directory to (re)write; plain files already in it (model card, plots, logs) are carried over.
    write : callable
        ``write(tmp_dir)`` writes the new files; an exception leaves ``out_dir`` untouched.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if out_dir.exists():
        for p in out_dir.iterdir():  # keep files written by others (model card, plots, logs)
            if p.is_file():
                shutil.copy2(p, tmp / p.name)
    write(tmp)
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def save_eagle3(head: Eagle3Head, out_dir, include_embed: bool = False, dtype=torch.bfloat16) -> None:
    """Write ``head`` in the public EAGLE-3 layout (config.json + model.safetensors), atomically.

    Parameters
    ----------
    head : Eagle3Head
    out_dir : str or pathlib.Path
        Target directory (created; replaced through a temporary directory and a rename).
    include_embed : bool
        Also store ``embed_tokens.weight`` (public heads usually leave it to the target).
    dtype : torch.dtype
        Dtype of the floating-point weights.
    """
    from safetensors.torch import save_file

    sd = head.state_dict()
    tensors = {name: sd[name].detach().cpu().contiguous() for name in WEIGHT_NAMES}
    if include_embed:
        tensors["embed_tokens.weight"] = sd["embed_tokens.weight"].detach().cpu()
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}

    def write(tmp: Path):
        (tmp / "config.json").write_text(dumps(head.cfg.to_dict(), indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    write_dir_atomically(Path(out_dir), write)


def expected_weight_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Shape of every weight of a head with config ``cfg``, by name (no tensors are allocated).

    Returns
    -------
    dict[str, tuple of int]
        :data:`WEIGHT_NAMES` plus ``embed_tokens.weight`` (vocab_size, H); linear weights are
        (out_features, in_features) as in ``torch.nn.Linear``.
    """
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    m = "midlayer."
    return {
        "embed_tokens.weight": (cfg.vocab_size, h),
        "fc.weight": (h, 3 * cfg.target_hidden_size),
        m + "input_layernorm.weight": (h,), m + "hidden_norm.weight": (h,),
        m + "self_attn.q_proj.weight": (q, 2 * h), m + "self_attn.k_proj.weight": (kv, 2 * h),
        m + "self_attn.v_proj.weight": (kv, 2 * h), m + "self_attn.o_proj.weight": (h, q),
        m + "post_attention_layernorm.weight": (h,),
        m + "mlp.gate_proj.weight": (i, h), m + "mlp.up_proj.weight": (i, h), m + "mlp.down_proj.weight": (h, i),
        "norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,),
    }


#: Checkpoint entries that carry no weight of the head (recomputed buffers of older exports).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def canonical_weight_names(names) -> tuple[dict[str, str], str]:
    """Map a checkpoint's weight names onto this module's (``midlayer.*``) names.

    Published EAGLE-3 heads name the decoder layer ``midlayer.*`` (EAGLE, SpecForge, AngelSlim) or
    ``layers.0.*`` (vLLM's ``llama_eagle3`` and the speculators format; vLLM renames ``midlayer.``
    to ``layers.0.`` when it loads), optionally under a ``model.`` prefix, with or without
    ``embed_tokens.weight``.

    Parameters
    ----------
    names : iterable of str
        Weight names as stored.

    Returns
    -------
    tuple
        (``{canonical name: stored name}``, layout ``"midlayer"`` or ``"layers.0"``).

    Raises
    ------
    SpecFitInputError
        A second decoder layer (``layers.1.*``), both layer styles at once, a name that maps
        twice, or a name that is not a weight of an EAGLE-3 head.
    """
    import re

    known = {*WEIGHT_NAMES, "embed_tokens.weight"}
    names = sorted(n for n in names if not n.endswith(IGNORED_SUFFIXES))
    styles = {s: next((n for n in names if re.match(rf"(model\.)?{re.escape(s)}\.", n)), None)
              for s in ("midlayer", "layers.0")}
    if all(styles.values()):
        raise SpecFitInputError("weights", f"mixes midlayer.* and layers.0.* names ({styles['midlayer']}, "
                                f"{styles['layers.0']}); a head has one decoder layer")
    out = {}
    for stored in names:
        name = stored.removeprefix("model.")
        layer = re.match(r"layers\.(\d+)\.", name)
        if layer:
            if layer.group(1) != "0":
                raise SpecFitInputError(f"weights.{stored}", "an EAGLE-3 head has exactly one decoder layer (layers.0 / midlayer)")
            name = "midlayer." + name[layer.end():]
        if name not in known:
            raise SpecFitInputError(f"weights.{stored}", "not a weight of an EAGLE-3 head (fc, midlayer/layers.0, norm, lm_head, "
                                    "embed_tokens, d2t, t2d)")
        if name in out:
            raise SpecFitInputError(f"weights.{stored}", f"stored twice (also as {out[name]})")
        out[name] = stored
    return out, "layers.0" if styles["layers.0"] else "midlayer"


@dataclass(frozen=True)
class Eagle3Checkpoint:
    """What :func:`inspect_eagle3` found in a head directory (read from headers only).

    Attributes
    ----------
    config : Eagle3Config
    aux_layer_ids : tuple of int or None
        Resolved against the target when one was given (:func:`check_target`).
    files : tuple of pathlib.Path
        Weight files.
    names : dict[str, str]
        Canonical name → stored name.
    layout : str
        ``"midlayer"`` or ``"layers.0"``.
    """

    config: Eagle3Config
    aux_layer_ids: tuple[int, ...] | None
    files: tuple[Path, ...]
    names: dict[str, str]
    layout: str

    @property
    def has_embed(self) -> bool:
        """Whether the checkpoint stores ``embed_tokens.weight`` (else the target's is used)."""
        return "embed_tokens.weight" in self.names


def _weight_headers(files) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Stored name → (shape, file), reading safetensors headers (no tensor data) or .bin files."""
    import pickle

    from safetensors import SafetensorError, safe_open

    out = {}
    for f in files:
        try:
            if f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt") as st:
                    out.update({k: (tuple(st.get_slice(k).get_shape()), f) for k in st.keys()})
            else:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                out.update({k: (tuple(v.shape), f) for k, v in sd.items()})
        except (SafetensorError, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:
            raise SpecFitInputError(str(f), f"is not a readable weight file ({f.stat().st_size} bytes; truncated or "
                                            f"not {f.suffix[1:]}?): {str(exc).splitlines()[0]}") from None
    return out


def inspect_eagle3(path, target_config=None) -> Eagle3Checkpoint:
    """Check a head directory against its config (and a target) without loading any tensor data.

    Parameters
    ----------
    path : str or pathlib.Path
        Directory with ``config.json`` and ``*.safetensors`` (or ``pytorch_model*.bin``) files.
    target_config : transformers.PretrainedConfig or Mapping, optional
        The target's config; when given, :func:`check_target` runs.

    Returns
    -------
    Eagle3Checkpoint

    Raises
    ------
    SpecFitInputError
        One line naming the first mismatch: missing config or weights, a weight name that is not
        an EAGLE-3 head's (:func:`canonical_weight_names`), a missing weight, a shape that
        disagrees with the config, no ``d2t`` for a reduced draft vocabulary, or (with
        ``target_config``) a hidden-size, aux-layer or vocabulary mismatch with the target.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise SpecFitInputError("eagle3_path", f"no config.json in {path}")
    cfg = Eagle3Config.from_dict(read_json(path / "config.json"))
    aux_ids = check_target(cfg, target_config) if target_config is not None else cfg.aux_layer_ids
    files = tuple(sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin")))
    if not files:
        raise SpecFitInputError("eagle3_path", f"no *.safetensors (or pytorch_model*.bin) weights in {path}")
    headers = _weight_headers(files)
    names, layout = canonical_weight_names(headers)
    for name, shape in expected_weight_shapes(cfg).items():
        if name not in names:
            if name == "embed_tokens.weight" or name == "t2d":
                continue  # the target's embedding; t2d follows from d2t
            if name == "d2t" and cfg.draft_vocab_size == cfg.vocab_size:
                continue  # full vocabulary: draft id = target id
            raise SpecFitInputError(f"weights.{name}", f"missing from the checkpoint ({layout} layout)")
        got = headers[names[name]][0]
        if got != shape:
            raise SpecFitInputError(f"weights.{names[name]}", f"shape {got} does not match the config's {shape}")
    return Eagle3Checkpoint(cfg, aux_ids, files, names, layout)


def load_eagle3(path, target_config=None, embed_weight: torch.Tensor | None = None, device="cpu",
                dtype=torch.float32) -> Eagle3Head:
    """Load an EAGLE-3 head from a directory in one of the published layouts.

    Layouts: ``midlayer.*`` or ``layers.0.*`` names, optional ``model.`` prefix, with or without
    ``embed_tokens.weight``, flat or speculators ``config.json`` (:func:`inspect_eagle3`).
    A missing ``t2d`` is rebuilt from ``d2t``; a missing ``d2t`` is allowed only when the draft
    vocabulary is the full vocabulary.

    Parameters
    ----------
    path : str or pathlib.Path
        Directory with ``config.json`` and ``*.safetensors`` files (or ``pytorch_model*.bin``).
    target_config : transformers.PretrainedConfig or Mapping, optional
        The target's config; when given, :func:`check_target` runs and the resolved aux layer
        ids are stored in ``head.aux_layer_ids``.
    embed_weight : torch.Tensor, optional
        (vocab_size, H) target input embedding, required when the checkpoint has no
        ``embed_tokens.weight``.
    device, dtype
        Where and in which dtype to place the weights.

    Returns
    -------
    Eagle3Head
        In eval mode; ``head.aux_layer_ids`` is the tuple of aux ids (or ``None`` when neither
        the config nor ``target_config`` fixes it).

    Raises
    ------
    SpecFitInputError
        Everything :func:`inspect_eagle3` refuses; no embedding anywhere; an embedding of the
        wrong shape; an invalid ``d2t``.
    """
    from specfit.models.devices import resolve_device

    device = resolve_device(device)
    ckpt = inspect_eagle3(path, target_config)
    cfg, shapes = ckpt.config, expected_weight_shapes(ckpt.config)
    if not ckpt.has_embed:
        if embed_weight is None:
            raise SpecFitInputError("embed_tokens", "checkpoint has no embed_tokens.weight; pass the target's input embedding")
        if tuple(embed_weight.shape) != shapes["embed_tokens.weight"]:
            raise SpecFitInputError("embed_tokens", f"the target's embedding is {tuple(embed_weight.shape)}, "
                                    f"the head needs {shapes['embed_tokens.weight']}")
    weights, file_of = {}, {}
    for f in ckpt.files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as st:
                weights.update({k: st.get_tensor(k) for k in st.keys() if k in ckpt.names.values()})
        else:
            weights.update(torch.load(f, map_location="cpu", weights_only=True))
        file_of.update({k: f for k in weights if k not in file_of})
    _check_head_weights(ckpt, weights, file_of, Path(path) / "config.json")
    state = {name: weights[stored] for name, stored in ckpt.names.items()}
    state.setdefault("embed_tokens.weight", embed_weight)
    state.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
    d2t = state["d2t"].long()
    tgt = d2t + torch.arange(cfg.draft_vocab_size)
    if tgt.min() < 0 or tgt.max() >= cfg.vocab_size:
        raise SpecFitInputError("d2t", f"draft id + d2t must lie in [0, {cfg.vocab_size}) (the target vocabulary)")
    if "t2d" not in state:
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        state["t2d"][tgt] = True
    head = Eagle3Head(cfg)
    expected = head.state_dict()
    head.load_state_dict({k: (state[k].to(dtype) if ref.is_floating_point() else state[k].to(ref.dtype))
                          for k, ref in expected.items()})
    head.aux_layer_ids = ckpt.aux_layer_ids
    return head.to(device).eval()


#: Head weights that hold ids or masks, not floats: the draft-to-target id offsets and the mask.
_INDEX_WEIGHTS = ("d2t", "t2d")


def _check_head_weights(ckpt: "Eagle3Checkpoint", weights: dict, file_of: dict, config_path: Path) -> None:
    """Every stored weight is what the head's config claims, before any cast: floating weights by
    :func:`specfit.models.qwen3_moe.checkpoint.check_stored_tensor` (a floating dtype, the config's
    ``torch_dtype`` or float32, finite), ``d2t`` integers and ``t2d`` booleans or integers (a float
    ``d2t`` was rounded by ``.long()``).

    Raises
    ------
    SpecFitInputError
        ``"<file>: <tensor>"`` and the rule.
    """
    from specfit.models.qwen3_moe.checkpoint import check_stored_tensor, claimed_dtype

    claimed = claimed_dtype(config_path)
    for name, stored in ckpt.names.items():
        t, where = weights[stored], f"{file_of.get(stored, ckpt.files[0])}: {stored}"
        if name in _INDEX_WEIGHTS:
            if t.is_floating_point() or t.is_complex():
                raise SpecFitInputError(where, f"is stored as {str(t.dtype).removeprefix('torch.')}; {name} holds "
                                        "integer ids (or a boolean mask), not floats")
            continue
        check_stored_tensor(t, where, claimed)


@dataclass
class DraftLevel:
    """The nodes one level of draft-tree growth adds (all tensors on the drafter's device).

    Node ids are global within one :meth:`Eagle3Drafter.draft_levels` call: the root is 0 and
    nodes are numbered in the order levels yield them, so every parent id is smaller than the
    child's and belongs to an earlier level.

    Attributes
    ----------
    depth : int
        Depth of the new nodes (root = 0, first level = 1).
    node_ids : torch.Tensor
        (m,) int64 global ids of the new nodes.
    parents : torch.Tensor
        (m,) int64 global ids of their parents.
    tokens : torch.Tensor
        (m,) int64 target token ids.
    q : torch.Tensor
        (m,) float32 draft probability of the token given its parent.
    path_prob : torch.Tensor
        (m,) float32 path probability P = P_parent · q (EAGLE-2, Li et al. 2024, §4).
    hidden : torch.Tensor
        (m, H) the draft hidden state that produced q (the parent's step output).
    host : tuple of torch.Tensor, optional
        ``(parents, tokens, path_prob)`` on the host, copied before the next level was launched
        (:meth:`Eagle3Drafter.draft_levels`); read them with :meth:`host_arrays`.
    ready : torch.cuda.Event, optional
        Recorded after those copies on a CUDA device (None on the CPU).
    """

    depth: int
    node_ids: torch.Tensor
    parents: torch.Tensor
    tokens: torch.Tensor
    q: torch.Tensor
    path_prob: torch.Tensor
    hidden: torch.Tensor
    host: tuple | None = None
    ready: object = None

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(parents, tokens, path_prob)`` as numpy arrays, (m,) int64, int64 and the head's float dtype.

        Waits only for this level's host copies, not for the next level's forward the drafter launched
        after them (reading the device tensors would wait for it: one CUDA stream). A level built by hand,
        without host copies, gets them now (:func:`_with_host_copies`)."""
        if self.host is None:
            _with_host_copies(self)
        if self.ready is not None:
            self.ready.synchronize()
        return tuple(t.numpy() for t in self.host)


def _with_host_copies(level: DraftLevel) -> DraftLevel:
    """``level`` with host copies of its parents, tokens and path probabilities (:attr:`DraftLevel.host`):
    on a CUDA device copied asynchronously into pinned memory, with an event recorded after them, so the
    caller can wait for this level alone; on the CPU the tensors themselves."""
    parents, tokens, pp = level.parents, level.tokens, level.path_prob
    if pp.dtype not in (torch.float32, torch.float64):  # numpy takes no bfloat16
        pp = pp.double()
    if parents.device.type != "cuda":
        level.host = (parents, tokens, pp)
        return level
    host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (parents, tokens, pp))
    for dst, src in zip(host, (parents, tokens, pp)):
        dst.copy_(src, non_blocking=True)
    level.host, level.ready = host, torch.cuda.Event()
    level.ready.record()
    return level


class Eagle3Drafter:
    """Stateful EAGLE-3 drafter over committed tokens (see the module docstring).

    Parameters
    ----------
    head : Eagle3Head
        The draft head (its device and dtype are used).
    """

    def __init__(self, head: Eagle3Head):
        self.head = head
        self.reset()

    #: :meth:`draft_levels` launches each level before the caller reads the one above it (one head
    #: forward ahead): :class:`specfit.engine.SpecDecoder` counts the host work a level's forward hides.
    launches_ahead = True

    @property
    def aux_layer_ids(self) -> tuple[int, ...] | None:
        """The target layers whose hidden states the head reads (None: the target's default);
        :class:`specfit.engine.SpecDecoder` checks them against the target's ``aux_layers``."""
        return self.head.aux_layer_ids

    def reset(self) -> None:
        """Forget all committed tokens."""
        self.k, self.v = self.head.empty_kv(1)
        self.pending: torch.Tensor | None = None  # fused target feature of the last token in the KV cache
        self.n_committed = 0  # committed tokens, queued ones included
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []  # committed, not yet in the KV cache (commit)

    @torch.no_grad()
    def prefill(self, token_ids: torch.Tensor, target_aux_hidden: torch.Tensor) -> None:
        """Start over from a prompt.

        Parameters
        ----------
        token_ids : torch.Tensor
            (T,) committed target ids.
        target_aux_hidden : torch.Tensor
            (T, 3·H_target) the target's features for those tokens (:func:`select_aux_hidden`).
        """
        self.reset()
        self.commit(token_ids, target_aux_hidden)
        self._apply_queued()  # the prompt's head forward belongs to the prefill, not to the first draft

    @torch.no_grad()
    def commit(self, accepted_tokens: torch.Tensor, target_aux_hidden: torch.Tensor) -> None:
        """Append tokens the target accepted, with the target's own features for them.

        The head's forward over them is deferred: the next :meth:`draft_levels` (or :meth:`state`) runs
        one forward over every token committed since the last one. Decoding that takes AR steps between
        drafts (:class:`specfit.engine.SpecDecoder`'s AR gate) thus launches no head forward per step,
        and the catch-up is the first work of the next draft, as in EAGLE's reference code, whose first
        draft forward after a verify takes the accepted tokens' features (SafeAILab/EAGLE,
        ``eagle/model/utils.py``, ``update_inference_inputs`` calling ``ea_layer.topK_genrate``).
        After ``commit`` the state (:meth:`state`) equals a fresh :meth:`prefill` of the whole
        committed prefix.

        Parameters
        ----------
        accepted_tokens : torch.Tensor
            (m,) target ids, in order (typically the cycle's root and its accepted draft tokens;
            the bonus token becomes the next root and is committed by the next cycle).
        target_aux_hidden : torch.Tensor
            (m, 3·H_target) target features for those tokens.

        Raises
        ------
        SpecFitInputError
            If the shapes disagree, the features have the wrong width or a token id lies outside the
            target's vocabulary (checked here, not when the forward runs; nothing is queued then).
        """
        dev = self.head.fc.weight.device
        tokens = torch.as_tensor(accepted_tokens, device=dev).long()
        check_single_sequence("accepted_tokens", tuple(tokens.shape))  # batch size 1 only
        tokens = tokens.reshape(-1)
        aux = torch.as_tensor(target_aux_hidden, device=dev)
        if aux.dim() != 2 or aux.shape[0] != tokens.shape[0]:
            raise SpecFitInputError("target_aux_hidden", f"must be (m, 3H) with m = {tokens.shape[0]} tokens, got {tuple(aux.shape)}")
        self.head.check_features(aux)  # before anything is queued
        if tokens.numel() == 0:
            return
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.head.cfg.vocab_size:
            raise SpecFitInputError("accepted_tokens", f"must be target ids in [0, {self.head.cfg.vocab_size})")
        self.queued.append((tokens.clone(), aux.clone()))  # copies: the caller may reuse its tensors before the catch-up
        self.n_committed += tokens.shape[0]

    def _queued_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The catch-up's slots for the queued commits: target ids (c,), fused features (c, H) at
        positions ``n_committed - c ..``, and the feature that becomes :attr:`pending` (None: nothing
        queued). EAGLE's shift pairs each token with the previous token's feature."""
        if not self.queued:
            return self.k.new_zeros(0, dtype=torch.long), self.k.new_zeros(0, self.head.cfg.hidden_size), None
        tokens, aux = torch.cat([t for t, _ in self.queued]), torch.cat([a for _, a in self.queued])
        feats = self.head.fuse(aux)
        if self.pending is None:
            return tokens[1:], feats[:-1], feats[-1]
        return tokens, torch.cat([self.pending[None], feats[:-1]]), feats[-1]

    def _take_queued(self, k: torch.Tensor, v: torch.Tensor, pending: torch.Tensor | None) -> None:
        """Append the catch-up's keys and values (1, c, kv_heads, head_dim) to the committed cache and
        empty the queue (only once its forward succeeded: a failure leaves the queue to apply again)."""
        if pending is None:
            return
        self.k, self.v = torch.cat([self.k, k], 1), torch.cat([self.v, v], 1)
        self.pending, self.queued = pending, []

    def _causal_step(self, tokens: torch.Tensor, hidden: torch.Tensor, logits_from: int):
        """One head forward over n new slots (``tokens`` (n,), ``hidden`` (n, H)) after the committed cache,
        causal among themselves, at positions from ``n_committed - logits_from`` (the queued slots come
        first); returns :meth:`Eagle3Head.step`'s outputs, logits for slots ``logits_from:`` only."""
        n, past, dev = tokens.shape[0], self.k.shape[1], tokens.device
        mask = torch.ones(n, past + n, dtype=torch.bool, device=dev)
        mask[:, past:] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        pos = torch.arange(self.n_committed - logits_from, self.n_committed - logits_from + n, device=dev)
        return self.head.step(tokens[None], hidden[None], pos, self.k, self.v, mask, logits_from=logits_from)

    @torch.no_grad()
    def _apply_queued(self) -> None:
        """Run the head over the queued committed tokens (one forward) into the KV cache."""
        tokens, hidden, pending = self._queued_slots()
        k = v = self.k[:, :0]
        if tokens.shape[0]:
            _, _, k, v = self._causal_step(tokens, hidden, logits_from=tokens.shape[0])
        self._take_queued(k, v, pending)

    @torch.no_grad()
    def draft_levels(self, root_token: int, top_k: int, max_depth: int) -> Iterator[DraftLevel]:
        """Grow the draft tree below ``root_token`` one level at a time (EAGLE-2 dynamic tree).

        Level 1 holds the root's ``top_k`` most likely children. Each later level expands the
        ``top_k`` nodes of the previous level with the highest path probability, each proposing
        its ``top_k`` most likely children (Li et al. 2024, EAGLE-2, §4 "expansion phase").
        Tree nodes attend to the committed tokens and to their own ancestors only (positions
        ``n_committed + depth``), in a temporary cache dropped when the generator ends.

        Each level after the first is launched before the level above it is yielded (its expansion
        reads the head's own path probabilities, nothing the caller computes), and the yielded level
        carries host copies of its parents, tokens and path probabilities made before that launch
        (:meth:`DraftLevel.host_arrays`): on a GPU the next head forward runs while the caller works
        on this level on the host. A caller that stops before ``max_depth`` leaves one level computed
        and unused (:attr:`launches_ahead`).

        Parameters
        ----------
        root_token : int
            The cycle's root: the last token produced by the target (not yet committed).
        top_k : int
            Children per expanded node and nodes expanded per level (>= 1).
        max_depth : int
            Number of levels to yield (>= 1).

        Yields
        ------
        DraftLevel
            One per depth 1..max_depth, in order.

        Raises
        ------
        SpecFitInputError
            Bad ``top_k``/``max_depth``/``root_token``, or nothing committed yet.
        """
        head = self.head
        if self.pending is None and not self.queued:
            raise SpecFitInputError("drafter", "prefill the drafter with the prompt before drafting")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= head.cfg.draft_vocab_size:
            raise SpecFitInputError("top_k", f"must be an integer in [1, {head.cfg.draft_vocab_size}], got {top_k!r}")
        check_positive_int("max_depth", max_depth)
        if not 0 <= int(root_token) < head.cfg.vocab_size:
            raise SpecFitInputError("root_token", f"must be a target id in [0, {head.cfg.vocab_size}), got {root_token}")
        level, tree = self._first_level(int(root_token), top_k)
        past = self.k.shape[1]
        # The frontier's visibility: the tree slots (ancestors incl. itself after expansion) each node sees.
        visible = torch.ones(1, 1, dtype=torch.bool, device=level.tokens.device)
        for depth in range(1, max_depth + 1):
            ready = _with_host_copies(level)
            if depth < max_depth:
                # the next level is launched before this one is read: on a GPU its forward runs while the
                # caller works on this level's host copies (its expansion reads the head's P only)
                keep = level.path_prob.topk(min(top_k, level.path_prob.numel())).indices.sort().values
                visible = visible.repeat_interleave(top_k, dim=0)[keep]
                level, visible, tree = self._expand(depth + 1, level.tokens[keep], level.hidden[keep],
                                                    level.path_prob[keep], level.node_ids[keep], visible, tree, past,
                                                    top_k)
            yield ready

    def _first_level(self, root_token: int, top_k: int) -> tuple[DraftLevel, tuple]:
        """The root's children, with the catch-up over the queued commits fused into the same head
        forward (slots: the c queued tokens, then the root at position ``n_committed``; causal), as
        EAGLE's first draft forward after a verify takes the accepted tokens (:meth:`commit`). The LM
        head runs on the root's slot only. Returns level 1 and the tree ``(keys, values, next id)``."""
        tokens, hidden, pending = self._queued_slots()
        c = tokens.shape[0]
        dev = self.k.device
        tokens = torch.cat([tokens, torch.tensor([root_token], device=dev)])
        hidden = torch.cat([hidden, (self.pending if pending is None else pending)[None]])
        h, logits, k, v = self._causal_step(tokens, hidden, logits_from=c)
        self._take_queued(k[:, :c], v[:, :c], pending)
        ones, root = torch.ones(1, device=dev), torch.zeros(1, dtype=torch.long, device=dev)
        level = self._level(1, h[0, c:], logits[0], ones, root, 1, top_k)
        return level, (k[:, c:], v[:, c:], 1 + level.node_ids.numel())

    def _expand(self, depth, tokens, hidden, probs, ids, visible, tree, past, top_k):
        """One head forward over the frontier (``tokens``, ``hidden``, path ``probs``, node ``ids``
        (n,), ``visible`` (n, tree slots)): the level at ``depth``, the new nodes' visibility and the
        grown ``tree`` ``(keys, values, next id)``."""
        head, (tree_k, tree_v, next_id) = self.head, tree
        dev = tokens.device
        n, s = tokens.shape[0], tree_k.shape[1]
        mask = torch.cat(
            [torch.ones(n, past, dtype=torch.bool, device=dev), visible, torch.eye(n, dtype=torch.bool, device=dev)], dim=1
        )
        pos = torch.full((n,), self.n_committed + depth - 1, device=dev)
        h, logits, k, v = head.step(tokens[None], hidden[None], pos, torch.cat([self.k, tree_k], 1),
                                    torch.cat([self.v, tree_v], 1), mask)
        visible = torch.cat([visible, torch.zeros(n, n, dtype=torch.bool, device=dev)], 1)
        visible[:, s:] = torch.eye(n, dtype=torch.bool, device=dev)
        level = self._level(depth, h[0], logits[0], probs, ids, next_id, top_k)
        return level, visible, (torch.cat([tree_k, k], 1), torch.cat([tree_v, v], 1), next_id + level.node_ids.numel())

    def _level(self, depth, h, logits, probs, ids, next_id, top_k) -> DraftLevel:
        """The level a head forward proposes: each of the n frontier nodes (output ``h`` (n, H),
        ``logits`` (n, Vd), path ``probs`` and ``ids`` (n,)) gets its ``top_k`` most likely children,
        numbered from ``next_id``."""
        q, draft_ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)  # (n, top_k)
        m = h.shape[0] * top_k
        return DraftLevel(
            depth=depth,
            node_ids=torch.arange(next_id, next_id + m, device=h.device),
            parents=ids.repeat_interleave(top_k),
            tokens=self.head.draft_to_target(draft_ids).reshape(-1),
            q=q.reshape(-1),
            path_prob=(probs[:, None] * q).reshape(-1),
            hidden=h.repeat_interleave(top_k, dim=0),
        )

    def state(self) -> dict[str, torch.Tensor | int | None]:
        """The committed state (keys, values, pending feature, committed count), for checks; queued
        commits are applied first."""
        self._apply_queued()
        return {"k": self.k, "v": self.v, "pending": self.pending, "n_committed": self.n_committed}
