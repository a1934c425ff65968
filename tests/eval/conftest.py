"""Fixtures shared by the eval tests."""

import shutil

import pytest
import torch

from specfit.models.eagle3 import Eagle3Config, Eagle3Head, save_eagle3
from specfit.models.proxy import paths as proxy_paths
from specfit.models.qwen3_moe import OffloadedQwen3Moe
from specfit.models.traces import record_prompt


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, tiny_checkpoint):
    """A 3-layer random Qwen3-MoE target (``tiny / "target"``) with the proxy's tokenizer, a random EAGLE-3
    head (``tiny / "head"``) and the routing trace the default (frequency) predictor is built from."""
    root = tmp_path_factory.mktemp("eval_models")
    vocab = 4096  # the proxy tokenizer's vocabulary
    tiny_checkpoint(root / "target", vocab_size=vocab, layers=3, experts=16, top_k=4, intermediate_size=64,
                    max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=0, sharpen=8.0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(proxy_paths()["target"] / name, root / "target" / name)
    head = Eagle3Head(Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=32))
    save_eagle3(head, root / "head", include_embed=True, dtype=torch.float32)
    target = OffloadedQwen3Moe.from_pretrained(root / "target", cache_slots="all")
    trace = None
    for ids in ([5, 9, 300, 17, 42, 8], list(range(100, 140))):
        trace = record_prompt(target, ids, trace)
    trace.save(root / "target" / "routing_trace.npz")
    return root
