"""Lazy, tensor-by-tensor reading of a Qwen3-MoE safetensors checkpoint.

A checkpoint is ``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Tensors
are read one at a time with ``safetensors.safe_open`` (memory-mapped), so a 60 GB checkpoint is
never held twice. Experts are read in either layout:

* per expert (published checkpoints and transformers 5.x ``save_pretrained``):
  ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` of shapes (I, H), (I, H), (H, I);
* fused (transformers' in-memory ``Qwen3MoeExperts`` parameters):
  ``model.layers.N.mlp.experts.gate_up_proj`` (E, 2I, H), gate rows first, and
  ``model.layers.N.mlp.experts.down_proj`` (E, H, I).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specfit.models.experts import HostExpertStore
from specfit.core.errors import SpecFitInputError
from specfit.core.readers import read_json
from specfit.models.qwen3_moe.config import CheckpointError, Qwen3MoeSpec


class CheckpointReader:
    """Maps tensor names to shard files and reads single tensors with their shapes checked.

    Parameters
    ----------
    model_dir : str or Path
        Directory with ``model.safetensors`` or ``model.safetensors.index.json`` and its shards.

    Raises
    ------
    CheckpointError
        If neither file exists, the index is malformed, or a shard it names is missing.
    """

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        index, single = self.dir / "model.safetensors.index.json", self.dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = read_json(index)["weight_map"]
            except SpecFitInputError as exc:
                raise CheckpointError(exc.field, exc.rule) from None
            except KeyError:
                raise CheckpointError(str(index), "must be a JSON object with a 'weight_map'") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map", "must map tensor names to shard file names")
            self.file_of = {name: self.dir / fn for name, fn in weight_map.items()}
            for name, path in self.file_of.items():
                if not path.is_file():
                    raise CheckpointError(f"{path}: {name}", f"shard listed in {index.name} is missing")
        elif single.is_file():
            self.file_of = {name: single for name in self._open(single).keys()}
        else:
            raise CheckpointError(str(self.dir), "has neither model.safetensors nor model.safetensors.index.json")
        #: The dtype config.json says the weights are stored in (``torch_dtype``, or ``dtype`` in
        #: transformers 5), or None when it names none.
        self.claimed_dtype = claimed_dtype(self.dir / "config.json")

    def _open(self, path: Path):
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(open_safetensors(path))
        return self._handles[path]

    def close(self) -> None:
        """Close every open shard."""
        self._stack.close()
        self._handles.clear()

    def has(self, name: str) -> bool:
        """Whether the checkpoint lists tensor ``name``."""
        return name in self.file_of

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Read one tensor (on the CPU) and check its shape.

        Parameters
        ----------
        name : str
            Tensor name in the checkpoint.
        shape : tuple of int
            The shape the config implies.
        dtype : torch.dtype
            Returned dtype (the compute dtype; a stored bfloat16 read as float32 is exact).

        Raises
        ------
        CheckpointError
            If the tensor is absent (from the index or from its shard), its shape differs, it is
            not stored as the config claims or holds a NaN or infinity (:func:`check_stored_tensor`);
            the error names the file and the tensor.
        """
        if name not in self.file_of:
            raise CheckpointError(f"{self.dir}: {name}", "tensor is missing from the checkpoint")
        path = self.file_of[name]
        handle = self._open(path)
        if name not in handle.keys():
            raise CheckpointError(f"{path}: {name}", "tensor listed in the index is missing from the shard")
        got = tuple(handle.get_slice(name).get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"{path}: {name}", f"expected shape {tuple(shape)}, got {got}")
        try:
            stored = handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: {name}", f"cannot be read ({exc})") from None
        check_stored_tensor(stored, f"{path}: {name}", self.claimed_dtype)
        return stored.to(dtype)


#: Floating dtypes a weight may be stored in. Integer and 8-bit float tensors are quantised weights,
#: which this runtime does not dequantise: casting them would change the model's output.
STORED_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: A tensor stored in float32 is accepted beside another claimed dtype: exporters keep routers and
#: norms in float32, and reading float32 loses nothing the claimed dtype had.
_ALWAYS_ACCEPTED = (torch.float32,)


def claimed_dtype(config_path: Path) -> torch.dtype | None:
    """The storage dtype ``config.json`` names (``torch_dtype`` or transformers 5's ``dtype``), or None.

    Raises
    ------
    CheckpointError
        If it names something that is not a floating torch dtype of :data:`STORED_FLOAT_DTYPES`.
    """
    if not Path(config_path).is_file():
        return None
    try:
        cfg = read_json(config_path)
    except SpecFitInputError:
        return None  # the config's own reader reports it
    name = cfg.get("torch_dtype", cfg.get("dtype"))
    if name is None:
        return None
    value = getattr(torch, str(name).removeprefix("torch."), None) if isinstance(name, str) else None
    if value not in STORED_FLOAT_DTYPES:
        raise CheckpointError(f"{config_path}: torch_dtype", f"must name a floating dtype "
                              f"({', '.join(str(d).removeprefix('torch.') for d in STORED_FLOAT_DTYPES)}), got {name!r}")
    return value


def check_stored_tensor(tensor: torch.Tensor, where: str, claimed: torch.dtype | None) -> None:
    """Refuse a floating weight that is not what its checkpoint claims, before any cast.

    Rules: the tensor is stored in a floating dtype of :data:`STORED_FLOAT_DTYPES` (an int8,
    uint8, bool or float8 tensor is a quantised weight: refused, never cast); when the config
    claims a dtype, the tensor is stored in it or in float32; every value is finite (NaN or
    infinity in a weight poisons every output it touches). The cast to the compute dtype that
    follows is then the documented one: exact to float32, rounded to bfloat16 when ``--dtype
    bfloat16`` asks for it.

    Parameters
    ----------
    tensor : torch.Tensor
        As stored in the file.
    where : str
        ``"<file>: <tensor name>"``, the error's field.
    claimed : torch.dtype or None
        :func:`claimed_dtype` of the checkpoint.

    Raises
    ------
    CheckpointError
        On ``where``, naming the rule.
    """
    if tensor.dtype not in STORED_FLOAT_DTYPES:
        raise CheckpointError(where, f"is stored as {str(tensor.dtype).removeprefix('torch.')}, not a floating dtype "
                              "(quantised weights are not supported; casting them would change the output)")
    if claimed is not None and tensor.dtype != claimed and tensor.dtype not in _ALWAYS_ACCEPTED:
        raise CheckpointError(where, f"is stored as {str(tensor.dtype).removeprefix('torch.')} but config.json says "
                              f"torch_dtype {str(claimed).removeprefix('torch.')}")
    if tensor.numel() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(where, f"holds {bad} NaN or infinite value(s); every weight must be finite")


def open_safetensors(path: str | Path):
    """``safe_open(path)`` (memory-mapped, CPU tensors) with every failure as one :class:`CheckpointError`.

    Raises
    ------
    CheckpointError
        Naming the file, if it is missing, unreadable, truncated (the header promises more bytes
        than the file holds) or not a safetensors file at all (e.g. a Git LFS pointer or text).
    """
    path = Path(path)
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except FileNotFoundError:
        raise CheckpointError(str(path), "does not exist") from None
    except (SafetensorError, OSError) as exc:
        size = path.stat().st_size if path.is_file() else 0
        raise CheckpointError(str(path), f"is not a readable safetensors file ({size} bytes; truncated, "
                                         f"a Git LFS pointer or not safetensors?): {exc}") from None


def dense_shapes(spec: Qwen3MoeSpec) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every non-expert tensor (embeddings, attention, norms, routers, lm_head)."""
    H, d, V = spec.hidden_size, spec.head_dim, spec.vocab_size
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (spec.num_heads * d, H),
                    p + "self_attn.k_proj.weight": (spec.num_kv_heads * d, H),
                    p + "self_attn.v_proj.weight": (spec.num_kv_heads * d, H),
                    p + "self_attn.o_proj.weight": (H, spec.num_heads * d),
                    p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if i in spec.moe_layers:
            out[p + "mlp.gate.weight"] = (spec.num_experts, H)
        else:
            f = spec.intermediate_size
            out.update({p + "mlp.gate_proj.weight": (f, H), p + "mlp.up_proj.weight": (f, H),
                        p + "mlp.down_proj.weight": (H, f)})
    return out


def load_dense(reader: CheckpointReader, spec: Qwen3MoeSpec, device, dtype) -> dict[str, torch.Tensor]:
    """Read every non-expert tensor onto ``device`` in ``dtype``, keyed by checkpoint name.

    Raises
    ------
    CheckpointError
        On a missing tensor or a shape mismatch.
    """
    return {name: reader.get(name, shape, dtype).to(device) for name, shape in dense_shapes(spec).items()}


def load_experts(reader: CheckpointReader, spec: Qwen3MoeSpec, store: HostExpertStore) -> str:
    """Fill ``store`` with every expert, layer by layer, from either layout.

    Returns
    -------
    str
        ``"per_expert"`` or ``"fused"`` (the layout of the first MoE layer; layers may differ).

    Raises
    ------
    CheckpointError
        If a layer has neither layout, or a tensor is missing or mis-shaped.
    """
    H, I, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    layout = ""
    for j, i in enumerate(spec.moe_layers):
        p = f"model.layers.{i}.mlp.experts."
        if reader.has(p + "gate_up_proj"):
            layout = layout or "fused"
            store.gate_up[j].copy_(reader.get(p + "gate_up_proj", (E, 2 * I, H), store.dtype))
            store.down[j].copy_(reader.get(p + "down_proj", (E, H, I), store.dtype))
            continue
        layout = layout or "per_expert"
        for e in range(E):
            store.set_expert(j, e, reader.get(f"{p}{e}.gate_proj.weight", (I, H), store.dtype),
                             reader.get(f"{p}{e}.up_proj.weight", (I, H), store.dtype),
                             reader.get(f"{p}{e}.down_proj.weight", (H, I), store.dtype))
    return layout
