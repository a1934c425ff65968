"""eval/runtime_speed.py's verify parts on a tiny checkpoint (counts and consistency, not timings)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specfit.eval.runtime_bench import eagle_like_tree
from specfit.eval.runtime_speed import verify_over_ar, verify_parts
from specfit.models.qwen3_moe import OffloadedQwen3Moe


@pytest.fixture(scope="module")
def resident(tmp_path_factory, tiny_checkpoint):
    path = tmp_path_factory.mktemp("speed")
    tiny_checkpoint(path, layers=3, experts=8, top_k=2)
    return OffloadedQwen3Moe.from_pretrained(str(path), cache_slots="all", max_len=64)


def test_verify_parts_counts_the_verifys_own_experts(resident):
    prompt = torch.arange(1, 6)
    parts = verify_parts(resident, prompt, nodes=8, repeats=2, seed=3)
    rng = np.random.default_rng(3)  # the same tree and tokens, routed again
    parents = eagle_like_tree(8, rng)
    tokens = torch.as_tensor(rng.integers(0, resident.spec.vocab_size, 8))
    resident.reset()
    resident.prefill(prompt)
    routing = resident.verify(tokens, parents).routing.numpy()
    used = [np.unique(routing[:, l, :]) for l in range(routing.shape[1])]
    assert parts["experts_per_layer"] == pytest.approx(np.mean([len(u) for u in used]))
    assert parts["max_rows"] == max(np.bincount(routing[:, l, :].ravel()).max() for l in range(routing.shape[1]))
    spec = resident.spec
    assert parts["expert_bytes"] == 3 * spec.hidden_size * spec.moe_intermediate_size * 4  # float32
    assert parts["verify_read_ms"] / parts["ar_read_ms"] == pytest.approx(parts["experts_per_layer"] / 2)
    assert parts["read_gb_per_s"] > 0
    if not resident.resident_grouped_mm:  # this torch's CPU grouped_mm does not run: the products are not replayed
        assert parts["expert_products_ms"] is None
        return
    assert parts["expert_products_ms"] > 0
    resident.resident_grouped_mm = False  # as such a torch
    try:
        assert verify_parts(resident, prompt, nodes=8, repeats=1, seed=3)["expert_products_ms"] is None
    finally:
        resident.resident_grouped_mm = True


def test_verify_parts_needs_every_expert_resident(tmp_path, tiny_checkpoint):
    tiny_checkpoint(tmp_path, layers=2, experts=8, top_k=2)
    model = OffloadedQwen3Moe.from_pretrained(str(tmp_path), cache_slots=4, max_len=32)
    with pytest.raises(ValueError, match="every expert resident, got 4 slots"):
        verify_parts(model, torch.arange(1, 4), nodes=4)


def test_verify_over_ar_leaves_the_prefix(resident):
    prompt = torch.arange(1, 6)
    res = verify_over_ar(resident, prompt, nodes=8, repeats=2)
    assert set(res) == {"ar_step_ms", "verify_8_ms", "ratio", "repeats"}
    assert res["ratio"] == pytest.approx(res["verify_8_ms"] / res["ar_step_ms"])
    assert resident.kv_len == len(prompt)
