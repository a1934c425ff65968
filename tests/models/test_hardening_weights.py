"""Weights that are not what they claim: checked at load, before any cast.

A floating weight stored as int8 (a quantised tensor) was cast silently and changed the output; a
tensor in another dtype than config.json's ``torch_dtype`` was taken; a NaN or infinity in a weight
was never noticed. Each is now one error naming the file and the tensor (target and EAGLE-3 head).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specfit.core.errors import SpecFitInputError
from specfit.models.proxy import paths as proxy_paths
from specfit.models.qwen3_moe import OffloadedQwen3Moe

EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_checkpoint):
    path = tmp_path_factory.mktemp("tiny")
    tiny_checkpoint(path)
    return path


def _variant(src, dst, name, change, config=None):
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    key = name if name in tensors else next(k for k in tensors if k.startswith(name.split(".experts.")[0]) and
                                            "experts" in k)
    tensors[key] = change(tensors[key])
    save_file(tensors, f, metadata={"format": "pt"})
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return key


def _load_error(path) -> SpecFitInputError:
    with pytest.raises(SpecFitInputError) as info:
        OffloadedQwen3Moe.from_pretrained(path, cache_slots=0)
    return info.value


@pytest.mark.parametrize("change, words", [
    (lambda t: (t * 100).to(torch.int8), "stored as int8, not a floating dtype"),
    (lambda t: t.to(torch.uint8), "stored as uint8"),
    (lambda t: t.index_fill(0, torch.tensor([0]), float("nan")), "NaN or infinite"),
    (lambda t: t.index_fill(0, torch.tensor([0]), float("inf")), "NaN or infinite"),
])
def test_target_expert_weights_checked(tiny, tmp_path, change, words):
    key = _variant(tiny, tmp_path / "m", EXPERT, change)
    err = _load_error(tmp_path / "m")
    assert key in err.field and "model.safetensors" in err.field and words in err.rule, (err.field, err.rule)


def test_target_dtype_checked_against_the_config(tiny, tmp_path):
    """config.json claims bfloat16; a float16 tensor is refused (float32 beside it is accepted)."""
    cfg = json.loads((tiny / "config.json").read_text())
    claimed = cfg.get("torch_dtype", cfg.get("dtype"))
    key = _variant(tiny, tmp_path / "m", "model.norm.weight", lambda t: t.to(torch.float16),
                   config={"torch_dtype": "bfloat16", "dtype": "bfloat16"} if claimed else None)
    err = _load_error(tmp_path / "m")
    assert key in err.field and "float16" in err.rule, err


def test_shipped_bfloat16_checkpoint_loads_in_float32():
    """The proxy is stored in bfloat16 (config.json says so); reading it as float32 is exact."""
    model = OffloadedQwen3Moe.from_pretrained(proxy_paths()["target"], cache_slots=0, dtype=torch.float32)
    assert model.dtype == torch.float32


@pytest.mark.parametrize("name, change, words", [
    ("fc.weight", lambda t: t.to(torch.int8), "not a floating dtype"),
    ("fc.weight", lambda t: t.float().index_fill(0, torch.tensor([1]), float("nan")).to(t.dtype), "NaN or infinite"),
    ("d2t", lambda t: t.float(), "integer ids"),
])
def test_head_weights_checked(tmp_path, name, change, words):
    from specfit.models.eagle3 import load_eagle3

    src = proxy_paths()["eagle3"]
    dst = tmp_path / "head"
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    key = next(k for k in tensors if k == name or k.endswith("." + name))
    tensors[key] = change(tensors[key])
    save_file(tensors, f, metadata={"format": "pt"})
    from specfit.models.eagle3 import Eagle3Config, expected_weight_shapes

    cfg = Eagle3Config.from_dict(json.loads((dst / "config.json").read_text()))
    with pytest.raises(SpecFitInputError) as info:
        load_eagle3(dst, embed_weight=torch.zeros(expected_weight_shapes(cfg)["embed_tokens.weight"]))
    assert key in info.value.field and str(f) in info.value.field and words in info.value.rule, info.value


@pytest.mark.parametrize("key, value", [("num_experts", 10 ** 9), ("num_hidden_layers", 10 ** 6)])
def test_config_sizes_bounded(tiny, tmp_path, key, value):
    """A config.json size the host expert store is allocated from is bounded before any allocation."""
    from specfit.models.qwen3_moe import read_spec

    shutil.copytree(tiny, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecFitInputError) as info:
        read_spec(tmp_path / "m")
    assert info.value.field.endswith(f"config.json: {key}") and "at most" in info.value.rule
