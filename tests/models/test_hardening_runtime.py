"""Hardening of the runtime: devices, batches, config values, head/target features.

Device logic is tested on the CPU with fakes (a monkeypatched ``torch.cuda``) and for real where CUDA
exists (those tests are skipped elsewhere). Config variants are checked against transformers'
``Qwen3MoeForCausalLM`` built at test time (no downloads).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from specfit.cli import main
from specfit.core.errors import SpecFitInputError
from specfit.models.proxy import paths as proxy_paths

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def build(tmp_path, **overrides):
    """A tiny random Qwen3-MoE checkpoint (4 layers, 8 experts, top-2) and its reference model."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
               max_position_embeddings=64, initializer_range=0.1)
    ref = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**cfg, **overrides})).eval()
    ref.save_pretrained(tmp_path)
    return tmp_path, ref


def reference_greedy(ref, ids, n) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    return out[0, len(ids):].tolist()


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


# --- devices ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["gpu", "tpu", "cuda:x", ""] + ([] if torch.cuda.is_available() else ["cuda", "cuda:1"]))
def test_unusable_device_is_one_error(device, capsys):
    from specfit.models.devices import resolve_device

    with pytest.raises(SpecFitInputError) as info:
        resolve_device(device)
    assert info.value.field == "device" and "this torch" in info.value.rule and "cpu" in info.value.rule
    proxy = proxy_paths()["target"]
    for argv in (["generate", "--model", str(proxy), "--prompt-ids", "1,2", "--max-new-tokens", "2"],
                 ["eval", "--methods", "ar", "--limit", "1", "--dataset", "gsm8k", "--out", "/nonexistent/never"]):
        assert main([*argv, "--device", device]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--device: " in err and "can use: cpu" in err, err


@pytest.fixture
def two_gpus(monkeypatch):
    """A fake torch.cuda with two GPUs, the current one being cuda:1; records what it is asked."""
    calls = []

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            calls.append(("record", stream))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: calls.append(("name", device)) or "FakeGPU")
    return calls


def test_device_strings_resolve_to_an_index(two_gpus):
    from specfit.models.devices import available_devices, resolve_device

    assert available_devices() == ["cpu", "cuda:0", "cuda:1"]
    assert resolve_device("cuda") == torch.device("cuda", 1)  # the current device, not cuda:0
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(SpecFitInputError, match="no such GPU; .*can use: cpu, cuda:0, cuda:1"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("index", [0, 1])
def test_transfer_timer_records_on_the_models_device(two_gpus, index):
    from specfit.models.experts import _Timer

    timer = _Timer(torch.device("cuda", index))
    timer.stop(timer.start(), lambda ms: None)
    assert two_gpus == [("record", f"stream of cuda:{index}")] * 2


@pytest.mark.parametrize("device,name", [("cpu", None), ("cuda:0", "FakeGPU"), ("cuda:1", "FakeGPU")])
def test_report_names_the_runs_device(two_gpus, device, name):
    from specfit.eval.machine import machine

    assert machine(device=device)["gpu"] == name
    assert [c for c in two_gpus if c[0] == "name"] == ([] if name is None else [("name", torch.device(device))])


def test_sampling_verifier_refuses_a_generator_on_another_device():
    from specfit.engine.verify import verify_sampling

    class CudaGenerator:
        device = torch.device("cuda", 0)

    with pytest.raises(SpecFitInputError, match="generator: is on cuda:0 but the logits are on cpu"):
        verify_sampling([5, 6], [-1, 0], torch.zeros(2, 8), temperature=0.7, generator=CudaGenerator())


@CUDA
def test_sampling_on_cuda_decodes():
    from specfit.engine import SpecDecoder
    from specfit.models.qwen3_moe import OffloadedQwen3Moe

    target = OffloadedQwen3Moe.from_pretrained(proxy_paths()["target"], device="cuda", cache_slots=4, max_len=64)
    dec = SpecDecoder(target, None, "ar", temperature=0.7, seed=1)
    gen = dec.generate([5, 9, 300], 4)
    assert len(gen.output_ids) == 4 and dec.sampling.generator.device == target.device
    assert target.cache.stats()["total"]["transfer_ms"] > 0


# --- batches ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def proxy_target():
    from specfit.models.qwen3_moe import OffloadedQwen3Moe

    return OffloadedQwen3Moe.from_pretrained(proxy_paths()["target"], cache_slots=8, max_len=64)


def test_runtime_refuses_a_batch(proxy_target):
    from specfit.models.qwen3_moe import greedy_generate

    ids = [5, 9, 300, 17]
    proxy_target.reset()
    one = proxy_target.prefill(torch.tensor(ids)).logits
    proxy_target.reset()
    torch.testing.assert_close(proxy_target.prefill(torch.tensor([ids])).logits, one)
    for call in (lambda x: (proxy_target.reset(), proxy_target.prefill(x)),
                 lambda x: greedy_generate(proxy_target, x, 2)):
        with pytest.raises(SpecFitInputError, match="input_ids: batch size 1 only: got 2 sequences"):
            call(torch.tensor([ids, ids]))
    assert greedy_generate(proxy_target, torch.tensor([ids]), 3) == greedy_generate(proxy_target, ids, 3)


def test_decoder_takes_one_sequence(proxy_target):
    from specfit.engine import SpecDecoder

    dec = SpecDecoder(proxy_target, None, "ar")
    ids = [5, 9, 300, 17]
    flat = dec.generate(ids, 3).output_ids
    assert dec.generate(torch.tensor([ids]), 3).output_ids == flat == dec.generate(torch.tensor(ids), 3).output_ids
    with pytest.raises(SpecFitInputError, match="prompt_ids: batch size 1 only"):
        dec.generate(torch.tensor([ids, ids]), 3)
    with pytest.raises(SpecFitInputError, match="prompt_ids: must be integer token ids"):
        dec.generate(torch.tensor([0.5, 1.5]), 3)
    with pytest.raises(SpecFitInputError, match="max_new_tokens: .* exceed the model's context of 2048"):
        dec.generate(ids, 5000)  # through the API too, not only the CLI


def test_every_token_id_entry_point_takes_one_sequence(proxy_target):
    from specfit.models.eagle3 import Eagle3Drafter, load_eagle3
    from specfit.models.traces import record_prompt

    ids = torch.tensor([[5, 9, 300], [5, 9, 301]])
    with pytest.raises(SpecFitInputError, match="prompt_ids: batch size 1 only"):
        record_prompt(proxy_target, ids)
    head = load_eagle3(proxy_paths()["eagle3"], embed_weight=proxy_target.w["model.embed_tokens.weight"])
    with pytest.raises(SpecFitInputError, match="accepted_tokens: batch size 1 only"):
        Eagle3Drafter(head).commit(ids, torch.zeros(6, 3 * 128))


def test_probe_training_device_is_checked():
    import numpy as np

    from specfit.models.predictors import train_probe

    with pytest.raises(SpecFitInputError, match="device: 'gpu' is not a device"):
        train_probe(np.zeros((4, 3), np.float32), np.zeros((4, 1, 1), np.int64), 2, device="gpu")


# --- head and target features -------------------------------------------------------------------
def test_head_and_target_aux_layers_must_agree():
    from specfit.engine import SpecDecoder
    from specfit.models.eagle3 import Eagle3Drafter, load_eagle3
    from specfit.models.qwen3_moe import OffloadedQwen3Moe

    proxy = proxy_paths()
    target = OffloadedQwen3Moe.from_pretrained(proxy["target"], max_len=32, aux_layers=(0, 2, 4))
    head = load_eagle3(proxy["eagle3"], embed_weight=target.w["model.embed_tokens.weight"])
    with pytest.raises(SpecFitInputError) as info:
        SpecDecoder(target, Eagle3Drafter(head), "eagle3")
    assert info.value.field == "aux_layers"
    assert "(1, 3, 5)" in info.value.rule and "(0, 2, 4)" in info.value.rule
    target.aux_layers = (1, 3, 5)
    SpecDecoder(target, Eagle3Drafter(head), "eagle3")  # agreeing features are accepted


# --- config values the runtime divides by, indexes with or loops over ---------------------------
@pytest.mark.parametrize("key,value,rule", [
    ("decoder_sparse_step", 0, "must be an integer >= 1"),
    ("decoder_sparse_step", "2", "must be an integer >= 1"),
    ("num_key_value_heads", 0, "must be an integer >= 1"),
    ("num_key_value_heads", 3, "must divide num_attention_heads"),
    ("mlp_only_layers", [7], "layer indices in [0, 4)"),
    ("mlp_only_layers", "1", "layer indices"),
    ("head_dim", 7, "positive even integer"),
    ("num_experts", -1, "must be an integer >= 0"),
    ("num_experts_per_tok", 0, "must be an integer >= 1"),
    ("rms_norm_eps", 0, "positive finite number"),
    ("max_position_embeddings", 0, "must be an integer >= 1"),
    ("eos_token_id", "x", "token id"),
])
def test_bad_config_values_are_named(tmp_path, capsys, key, value, rule):
    from specfit.models.qwen3_moe import CheckpointError, read_spec

    path, _ = build(tmp_path)
    edit_config(path, **{key: value})
    with pytest.raises(CheckpointError, match=re.escape(rule)) as info:
        read_spec(path)
    assert info.value.field == f"{path / 'config.json'}: {key}"
    capsys.readouterr()  # drop save_pretrained's progress bar
    assert main(["generate", "--model", str(path), "--prompt-ids", "1", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"config.json: {key}: " in err


@pytest.mark.parametrize("overrides", [dict(decoder_sparse_step=2), dict(mlp_only_layers=[0, 1, 2, 3]),
                                       dict(num_experts=0, num_experts_per_tok=1)],
                         ids=["sparse step 2", "every layer dense", "no experts"])
def test_sparse_step_and_dense_models_decode_like_transformers(tmp_path, capsys, overrides):
    from specfit.models.qwen3_moe import OffloadedQwen3Moe, greedy_generate

    path, ref = build(tmp_path, **overrides)
    model = OffloadedQwen3Moe.from_pretrained(path, cache_slots="all", max_len=32)
    ids = [3, 14, 15, 9]
    assert greedy_generate(model, ids, 5) == reference_greedy(ref, ids, 5)
    assert model.spec.moe_layers == tuple(i for i in range(4) if "decoder_sparse_step" in overrides and i % 2 == 1)
    assert model.memory()["expert_cache_bytes"] >= 0
    if not model.spec.moe_layers:  # nothing to offload: the evaluation refuses it in one line
        from specfit.eval.run import EvalConfig, plan

        for name in ("tokenizer.json", "tokenizer_config.json"):
            (path / name).symlink_to(proxy_paths()["target"] / name)
        edit_config(path, vocab_size=64)
        with pytest.raises(SpecFitInputError, match="has no MoE layer"):
            plan(EvalConfig(model=str(path), methods=("ar",), datasets=("gsm8k",), limit=1,
                            out=str(tmp_path / "out")))


def test_eagle3_config_heads_must_divide():
    from specfit.models.eagle3 import Eagle3Config

    cfg = json.loads((proxy_paths()["eagle3"] / "config.json").read_text())
    with pytest.raises(SpecFitInputError, match="config.num_key_value_heads: must divide"):
        Eagle3Config.from_dict({**cfg, "num_key_value_heads": 3})
