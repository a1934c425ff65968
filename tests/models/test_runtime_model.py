"""The offloaded Qwen3-MoE runtime against transformers' Qwen3MoeForCausalLM on tiny random models.

Checkpoints are built at test time with ``Qwen3MoeForCausalLM(config).save_pretrained`` (no
downloads). Weights are drawn with std 0.1 so that logits are O(1) and a wrong expert, position or
mask shows far above the 1e-4 tolerance (see ``test_comparison_is_sensitive``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from specfit.models.qwen3_moe import CheckpointError, OffloadedQwen3Moe, default_aux_layers, greedy_generate
from specfit.cli import main as cli_main
from specfit.core.errors import SpecFitInputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ATOL = 1e-4
VOCAB = 96

CONFIGS = {
    # 8 experts, top-2, renormalised top-k, every layer MoE (the Qwen3-30B-A3B shape family)
    "moe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    # 12 experts, top-4, raw softmax weights, layer 1 dense (mlp_only_layers)
    "mixed": dict(num_experts=12, num_experts_per_tok=4, norm_topk_prob=False, mlp_only_layers=[1]),
}


def tiny_config(**overrides) -> Qwen3MoeConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, max_position_embeddings=256,
                initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    base.update(overrides)
    return Qwen3MoeConfig(**base)


def build_reference(overrides: dict, seed: int) -> Qwen3MoeForCausalLM:
    """A random reference model in which every expert gets tokens: unit-variance embeddings (the token
    dominates the residual stream, so routing varies across tokens) and router rows of equal norm."""
    torch.manual_seed(seed)
    ref = Qwen3MoeForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():
        ref.model.embed_tokens.weight.normal_(0.0, 1.0)
        for layer in ref.model.layers:
            if hasattr(layer.mlp, "gate"):
                w = layer.mlp.gate.weight
                w.copy_(torch.nn.functional.normalize(torch.randn_like(w), dim=-1) * 2.0)
    return ref


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """(checkpoint dir, reference model, config name) for each config."""
    ref = build_reference(CONFIGS[request.param], seed=0)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return path, ref, request.param


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    ref = build_reference(CONFIGS["moe"], seed=1)
    path = tmp_path_factory.mktemp("moe_ckpt")
    ref.save_pretrained(path)
    return path, ref


def load(path, device, **kwargs) -> OffloadedQwen3Moe:
    """The offloaded model on ``device`` (pytest ``--device``) in float32, comparable with the CPU reference."""
    return OffloadedQwen3Moe.from_pretrained(path, device=device, dtype=torch.float32, **kwargs)


def ref_logits(ref, ids) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.as_tensor(ids)[None]).logits[0].float()


def ref_routing(ref, ids) -> torch.Tensor:
    """(T, L_moe, k) top-k expert ids recorded from the reference routers."""
    got = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: got.append(o[2]))
             for layer in ref.model.layers if hasattr(layer.mlp, "gate")]
    try:
        ref_logits(ref, ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(got, dim=1)


def random_tree(n: int, rng: np.random.Generator) -> list[int]:
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def root_path(parents, v) -> list[int]:
    path = [v]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


TREES = {
    "single": [-1],
    "chain": [-1, 0, 1, 2, 3, 4],
    "star": [-1, 0, 0, 0, 0, 0, 0],
    "eagle": [-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7],
    "random_a": random_tree(16, np.random.default_rng(0)),
    "random_b": random_tree(24, np.random.default_rng(1)),
}


# --- exactness against the reference ---------------------------------------------------------------
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-expert"])
@pytest.mark.parametrize("slots,eviction", [(0, "lru"), (1, "lru"), ("top_k", "lru"), ("top_k", "lfu"), ("all", "lru"),
                                           (1, "lookahead"), ("top_k", "lookahead"), ("top_k", "lookahead-lfu")])
def test_prefill_decode_verify_match_reference(tiny, slots, eviction, grouped, device):
    path, ref, _ = tiny
    k, E = ref.config.num_experts_per_tok, ref.config.num_experts
    slots = k if slots == "top_k" else slots
    model = load(path, device, cache_slots=slots, eviction=eviction, max_len=128)
    if eviction.startswith("lookahead"):  # a demand unrelated to the routing: evictions change, outputs must not
        model.cache.set_lookahead(np.random.default_rng(5).integers(0, 3, (model.cache.num_layers, E)).astype(float))
    assert model.grouped_experts  # the default
    model.grouped_experts = grouped
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (12,), generator=gen)
    out = model.prefill(prompt)
    torch.testing.assert_close(out.logits.cpu(), ref_logits(ref, prompt), atol=ATOL, rtol=0)
    assert torch.equal(out.routing.cpu(), ref_routing(ref, prompt))
    seq = prompt.tolist()
    for _ in range(3):                                  # AR decode
        seq.append(int(out.logits[-1].argmax()))
        out = model.decode(seq[-1])
        torch.testing.assert_close(out.logits[0].cpu(), ref_logits(ref, seq)[-1], atol=ATOL, rtol=0)
    parents = random_tree(48, np.random.default_rng(2))  # a verify batch touching every expert
    tokens = torch.randint(0, VOCAB, (len(parents),), generator=gen)
    tokens[0] = int(out.logits[-1].argmax())
    out = model.verify(tokens, parents)
    for layer in range(out.routing.shape[1]):
        assert set(out.routing[:, layer].flatten().tolist()) == set(range(E)), "test batch must touch every expert"
    for v in range(len(parents)):
        full = seq + tokens[root_path(parents, v)].tolist()
        torch.testing.assert_close(out.logits[v].cpu(), ref_logits(ref, full)[-1], atol=ATOL, rtol=0)
        assert torch.equal(out.routing[v].cpu(), ref_routing(ref, full)[-1])
    st = model.cache.stats()
    assert st["total"]["hits"] + st["total"]["misses"] > 0
    if slots == 0:
        assert st["total"]["hits"] == 0
    if slots == "all":
        assert st["total"]["misses"] == 0 and st["total"]["bytes_moved"] == 0


@pytest.mark.parametrize("admission", ["accepted", "all"])
@pytest.mark.parametrize("slots,eviction", [(1, "lru"), ("top_k", "lru"), ("top_k", "lfu")])
def test_admission_changes_timing_not_results(tiny, slots, eviction, admission):
    """Cache-aware verification (``admission="accepted"``): after verify + commit, experts that only rejected nodes
    routed to are demoted (admission='accepted') or kept as used ('all'); every forward still equals
    the reference."""
    path, ref, _ = tiny
    slots = ref.config.num_experts_per_tok if slots == "top_k" else slots
    model = OffloadedQwen3Moe.from_pretrained(path, cache_slots=slots, eviction=eviction, admission=admission,
                                              max_len=128)
    seq = [5, 17, 42, 8, 3]
    out = model.prefill(seq)
    rng = np.random.default_rng(4)
    for _ in range(3):
        parents = random_tree(12, rng)
        tokens = [int(out.logits[-1].argmax())] + rng.integers(0, VOCAB, len(parents) - 1).tolist()
        out = model.verify(tokens, parents)
        accepted = root_path(parents, int(rng.integers(len(parents))))
        model.commit(accepted)
        used = [set(out.routing[accepted, j].flatten().tolist()) for j in range(out.routing.shape[1])]
        for j, cold in enumerate(model.cache._cold):
            assert not cold & used[j], "an expert of the accepted path was demoted"
            assert admission == "accepted" or not cold
        seq += [tokens[v] for v in accepted]
        seq.append(int(out.logits[accepted[-1]].argmax()))   # the bonus token, decoded as one AR step
        out = model.decode(seq[-1])
    torch.testing.assert_close(out.logits[-1], ref_logits(ref, seq)[-1], atol=ATOL, rtol=0)
    assert model.cache.stats()["admission"] == admission


def test_hidden_states_match_reference(tiny):
    path, ref, _ = tiny
    L, H = ref.config.num_hidden_layers, ref.config.hidden_size
    model = OffloadedQwen3Moe.from_pretrained(path, aux_layers=(0, 1, 2, 3))
    ids = torch.arange(10) * 7 % VOCAB
    out = model.prefill(ids)
    with torch.no_grad():
        r = ref(ids[None], output_hidden_states=True)
    for j, i in enumerate(model.aux_layers):
        torch.testing.assert_close(out.aux_hidden[:, j * H:(j + 1) * H], r.hidden_states[i][0], atol=ATOL, rtol=0)
    with torch.no_grad():
        last = ref.model(ids[None]).last_hidden_state[0]
    torch.testing.assert_close(out.last_hidden, last, atol=ATOL, rtol=0)
    assert model.aux_layers == (0, 1, 2, 3)
    assert OffloadedQwen3Moe.from_pretrained(path).aux_layers == default_aux_layers(L) == (1, 2, 3)
    assert default_aux_layers(48) == (2, 24, 45)


def test_comparison_is_sensitive(moe_ckpt):
    """Swapping two experts of one layer moves the logits far beyond the tolerance."""
    path, ref = moe_ckpt
    model = OffloadedQwen3Moe.from_pretrained(path, cache_slots=0)
    ids = torch.arange(16) * 5 % VOCAB
    gu = model.store.gate_up[0]
    gu[[0, 1]] = gu[[1, 0]].clone()
    assert (model.prefill(ids).logits - ref_logits(ref, ids)).abs().max() > 100 * ATOL


# --- tree verify and KV compaction ------------------------------------------------------------------
@pytest.mark.parametrize("shape", sorted(TREES))
def test_tree_verify_equals_sequential_decode(moe_ckpt, shape, device):
    path, _ = moe_ckpt
    parents = TREES[shape]
    model = load(path, device, cache_slots=1, max_len=64)
    gen = torch.Generator().manual_seed(len(parents))
    prefix = torch.randint(0, VOCAB, (7,), generator=gen)
    tokens = torch.randint(0, VOCAB, (len(parents),), generator=gen)
    model.prefill(prefix)
    tree_out = model.verify(tokens, parents)
    assert model.kv_len == len(prefix)
    for v in range(len(parents)):
        model.reset()
        model.prefill(prefix)
        for t in tokens[root_path(parents, v)]:
            seq_out = model.decode(t)
        torch.testing.assert_close(tree_out.logits[v], seq_out.logits[0], atol=ATOL, rtol=0)
        assert torch.equal(tree_out.routing[v], seq_out.routing[0])
        torch.testing.assert_close(tree_out.aux_hidden[v], seq_out.aux_hidden[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("shape,leaf", [("eagle", 10), ("eagle", 6), ("random_b", None), ("star", 5), ("star", 0)])
def test_commit_keeps_accepted_path_kv(moe_ckpt, shape, leaf, device):
    path, ref = moe_ckpt
    parents = TREES[shape]
    leaf = len(parents) - 1 if leaf is None else leaf
    accepted = root_path(parents, leaf)
    assert shape == "star" or accepted != list(range(len(accepted))), "path must not be the leftmost chain"
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, VOCAB, (9,), generator=gen)
    tokens = torch.randint(0, VOCAB, (len(parents),), generator=gen)
    model = load(path, device, cache_slots=2, max_len=64)
    model.prefill(prefix)
    model.verify(tokens, parents)
    model.commit(accepted)
    committed = prefix.tolist() + tokens[accepted].tolist()
    fresh = load(path, device, max_len=64)
    fresh.prefill(committed)
    assert model.kv_len == fresh.kv_len == len(committed)
    n = len(committed)
    torch.testing.assert_close(model.k_cache[:, :, :n], fresh.k_cache[:, :, :n], atol=1e-5, rtol=0)
    torch.testing.assert_close(model.v_cache[:, :, :n], fresh.v_cache[:, :, :n], atol=1e-5, rtol=0)
    nxt = model.decode(7)                               # the next cycle sees exactly the committed text
    torch.testing.assert_close(nxt.logits[0].cpu(), ref_logits(ref, committed + [7])[-1], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def model_pair(moe_ckpt, device):
    path, _ = moe_ckpt
    return load(path, device, cache_slots=3, max_len=64), load(path, device, cache_slots=0, max_len=64)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_fuzz_tree_verify_commit(model_pair, data):
    """Any tree shape, any accepted root path: the next forward equals a fresh prefill of the committed text."""
    model, fresh = model_pair
    n = data.draw(st.integers(1, 14), label="nodes")
    parents = [-1] + [data.draw(st.integers(0, i - 1), label=f"parent{i}") for i in range(1, n)]
    tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n), label="tokens")
    leaf = data.draw(st.integers(0, n - 1), label="leaf")
    prefix = [3, 1, 4, 1, 5]
    model.reset()
    model.prefill(prefix)
    tree = model.verify(tokens, parents)
    accepted = root_path(parents, leaf)
    model.commit(accepted)
    committed = prefix + [tokens[v] for v in accepted]
    fresh.reset()
    full = fresh.prefill(committed)
    torch.testing.assert_close(tree.logits[leaf], full.logits[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.decode(9).logits, fresh.decode(9).logits, atol=ATOL, rtol=0)


def test_verify_without_commit_leaves_prefix(moe_ckpt):
    path, ref = moe_ckpt
    model = OffloadedQwen3Moe.from_pretrained(path, max_len=64)
    model.prefill([1, 2, 3])
    model.verify([4, 5, 6], [-1, 0, 0])
    out = model.decode(9)                               # drops the pending tree
    torch.testing.assert_close(out.logits[0], ref_logits(ref, [1, 2, 3, 9])[-1], atol=ATOL, rtol=0)


# --- generation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("slots", [0, 3])
def test_greedy_generation_equals_transformers(tiny, slots, device):
    path, ref, _ = tiny
    prompt = [5, 17, 42, 8, 23]
    model = load(path, device, cache_slots=slots, max_len=64)
    ours = greedy_generate(model, prompt, 16)
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
    assert ours == theirs.tolist()
    assert len(set(ours)) > 1, "degenerate test: the model repeats one token"


def test_greedy_generate_stops_at_eos(moe_ckpt):
    path, _ = moe_ckpt
    model = OffloadedQwen3Moe.from_pretrained(path, max_len=64)
    full = greedy_generate(model, [1, 2], 8)
    assert greedy_generate(model, [1, 2], 8, eos_token_id=full[2]) == full[:full.index(full[2]) + 1]
    with pytest.raises(SpecFitInputError, match="max_new_tokens: must be a positive integer"):
        greedy_generate(model, [1, 2], 0)  # the same rule as `specfit eval`


# --- loading -------------------------------------------------------------------------------------
def fuse_experts(src, dst, num_layers, num_experts):
    """Rewrite a per-expert checkpoint into the fused layout (E, 2I, H) / (E, H, I)."""
    sd = load_file(src / "model.safetensors")
    for i in range(num_layers):
        p = f"model.layers.{i}.mlp.experts."
        gate = [sd.pop(f"{p}{e}.gate_proj.weight") for e in range(num_experts)]
        up = [sd.pop(f"{p}{e}.up_proj.weight") for e in range(num_experts)]
        down = [sd.pop(f"{p}{e}.down_proj.weight") for e in range(num_experts)]
        sd[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        sd[p + "down_proj"] = torch.stack(down)
    dst.mkdir()
    save_file(sd, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_layouts_load_identically(moe_ckpt, tmp_path):
    path, ref = moe_ckpt
    fuse_experts(path, tmp_path / "fused", 4, 8)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    ids = torch.arange(20) * 3 % VOCAB
    logits = [OffloadedQwen3Moe.from_pretrained(d, cache_slots=2).prefill(ids).logits
              for d in (path, tmp_path / "fused", tmp_path / "sharded")]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    # transformers itself reads the fused file: the orientation is the reference one
    back = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "fused").eval()
    torch.testing.assert_close(ref_logits(back, ids), ref_logits(ref, ids), atol=0, rtol=0)


def _copy_ckpt(src, dst, edit_config=None, edit_tensors=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(src / "model.safetensors")
    if edit_tensors:
        edit_tensors(sd)
    save_file(sd, dst / "model.safetensors")
    return dst


def _set(key, value):
    return lambda cfg: cfg.__setitem__(key, value)


ERROR_CASES = {
    "architecture": (dict(edit_config=_set("architectures", ["LlamaForCausalLM"])), "config.json: architectures"),
    "sliding_window": (dict(edit_config=_set("use_sliding_window", True)), "use_sliding_window"),
    "rope_type": (dict(edit_config=_set("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4})),
                  "rope_parameters.rope_type"),
    "missing_key": (dict(edit_config=lambda c: c.pop("num_hidden_layers")), "num_hidden_layers"),
    "missing_tensor": (dict(edit_tensors=lambda sd: sd.pop("model.layers.1.self_attn.k_norm.weight")),
                       "model.layers.1.self_attn.k_norm.weight"),
    "missing_expert": (dict(edit_tensors=lambda sd: sd.pop("model.layers.2.mlp.experts.5.up_proj.weight")),
                       "model.layers.2.mlp.experts.5.up_proj.weight"),
    "shape": (dict(edit_tensors=lambda sd: sd.__setitem__("model.layers.0.mlp.gate.weight", torch.zeros(7, 32))),
              "model.safetensors: model.layers.0.mlp.gate.weight"),
    "expert_shape": (dict(edit_tensors=lambda sd: sd.__setitem__("model.layers.3.mlp.experts.0.down_proj.weight",
                                                                 torch.zeros(16, 32))),
                     "model.layers.3.mlp.experts.0.down_proj.weight"),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_loading_errors_name_file_and_tensor(moe_ckpt, tmp_path, case):
    path, _ = moe_ckpt
    edits, needle = ERROR_CASES[case]
    bad = _copy_ckpt(path, tmp_path / case, **edits)
    with pytest.raises(CheckpointError) as err:
        OffloadedQwen3Moe.from_pretrained(bad)
    assert needle in str(err.value) and str(bad) in str(err.value)
    assert isinstance(err.value, SpecFitInputError)


def test_loading_errors_for_files(moe_ckpt, tmp_path):
    path, ref = moe_ckpt
    with pytest.raises(CheckpointError, match="config.json"):
        OffloadedQwen3Moe.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match="model.safetensors"):
        OffloadedQwen3Moe.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        OffloadedQwen3Moe.from_pretrained(tmp_path)
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, max_shard_size="40KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name}: model\\.") as err:
        OffloadedQwen3Moe.from_pretrained(sharded)
    assert "missing" in str(err.value)
    fused = tmp_path / "fused"
    fuse_experts(path, fused, 4, 8)
    sd = load_file(fused / "model.safetensors")
    sd["model.layers.1.mlp.experts.gate_up_proj"] = sd["model.layers.1.mlp.experts.gate_up_proj"][:, :16].contiguous()
    save_file(sd, fused / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"gate_up_proj.*expected shape \(8, 32, 32\), got \(8, 16, 32\)"):
        OffloadedQwen3Moe.from_pretrained(fused)


# --- runtime input errors and memory budget ---------------------------------------------------------
def test_runtime_input_errors(moe_ckpt):
    path, _ = moe_ckpt
    model = OffloadedQwen3Moe.from_pretrained(path, max_len=16)
    with pytest.raises(SpecFitInputError, match="commit needs a preceding verify"):
        model.commit([0])
    model.prefill([1, 2, 3])
    model.verify([4, 5, 6, 7], [-1, 0, 0, 1])
    with pytest.raises(SpecFitInputError, match="node 3 is not a child of node 2"):
        model.commit([0, 2, 3])
    with pytest.raises(SpecFitInputError, match="root node 0"):
        model.commit([1, 3])
    with pytest.raises(SpecFitInputError, match="parents"):
        model.verify([4, 5], [-1, 0, 0])
    with pytest.raises(SpecFitInputError, match="parents"):
        model.verify([4, 5], [-1, 1])
    with pytest.raises(SpecFitInputError, match="max_len"):
        model.prefill(list(range(14)))
    with pytest.raises(SpecFitInputError, match="input_ids"):
        model.decode(VOCAB)
    for kwargs, field in [(dict(cache_slots=9), "cache_slots"), (dict(cache_slots="some"), "cache_slots"),
                          (dict(eviction="fifo"), "eviction"), (dict(aux_layers=(0, 5)), "aux_layers"),
                          (dict(gpu_memory="lots"), "gpu_memory"), (dict(gpu_memory=100), "gpu_memory"),
                          (dict(cache_slots=2, gpu_memory="1GiB"), "gpu_memory")]:
        with pytest.raises(SpecFitInputError, match=field):
            OffloadedQwen3Moe.from_pretrained(path, **kwargs)


def test_gpu_memory_budget_sets_slots(moe_ckpt):
    path, _ = moe_ckpt
    base = OffloadedQwen3Moe.from_pretrained(path, cache_slots=0, max_len=32)
    mem = base.memory()
    resident = mem["dense_bytes"] + mem["kv_bytes"]
    eb = base.store.expert_bytes
    assert eb == 3 * 32 * 16 * 4 and mem["host_bytes"] == 4 * 8 * eb
    for slots in (1, 3, 8):
        budget = resident + slots * 4 * eb + eb // 2
        m = OffloadedQwen3Moe.from_pretrained(path, gpu_memory=budget, max_len=32)
        assert m.cache.slots == slots
        assert m.memory()["device_bytes"] <= budget
    assert OffloadedQwen3Moe.from_pretrained(path, gpu_memory="1GiB", max_len=32).cache.slots == 8


# --- the command line ----------------------------------------------------------------------------
def generate_json(capsys, model_dir, *argv) -> dict:
    """Run ``specfit generate --json`` in process; return the printed object."""
    assert cli_main(["generate", "--model", str(model_dir), *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_generate_json(moe_ckpt, capsys):
    path, _ = moe_ckpt
    out = generate_json(capsys, path, "--prompt-ids", "5,17,42", "--max-new-tokens", "6", "--cache-slots", "2")
    expected = greedy_generate(OffloadedQwen3Moe.from_pretrained(path), [5, 17, 42], 6)
    assert out["output_ids"] == expected
    assert out["text"] is None
    assert len(out["stats"]["layers"]) == 4
    total = out["stats"]["total"]
    assert total["misses"] == sum(layer["misses"] for layer in out["stats"]["layers"])
    assert total["bytes_moved"] == total["misses"] * 3 * 32 * 16 * 4
    assert out["memory"]["host_bytes"] > 0
    bf16 = generate_json(capsys, path, "--prompt-ids", "5,17,42", "--max-new-tokens", "6", "--cache-slots", "2",
                         "--dtype", "bfloat16")  # half the bytes per expert moved
    assert bf16["stats"]["total"]["bytes_moved"] == bf16["stats"]["total"]["misses"] * 3 * 32 * 16 * 2


def test_cli_generate_text_with_tokenizer(moe_ckpt, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path, ref = moe_ckpt
    words = [f"w{i}" for i in range(VOCAB - 1)] + ["<unk>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    ref.save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(tmp_path)
    out = generate_json(capsys, tmp_path, "--prompt", "w5 w17 w42", "--max-new-tokens", "4", "--cache-slots", "all")
    expected = greedy_generate(OffloadedQwen3Moe.from_pretrained(path), [5, 17, 42], 4)
    assert out["output_ids"] == expected
    assert out["text"].split() == [words[i] for i in expected]
    assert out["stats"]["total"]["misses"] == 0
    rc = cli_main(["generate", "--model", str(tmp_path), "--prompt", "w1 w2", "--max-new-tokens", "2"])
    assert rc == 0 and "output_ids" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["--prompt", "hello"], "prompt: the model directory has no tokenizer"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    (["--prompt-ids", "1", "--cache-slots", "99"], "--cache-slots: must be an integer in [0, 8]"),
])
def test_cli_generate_errors(moe_ckpt, capsys, argv, needle):
    path, _ = moe_ckpt
    rc = cli_main(["generate", "--model", str(path), "--max-new-tokens", "2", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_published_config_spelling_and_tied_embeddings(moe_ckpt, tmp_path):
    """Published Qwen3-30B-A3B configs say num_experts / top-level rope_theta / rope_scaling: null."""
    path, ref = moe_ckpt

    def published(cfg):
        cfg["num_experts"] = cfg.pop("num_local_experts")
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
        cfg.update(rope_scaling=None, torch_dtype="bfloat16", max_window_layers=4)

    old = _copy_ckpt(path, tmp_path / "published", edit_config=published)
    ids = torch.arange(12) * 11 % VOCAB
    torch.testing.assert_close(OffloadedQwen3Moe.from_pretrained(old).prefill(ids).logits, ref_logits(ref, ids),
                               atol=ATOL, rtol=0)
    tied = build_reference(dict(CONFIGS["moe"], tie_word_embeddings=True), seed=4)
    tied.save_pretrained(tmp_path / "tied")
    assert "lm_head.weight" not in load_file(tmp_path / "tied" / "model.safetensors")
    torch.testing.assert_close(OffloadedQwen3Moe.from_pretrained(tmp_path / "tied").prefill(ids).logits,
                               ref_logits(tied, ids), atol=ATOL, rtol=0)


def test_bfloat16_path_runs(moe_ckpt, device):
    """The CUDA dtype (bfloat16) through every forward mode, on ``--device``: close to float32."""
    path, _ = moe_ckpt
    ids = torch.arange(10) * 13 % VOCAB
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        model = OffloadedQwen3Moe.from_pretrained(path, device=device, dtype=dtype, cache_slots=1, max_len=32)
        assert model.k_cache.dtype == model.store.gate_up[0].dtype == dtype
        model.prefill(ids)
        out = model.verify([3, 4, 5, 6], [-1, 0, 0, 1])
        model.commit([0, 1, 3])
        outs.append((out.logits, model.decode(2).logits))
        assert out.logits.dtype == torch.float32 and out.aux_hidden.dtype == dtype
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=0.15, rtol=0.05)


def run_forwards(model: OffloadedQwen3Moe, seed: int = 4) -> list:
    """Prefill, a 40-node verify, its commit and three decodes of random tokens: the outputs, in order."""
    rng = np.random.default_rng(seed)
    prompt = torch.as_tensor(rng.integers(0, model.spec.vocab_size, 40))
    parents = random_tree(40, rng)
    tokens = torch.as_tensor(rng.integers(0, model.spec.vocab_size, len(parents)))
    got = [model.prefill(prompt), model.verify(tokens, parents)]
    model.commit(root_path(parents, len(parents) - 1))
    return got + [model.decode(int(t)) for t in tokens[:3]]


def proxy_pair(device, dtype, slots, kernel: bool | None = None) -> tuple[list, list, list]:
    """The shipped proxy on ``device`` in ``dtype`` at ``slots``, run (:func:`run_forwards`) with the experts
    in rounds (``kernel``: force the grouped kernel on or off) and one call per expert: both outputs and
    both caches' counters (times left out)."""
    from specfit.models.proxy import paths

    outs, counts = [], []
    for grouped in (True, False):
        model = OffloadedQwen3Moe.from_pretrained(paths()["target"], device=device, dtype=dtype, cache_slots=slots,
                                                  max_len=128)
        model.grouped_experts = grouped
        if kernel is not None:
            model.grouped_kernel = kernel
        outs.append(run_forwards(model))
        counts.append({k: v for k, v in model.cache.stats()["total"].items() if not k.endswith("_ms")})
    return outs[0], outs[1], counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("slots", [0, 5, 32, "all"])
def test_grouped_experts_equal_per_expert_calls_on_the_cpu(slots, dtype):
    """A round of a layer's experts run together gives bitwise the per-expert path's outputs and cache
    counters on the shipped proxy (128 experts, top-8; 5 slots: several rounds per layer), in float32 and
    bfloat16: the same products, and each token's rows added in the same order (no two in one add).
    Prefill, a verify, its commit and decodes."""
    grouped, each, counts = proxy_pair("cpu", dtype, slots)
    for a, b in zip(grouped, each):
        assert torch.equal(a.routing, b.routing)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.aux_hidden, b.aux_hidden)
    assert counts[0] == counts[1] and counts[0]["hits"] + counts[0]["misses"] > 0


@pytest.mark.parametrize("slots", [5, "all"])
def test_grouped_kernel_path_equals_per_expert_calls(slots):
    """The grouped-kernel path (``torch.nn.functional.grouped_mm``, used on H100/H200-class GPUs in
    bfloat16), forced on here on the CPU, where that function multiplies group by group: bitwise the
    per-expert path's outputs. The kernel is not chosen on the CPU."""
    from specfit.models.qwen3_moe.model import grouped_kernel_available, grouped_mm_function

    assert not grouped_kernel_available(torch.device("cpu"), torch.bfloat16, 128, 64)
    if grouped_mm_function() is None:
        pytest.skip("this torch has no grouped_mm")
    grouped, each, counts = proxy_pair("cpu", torch.float32, slots, kernel=True)
    for a, b in zip(grouped, each):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.routing, b.routing)
    assert counts[0] == counts[1]


def test_grouped_experts_on_device(device):
    """On ``--device`` in bfloat16 (the GPU's dtype; the grouped kernel where the GPU has it) the experts
    in rounds are no further from a float32 run than one call per expert is (mean absolute logit error
    over every output row; a router tie may flip in bfloat16, so routing is not compared)."""
    if torch.device(device).type == "cpu":
        pytest.skip("the CPU is tested bitwise (test_grouped_experts_equal_per_expert_calls_on_the_cpu)")
    grouped, each, _ = proxy_pair(device, torch.bfloat16, 32)
    exact, _, _ = proxy_pair(device, torch.float32, 32)
    for g, e, x in zip(grouped, each, exact):
        err_g = (g.logits.float() - x.logits).abs().mean().item()
        err_e = (e.logits.float() - x.logits).abs().mean().item()
        assert err_g <= 2 * err_e + 1e-3, (err_g, err_e)


def test_prefetch_changes_counts_not_results(moe_ckpt):
    """PITFALLS: prefetching or caching may change only timing, never results."""
    path, _ = moe_ckpt
    plain = OffloadedQwen3Moe.from_pretrained(path, cache_slots=2, max_len=64)
    fetched = OffloadedQwen3Moe.from_pretrained(path, cache_slots=2, max_len=64)
    ids = torch.arange(6) * 17 % VOCAB
    a = plain.prefill(ids)
    for layer in range(4):                              # the last token's experts, resident before the forward
        assert len(fetched.cache.prefetch(layer, a.routing[-1, layer].tolist())) == 2
    b = fetched.prefill(ids)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.routing, b.routing)
    got, base = fetched.cache.stats()["total"], plain.cache.stats()["total"]
    assert (got["prefetched"], got["hits"], base["hits"]) == (8, 8, 0)
    assert got["misses"] == base["misses"] - 8
