"""The shipped proxy models load, fit together and generate; helpers of their training and τ."""

import json

import numpy as np
import pytest
import torch

from specfit.models.eagle3 import DraftLevel, load_eagle3
from specfit.models.proxy import EAGLE3_DIR, EAGLE3_LITE_DIR, TARGET_DIR, head_dir, paths
from specfit.models.proxy.data import gsm8k, gsm8k_prompt
from specfit.models.proxy.evaluate import greedy_tau, select_tree
from specfit.models.proxy.train_head import draft_vocabulary

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def shipped():
    from specfit.models.proxy.train_head import load_target

    target, tok = load_target(TARGET_DIR)
    head = load_eagle3(EAGLE3_DIR, target.config, embed_weight=target.get_input_embeddings().weight)
    return target, tok, head


def test_paths_and_size():
    assert paths() == {"target": TARGET_DIR, "eagle3": EAGLE3_DIR, "eagle3-lite": EAGLE3_LITE_DIR}
    total = sum(p.stat().st_size for d in paths().values() for p in d.iterdir() if p.name.startswith(("model", "tokenizer")))
    assert total <= 60e6


def test_target_is_a_standard_qwen3_moe_checkpoint():
    cfg = json.loads((TARGET_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["num_experts"] == 128 and cfg["num_experts_per_tok"] == 8 and cfg["norm_topk_prob"] is True
    from safetensors import safe_open

    with safe_open(str(TARGET_DIR / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.127.gate_proj.weight" in keys  # per-expert layout, as the real checkpoint


def test_tokenizer_roundtrip(shipped):
    _, tok, _ = shipped
    text = "Question: Natalia sold 48 clips.\nAnswer: 48/2 = <<48/2=24>>24"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|endoftext|>" and len(tok) == 4096


def test_short_greedy_generation_equals_plain_greedy(shipped):
    target, tok, head = shipped
    ids = tok(gsm8k_prompt(gsm8k("test")[0]["question"]))["input_ids"]
    gen, taus = greedy_tau(target, head, ids, max_new_tokens=16)
    ref = target.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert gen[:16] == ref[: len(gen[:16])]
    assert all(1 <= t <= 7 for t in taus)  # depth 6: at most 6 accepted draft tokens + 1
    assert len(gen) <= 1 + sum(taus)


def level(depth, ids, parents, tokens, probs):
    n = len(ids)
    return DraftLevel(depth, torch.tensor(ids), torch.tensor(parents), torch.tensor(tokens), torch.tensor(probs),
                      torch.tensor(probs), torch.zeros(n, 2))


def test_select_tree_keeps_top_path_probability_closed_under_ancestors():
    levels = [level(1, [1, 2], [0, 0], [10, 11], [0.6, 0.3]),
              level(2, [3, 4, 5, 6], [1, 1, 2, 2], [12, 13, 14, 15], [0.5, 0.05, 0.3, 0.01])]
    children = select_tree(levels, total_tokens=3)  # root + the 3 most likely: 1 (0.6), 3 (0.5), 2/5 tie at 0.3 → 2
    assert children == {0: {10: 1, 11: 2}, 1: {12: 3}, 2: {}, 3: {}}
    assert select_tree(levels, total_tokens=0) == {0: {}}
    assert len(select_tree(levels, total_tokens=10)) == 7  # every node


def test_draft_vocabulary_takes_most_frequent_tokens_under_the_mixture():
    streams = {"a": np.array([5, 5, 5, 1]), "b": np.array([2, 2, 3, 3, 3, 3])}
    d2t, t2d, cov = draft_vocabulary(streams, {"a": 0.5, "b": 0.5}, vocab_size=8, draft_vocab_size=2)
    # shares: 5 → 0.375, 3 → 0.333, 2 → 0.167, 1 → 0.125
    assert (torch.arange(2) + d2t).tolist() == [3, 5]
    assert t2d.nonzero().flatten().tolist() == [3, 5]
    assert cov == pytest.approx(0.375 + 1 / 3)


def test_default_head_is_the_lite_one_and_strong_is_one_flag_away(tmp_path):
    from specfit.eval.run import EvalConfig, plan

    assert head_dir(None) == EAGLE3_LITE_DIR and head_dir("lite") == EAGLE3_LITE_DIR and head_dir("strong") == EAGLE3_DIR
    assert head_dir(tmp_path) == tmp_path  # a directory is taken as given
    cfg = dict(datasets=("gsm8k",), limit=1, methods=("eagle3",), out=str(tmp_path / "o"))
    assert plan(EvalConfig(**cfg)).draft_dir == EAGLE3_LITE_DIR.resolve()
    assert plan(EvalConfig(**cfg, draft="strong")).draft_dir == EAGLE3_DIR.resolve()


def test_lite_head_accepts_less_than_the_strong_head(shipped):
    """The lite head is the realistic one: τ around 2 where the strong head is far above (same prompts)."""
    target, tok, strong = shipped
    lite = load_eagle3(EAGLE3_LITE_DIR, target.config, embed_weight=target.get_input_embeddings().weight)
    taus = {"lite": [], "strong": []}
    for r in gsm8k("test")[:3]:
        ids = tok(gsm8k_prompt(r["question"]))["input_ids"]
        for name, head in (("lite", lite), ("strong", strong)):
            taus[name] += greedy_tau(target, head, ids, max_new_tokens=32)[1]
    lite_tau, strong_tau = np.mean(taus["lite"]), np.mean(taus["strong"])
    assert 1.5 <= lite_tau <= 3.0 and strong_tau > lite_tau + 1.0
