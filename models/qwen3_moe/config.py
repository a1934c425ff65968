"""The Qwen3-MoE configuration read from a checkpoint's ``config.json``, validated.

Accepts both spellings published checkpoints and transformers releases use: ``num_experts`` or
``num_local_experts``; ``rope_theta`` at top level or inside ``rope_parameters``. Anything this
runtime does not implement (sliding-window attention, attention biases, non-default RoPE scaling,
activations other than SiLU) is refused with a :class:`CheckpointError`, never approximated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specfit.core.errors import SpecFitInputError

#: The only architecture this runtime loads.
ARCHITECTURE = "Qwen3MoeForCausalLM"


class CheckpointError(SpecFitInputError):
    """A checkpoint directory that cannot be loaded; ``field`` names the file (and tensor)."""


@dataclass(frozen=True)
class Qwen3MoeSpec:
    """Shapes and constants of a Qwen3-MoE model.

    Attributes follow ``config.json``. ``moe_layers`` lists the decoder layers that hold a sparse
    MoE block (the others hold a dense SwiGLU MLP of ``intermediate_size``): layer ``i`` is MoE
    when ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (transformers'
    ``Qwen3MoeDecoderLayer`` rule). Qwen3-30B-A3B has every layer MoE.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    moe_layers: tuple[int, ...]
    eos_token_id: tuple[int, ...] = ()


def _need(cfg: dict, key: str, path: Path, kind=int):
    if key not in cfg:
        raise CheckpointError(f"{path}: {key}", "is missing")
    val = cfg[key]
    if kind is int and (isinstance(val, bool) or not isinstance(val, int) or val <= 0):
        raise CheckpointError(f"{path}: {key}", f"must be a positive integer, got {val!r}")
    return val


def read_spec(model_dir: str | Path) -> Qwen3MoeSpec:
    """Read and validate ``model_dir/config.json``.

    Parameters
    ----------
    model_dir : str or Path
        A Hugging Face checkpoint directory.

    Returns
    -------
    Qwen3MoeSpec

    Raises
    ------
    CheckpointError
        If ``config.json`` is missing or not JSON, the architecture is not ``Qwen3MoeForCausalLM``,
        a required key is missing, or the config asks for a feature this runtime does not implement.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(str(path), "is missing (not a Hugging Face checkpoint directory)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(str(path), f"is not valid JSON ({exc})") from None
    arch = cfg.get("architectures") or [cfg.get("model_type")]
    if ARCHITECTURE not in arch:
        raise CheckpointError(f"{path}: architectures", f"must contain {ARCHITECTURE!r}, got {arch!r}")

    def refuse(key: str, rule: str):
        raise CheckpointError(f"{path}: {key}", rule)

    if cfg.get("use_sliding_window"):
        refuse("use_sliding_window", "sliding-window attention is not supported")
    if cfg.get("attention_bias"):
        refuse("attention_bias", "attention biases are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"must be 'silu', got {cfg['hidden_act']!r}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        refuse("rope_parameters.rope_type", f"only 'default' RoPE is supported, got {rope_type!r}")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if num_experts is None:
        refuse("num_experts", "is missing (also looked for num_local_experts)")
    L = _need(cfg, "num_hidden_layers", path)
    hidden, heads = _need(cfg, "hidden_size", path), _need(cfg, "num_attention_heads", path)
    kv_heads = cfg.get("num_key_value_heads", heads)
    if heads % kv_heads:
        refuse("num_key_value_heads", f"must divide num_attention_heads ({heads}), got {kv_heads}")
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    moe_layers = tuple(i for i in range(L) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    top_k = _need(cfg, "num_experts_per_tok", path)
    if top_k > num_experts:
        refuse("num_experts_per_tok", f"must be <= num_experts ({num_experts}), got {top_k}")
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return Qwen3MoeSpec(
        vocab_size=_need(cfg, "vocab_size", path), hidden_size=hidden, num_layers=L, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg.get("intermediate_size", 0),
        moe_intermediate_size=_need(cfg, "moe_intermediate_size", path), num_experts=num_experts,
        top_k=top_k, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768), moe_layers=moe_layers,
        eos_token_id=eos)
