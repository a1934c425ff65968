"""Published EAGLE-3 head layouts for Qwen3-30B-A3B load, or are refused in one line naming the mismatch.

The layouts (sources in BENCHMARKS.md, "Published EAGLE-3 heads"):

* SpecForge ``configs/qwen3-30B-eagle3.json`` (``LlamaForCausalLMEagle3``): 1 layer, hidden 2048,
  intermediate 6144, 32 query / 4 KV heads of 128, draft vocabulary 32,000 of 151,936, no aux ids
  in the config (the target's default low/middle/high layers); weights ``midlayer.*``.
* the same weights under vLLM's names ``layers.0.*`` (vLLM's ``llama_eagle3.load_weights`` renames
  ``midlayer.`` to ``layers.0.``), optionally under ``model.``, with or without ``embed_tokens.weight``;
* the vLLM *speculators* config (``speculators_model_type: eagle3``, Llama keys nested in
  ``transformer_layer_config``, ``eagle_aux_hidden_state_layer_ids`` at the top level).

Real shapes are checked from safetensors *headers* of sparse files (nothing is allocated); small
random heads with exactly the published names are loaded and run through ``specfit eval``.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from specfit.cli import main
from specfit.core.errors import SpecFitInputError
from specfit.models.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    canonical_weight_names,
    check_target,
    expected_weight_shapes,
    inspect_eagle3,
    load_eagle3,
)
from specfit.models.proxy import TARGET_DIR

#: SpecForge's configs/qwen3-30B-eagle3.json, key for key.
SPECFORGE_QWEN3_30B = {
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 2048, "max_window_layers": 48,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 1, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.53.2", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936, "draft_vocab_size": 32000,
}
#: Qwen3-30B-A3B's config.json (the keys the loader reads; docs/SPECFIT.md §5).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "norm_topk_prob": True, "tie_word_embeddings": False,
}
LAYER_KEYS = ("input_layernorm.weight", "hidden_norm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
              "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def published_names(layer_prefix: str, outer_prefix: str = "", embed: bool = False) -> list[str]:
    """The weight names of one published variant, written out (not derived from the loader)."""
    names = [f"{outer_prefix}{layer_prefix}{k}" for k in LAYER_KEYS]
    names += [f"{outer_prefix}fc.weight", f"{outer_prefix}norm.weight", "lm_head.weight", "d2t", "t2d"]
    return names + ([f"{outer_prefix}embed_tokens.weight"] if embed else [])


def write_sparse_safetensors(path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A valid safetensors file whose data region is a hole: real shapes, no memory, ~no disk."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        dtype, size = ("I64", 8) if name.endswith("d2t") else ("BOOL", 1) if name.endswith("t2d") else ("BF16", 2)
        n = size
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def real_shape_head(tmp_path, names: list[str], config: dict = SPECFORGE_QWEN3_30B, **override_shapes):
    """A head directory with ``config`` and a sparse checkpoint holding ``names`` at the config's shapes."""
    shapes = expected_weight_shapes(Eagle3Config.from_dict(config))
    stored = {}
    for name in names:
        canon = name.removeprefix("model.").replace("layers.0.", "midlayer.")
        stored[name] = override_shapes.get(canon, shapes[canon])
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_sparse_safetensors(tmp_path / "model.safetensors", stored)
    return tmp_path


# -- real shapes, nothing allocated ---------------------------------------------------------------
def test_specforge_config_fits_qwen3_30b_a3b_with_the_default_aux_layers():
    cfg = Eagle3Config.from_dict(SPECFORGE_QWEN3_30B)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.draft_vocab_size, cfg.vocab_size, cfg.target_hidden_size) == (2048, 6144, 32, 4, 128, 32000, 151936, 2048)
    assert cfg.aux_layer_ids is None and not cfg.norm_before_residual
    assert check_target(cfg, QWEN3_30B_A3B) == (2, 24, 45)  # EAGLE-3's (2, L/2, L-3) for L = 48
    # without the embedding the head is ~145 M parameters = 0.29 GB in bf16 (head_dim 128, not hidden / heads = 64)
    shapes = expected_weight_shapes(cfg)
    params = sum(torch.Size(s).numel() for n, s in shapes.items() if n not in ("embed_tokens.weight", "d2t", "t2d"))
    assert 0.28e9 < 2 * params < 0.30e9


@pytest.mark.parametrize("names", [
    published_names("midlayer."),                                 # SpecForge / AngelSlim names, no embedding
    published_names("midlayer.", embed=True),                     # ... with the embedding stored
    published_names("layers.0."),                                 # vLLM names
    published_names("layers.0.", outer_prefix="model.", embed=True),
], ids=["midlayer", "midlayer+embed", "layers.0", "model.layers.0+embed"])
def test_real_shape_checkpoints_are_accepted(tmp_path, names):
    ckpt = inspect_eagle3(real_shape_head(tmp_path / "head", names), QWEN3_30B_A3B)
    assert ckpt.aux_layer_ids == (2, 24, 45)
    assert ckpt.layout == ("layers.0" if "layers.0." in names[0] else "midlayer")
    assert ckpt.has_embed == any("embed_tokens" in n for n in names)
    assert sorted(ckpt.names.values()) == sorted(names)


def test_speculators_config_is_read(tmp_path):
    layer = {k: v for k, v in SPECFORGE_QWEN3_30B.items() if k not in ("draft_vocab_size", "architectures")}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 32000,
              "target_hidden_size": 2048, "eagle_aux_hidden_state_layer_ids": [2, 24, 45],
              "transformer_layer_config": layer}
    cfg = Eagle3Config.from_dict(config)
    assert cfg.norm_before_residual  # vLLM's speculators default
    assert (cfg.hidden_size, cfg.head_dim, cfg.draft_vocab_size, cfg.aux_layer_ids) == (2048, 128, 32000, (2, 24, 45))
    ckpt = inspect_eagle3(real_shape_head(tmp_path / "s", published_names("layers.0.", embed=True), config), QWEN3_30B_A3B)
    assert ckpt.layout == "layers.0"
    with pytest.raises(SpecFitInputError, match="config.speculators_model_type"):
        Eagle3Config.from_dict({**config, "speculators_model_type": "mlp_speculator"})


@pytest.mark.parametrize("change, target, field", [
    ({"lm_head.weight": (16000, 2048)}, QWEN3_30B_A3B, "weights.lm_head.weight"),
    ({"fc.weight": (2048, 3 * 4096)}, QWEN3_30B_A3B, "weights.fc.weight"),
    ({}, {**QWEN3_30B_A3B, "hidden_size": 4096}, "target_hidden_size"),       # a Qwen3-235B-sized target
    ({}, {**QWEN3_30B_A3B, "vocab_size": 152064}, "vocab_size"),
], ids=["draft-vocab", "fc-width", "target-hidden", "target-vocab"])
def test_real_shape_mismatches_are_refused_naming_the_field(tmp_path, change, target, field):
    head = real_shape_head(tmp_path / "head", published_names("midlayer."), **change)
    with pytest.raises(SpecFitInputError) as err:
        inspect_eagle3(head, target)
    assert err.value.field == field and "\n" not in str(err.value)


def test_aux_ids_outside_the_target_are_refused(tmp_path):
    config = {**SPECFORGE_QWEN3_30B, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 24, 48]}}
    head = real_shape_head(tmp_path / "head", published_names("midlayer."), config)
    with pytest.raises(SpecFitInputError, match="eagle_aux_hidden_state_layer_ids.*48"):
        inspect_eagle3(head, QWEN3_30B_A3B)


@pytest.mark.parametrize("names, field", [
    (published_names("layers.0.") + ["layers.1.input_layernorm.weight"], "weights.layers.1.input_layernorm.weight"),
    (published_names("midlayer.") + ["layers.0.hidden_norm.weight"], "weights"),
    (published_names("midlayer.") + ["medusa_head.0.weight"], "weights.medusa_head.0.weight"),
    ([n for n in published_names("midlayer.") if n != "d2t"], "weights.d2t"),
    ([n for n in published_names("midlayer.") if n != "fc.weight"], "weights.fc.weight"),
], ids=["two-layers", "both-styles", "foreign-weight", "no-d2t", "no-fc"])
def test_layout_mismatches_are_refused(tmp_path, names, field):
    shapes = {"midlayer.input_layernorm.weight": (2048,)}  # for the extra layer-1 / duplicate entries
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(SPECFORGE_QWEN3_30B))
    full = expected_weight_shapes(Eagle3Config.from_dict(SPECFORGE_QWEN3_30B))
    write_sparse_safetensors(head / "model.safetensors", {
        n: full.get(n.removeprefix("model.").replace("layers.0.", "midlayer."), shapes["midlayer.input_layernorm.weight"])
        for n in names})
    with pytest.raises(SpecFitInputError) as err:
        inspect_eagle3(head, QWEN3_30B_A3B)
    assert err.value.field == field


def test_canonical_names_ignore_rotary_buffers_and_keep_the_layout():
    names, layout = canonical_weight_names(["model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.0.mlp.up_proj.weight"])
    assert names == {"midlayer.mlp.up_proj.weight": "model.layers.0.mlp.up_proj.weight"} and layout == "layers.0"


def test_expected_shapes_are_the_modules():
    cfg = Eagle3Config(hidden_size=24, intermediate_size=40, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                       vocab_size=50, draft_vocab_size=20, target_hidden_size=16)
    assert expected_weight_shapes(cfg) == {k: tuple(v.shape) for k, v in Eagle3Head(cfg).state_dict().items()}


# -- small random heads with the published names, on the shipped proxy target -----------------------
PROXY = json.loads((TARGET_DIR / "config.json").read_text())
SMALL = Eagle3Config(hidden_size=PROXY["hidden_size"], intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=PROXY["vocab_size"], draft_vocab_size=512,
                     target_hidden_size=PROXY["hidden_size"])


def small_head(cfg: Eagle3Config = SMALL) -> Eagle3Head:
    """Random weights (std 0.05) and a random reduced draft vocabulary, from a fixed generator."""
    gen, head = torch.Generator().manual_seed(0), Eagle3Head(cfg).eval()
    keep = torch.randperm(cfg.vocab_size, generator=gen)[: cfg.draft_vocab_size].sort().values
    state = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in head.state_dict().items() if v.is_floating_point()}
    state.update(d2t=keep - torch.arange(cfg.draft_vocab_size), t2d=torch.isin(torch.arange(cfg.vocab_size), keep))
    head.load_state_dict(state)
    return head


def write_variant(head: Eagle3Head, out, layer_prefix: str, outer_prefix: str = "", embed: bool = False,
                  t2d: bool = True, config: dict | None = None):
    """Store ``head`` under one published variant's names (the names written out, not the loader's)."""
    sd = head.state_dict()
    tensors = {f"{outer_prefix}{layer_prefix}{k}": sd[f"midlayer.{k}"] for k in LAYER_KEYS}
    tensors.update({f"{outer_prefix}fc.weight": sd["fc.weight"], f"{outer_prefix}norm.weight": sd["norm.weight"],
                    "lm_head.weight": sd["lm_head.weight"], "d2t": sd["d2t"]})
    if t2d:
        tensors["t2d"] = sd["t2d"]
    if embed:
        tensors[f"{outer_prefix}embed_tokens.weight"] = sd["embed_tokens.weight"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config or {**head.cfg.to_dict(), "eagle_config": None}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("layer_prefix, outer, embed, t2d", [
    ("midlayer.", "", False, True), ("midlayer.", "", True, True), ("layers.0.", "", True, True),
    ("layers.0.", "model.", False, False)])
def test_small_published_variants_load_to_the_same_head(tmp_path, layer_prefix, outer, embed, t2d):
    head = small_head()
    d = write_variant(head, tmp_path / "h", layer_prefix, outer, embed, t2d)
    embed_w = head.embed_tokens.weight.detach()
    loaded = load_eagle3(d, PROXY, embed_weight=None if embed else embed_w)
    assert loaded.aux_layer_ids == check_target(SMALL, PROXY)
    for name, ref in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], ref), name  # t2d rebuilt from d2t when absent
    ids, aux = torch.randint(0, SMALL.vocab_size, (1, 7)), torch.randn(1, 7, 3 * SMALL.target_hidden_size)
    assert torch.allclose(loaded(ids, aux)[0], head(ids, aux)[0])


def test_norm_before_residual_changes_only_the_residual(tmp_path):
    head = small_head()
    nbr = Eagle3Head(Eagle3Config(**{**SMALL.__dict__, "norm_before_residual": True})).eval()
    nbr.load_state_dict(head.state_dict())
    ids, aux = torch.randint(0, SMALL.vocab_size, (1, 5)), torch.randn(1, 5, 3 * SMALL.target_hidden_size)
    assert not torch.allclose(nbr(ids, aux)[0], head(ids, aux)[0])
    d = write_variant(nbr, tmp_path / "n", "layers.0.", embed=True, config=nbr.cfg.to_dict())
    assert load_eagle3(d, PROXY).cfg.norm_before_residual


def eval_cli(draft, out):
    return ["eval", "--model", str(TARGET_DIR), "--draft", str(draft), "--out", str(out), "--dataset", "gsm8k",
            "--limit", "1", "--methods", "ar,eagle3", "--max-new-tokens", "4", "--no-progress"]


def test_specfit_eval_runs_a_layers0_head_without_embedding(tmp_path):
    d = write_variant(small_head(), tmp_path / "h", "layers.0.", "model.", embed=False, t2d=False)
    assert main(eval_cli(d, tmp_path / "out")) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    ar, eagle = ({r["method"]: r for r in rows}[m] for m in ("ar", "eagle3"))
    assert eagle["output_ids"] == ar["output_ids"]  # greedy speculative output = greedy AR output


@pytest.mark.parametrize("mutate, field", [
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "target_hidden_size": 2048})), "target_hidden_size"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "draft_vocab_size": 600})), "weights.lm_head.weight"),
], ids=["head-for-another-target", "draft-vocab-mismatch"])
def test_specfit_eval_refuses_a_mismatched_head_in_one_line(tmp_path, capsys, mutate, field):
    d = write_variant(small_head(), tmp_path / "h", "midlayer.")
    mutate(d)
    assert main(eval_cli(d, tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and field in err and "Traceback" not in err


@pytest.mark.parametrize("head_config, field", [
    ({**SPECFORGE_QWEN3_30B, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 24, 48]}},
     "eagle_aux_hidden_state_layer_ids"),
    ({**SPECFORGE_QWEN3_30B, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 64,
      "num_key_value_heads": 4}, "target_hidden_size"),                  # a head built for a 4096-wide target
], ids=["aux-out-of-range", "head-for-a-wider-target"])
def test_specfit_eval_refuses_real_shape_heads_for_the_wrong_target(tmp_path, capsys, head_config, field):
    """``specfit eval --model DIR --draft DIR`` on a Qwen3-30B-A3B-shaped target: refused before any weight loads."""
    import shutil

    target = tmp_path / "qwen3-30b-a3b"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # eval prompts are text; any tokenizer will do here
        shutil.copy(TARGET_DIR / name, target / name)
    head = real_shape_head(tmp_path / "head", published_names("midlayer."), head_config)
    args = ["eval", "--model", str(target), "--draft", str(head), "--out", str(tmp_path / "out"), "--dataset", "gsm8k",
            "--limit", "1", "--methods", "eagle3", "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and field in err
