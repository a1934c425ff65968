"""The Qwen3-MoE configuration read from a checkpoint's ``config.json``, validated.

Accepts both spellings published checkpoints and transformers releases use: ``num_experts`` or
``num_local_experts``; ``rope_theta`` at top level or inside ``rope_parameters``. Anything this
runtime does not implement (sliding-window attention, attention biases, non-default RoPE scaling,
activations other than SiLU) is refused with a :class:`CheckpointError`, never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specfit.core.errors import MAX_EXPERTS, MAX_LAYERS, SpecFitInputError
from specfit.core.readers import read_json

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


def _int(cfg: dict, key: str, path: Path, default=None, low: int = 1) -> int:
    """``cfg[key]`` (or ``default`` when absent and a default is given) as an integer >= ``low``."""
    if key not in cfg or cfg[key] is None:
        if default is None:
            raise CheckpointError(f"{path}: {key}", "is missing")
        return default
    val = cfg[key]
    if isinstance(val, bool) or not isinstance(val, int) or val < low:
        raise CheckpointError(f"{path}: {key}", f"must be an integer >= {low}, got {val!r}")
    return val


def _need(cfg: dict, key: str, path: Path) -> int:
    return _int(cfg, key, path)


def _positive_float(cfg: dict, key: str, path: Path, default: float) -> float:
    val = cfg.get(key, default)
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not 0 < val < float("inf"):
        raise CheckpointError(f"{path}: {key}", f"must be a positive finite number, got {val!r}")
    return float(val)


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
    folder = Path(model_dir)
    if not folder.is_dir():
        raise CheckpointError(str(folder), "is not a folder" if folder.exists() else "no such checkpoint folder")
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(str(path), "is missing (not a Hugging Face checkpoint directory)")
    try:
        cfg = read_json(path)
    except SpecFitInputError as exc:
        raise CheckpointError(exc.field, exc.rule) from None
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
    if not isinstance(rope, dict):
        refuse("rope_parameters", f"must be a JSON object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        refuse("rope_parameters.rope_type", f"only 'default' RoPE is supported, got {rope_type!r}")
    theta = _positive_float({"rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0))}, "rope_theta",
                            path, 10000.0)
    key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    if key not in cfg:
        refuse("num_experts", "is missing (also looked for num_local_experts)")
    num_experts = _int(cfg, key, path, low=0)
    L = _need(cfg, "num_hidden_layers", path)
    for name, value, high in ((key, num_experts, MAX_EXPERTS), ("num_hidden_layers", L, MAX_LAYERS)):
        if value > high:  # sizes the host expert store is allocated from, before any tensor is read
            refuse(name, f"must be at most {high}, got {value}")
    hidden, heads = _need(cfg, "hidden_size", path), _need(cfg, "num_attention_heads", path)
    kv_heads = _int(cfg, "num_key_value_heads", path, default=heads)
    if heads % kv_heads:
        refuse("num_key_value_heads", f"must divide num_attention_heads ({heads}), got {kv_heads}")
    head_dim = _int(cfg, "head_dim", path, default=hidden // heads if hidden >= heads else 0)
    if head_dim < 1 or head_dim % 2:
        refuse("head_dim", f"must be a positive even integer (rotary embeddings rotate pairs), got {head_dim}")
    step = _int(cfg, "decoder_sparse_step", path, default=1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < L
                                          for i in dense):
        refuse("mlp_only_layers", f"must be a list of layer indices in [0, {L}), got {dense!r}")
    moe_layers = tuple(i for i in range(L) if i not in set(dense) and num_experts > 0 and (i + 1) % step == 0)
    top_k, moe_inter = 0, 0
    if moe_layers:
        top_k = _need(cfg, "num_experts_per_tok", path)
        if top_k > num_experts:
            refuse("num_experts_per_tok", f"must be <= num_experts ({num_experts}), got {top_k}")
        moe_inter = _need(cfg, "moe_intermediate_size", path)
    inter = _int(cfg, "intermediate_size", path, default=None if len(moe_layers) < L else 0,
                 low=1 if len(moe_layers) < L else 0)  # the dense layers' MLP width
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    if any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in eos):
        refuse("eos_token_id", f"must be a token id or a list of token ids, got {cfg.get('eos_token_id')!r}")
    return Qwen3MoeSpec(
        vocab_size=_need(cfg, "vocab_size", path), hidden_size=hidden, num_layers=L, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, moe_intermediate_size=moe_inter,
        num_experts=num_experts, top_k=top_k, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        rms_norm_eps=_positive_float(cfg, "rms_norm_eps", path, 1e-6), rope_theta=theta,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=_int(cfg, "max_position_embeddings", path, default=32768), moe_layers=moe_layers,
        eos_token_id=eos)
