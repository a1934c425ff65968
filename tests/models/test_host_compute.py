"""The host-compute offload mode: same outputs as the transfer mode, experts counted, cache static."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specfit.cli import main as cli_main
from specfit.core.errors import SpecFitInputError
from specfit.models.host_compute import HostComputeCache, hot_experts
from specfit.models.qwen3_moe import OffloadedQwen3Moe, greedy_generate
from tests.models.test_runtime_model import ATOL, VOCAB, moe_ckpt, random_tree, ref_logits  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(moe_ckpt):
    return moe_ckpt


def _hot(E: int, L: int = 4) -> list[list[int]]:
    """A per-layer priority that differs between layers (so a wrong layer's set would show)."""
    return [[(e * 3 + layer) % E for e in range(E)] for layer in range(L)]


def _run(model, prompt, parents):
    out = [model.prefill(prompt)]
    out.append(model.decode(int(out[-1].logits[-1].argmax())))
    out.append(model.verify(torch.as_tensor([int(out[-1].logits[-1].argmax())] + [7] * (len(parents) - 1)), parents))
    return out


def _equal_to_transfer(path, slots, prompt, **mode):
    """A transfer-mode model and one in ``mode`` after the same prefill, decode and verify, whose
    logits and routing are asserted bit-identical; returns (transfer, other, other's first cache)."""
    parents = random_tree(32, np.random.default_rng(3))
    transfer = OffloadedQwen3Moe.from_pretrained(path, cache_slots=slots, max_len=96)
    other = OffloadedQwen3Moe.from_pretrained(path, cache_slots=slots, max_len=96, **mode)
    resident = other.cache.cached_experts()
    for a, b in zip(_run(transfer, prompt, parents), _run(other, prompt, parents)):
        assert torch.equal(a.logits, b.logits)     # same CPU kernels, same summation order
        assert torch.equal(a.routing, b.routing)
    return transfer, other, resident


@pytest.mark.parametrize("slots", [0, 1, 2, 5, "all"])
def test_host_mode_equals_transfer_mode_and_reference(ckpt, slots):
    path, ref = ckpt
    E = ref.config.num_experts
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(1))
    transfer, host, resident = _equal_to_transfer(path, slots, prompt, offload="host", hot_experts=_hot(E))
    fresh = OffloadedQwen3Moe.from_pretrained(path, offload="host", cache_slots=slots, hot_experts=_hot(E))
    torch.testing.assert_close(fresh.prefill(prompt).logits, ref_logits(ref, prompt), atol=ATOL, rtol=0)
    st = host.cache.stats()
    t = st["total"]
    assert st["offload"] == "host"
    assert t["misses"] == 0 and t["bytes_moved"] == 0 and t["prefetched"] == 0  # nothing copied while decoding
    assert host.cache.cached_experts() == resident                              # the hot set is static
    n = E if slots == "all" else slots
    assert resident == [sorted(h[:n]) for h in _hot(E)]
    if n == E:
        assert t["host_computed"] == 0 and t["host_rows"] == 0
    else:
        assert t["host_computed"] > 0 and t["host_rows"] >= t["host_computed"]
    # every looked-up expert is a hit or host-computed: the counts of the transfer run's lookups
    tt = transfer.cache.stats()["total"]
    assert t["hits"] + t["host_computed"] == tt["hits"] + tt["misses"]


def test_host_rows_count_token_expert_pairs(ckpt):
    path, ref = ckpt
    model = OffloadedQwen3Moe.from_pretrained(path, cache_slots=0, offload="host", max_len=64)
    out = model.prefill(torch.arange(12) % VOCAB)
    layers = model.cache.stats()["layers"]
    for layer, st in enumerate(layers):
        assert st["host_rows"] == out.routing[:, layer].numel()             # 12 tokens x top-k, all on the host
        assert st["host_computed"] == torch.unique(out.routing[:, layer]).numel()


@pytest.mark.parametrize("slots", [0, 3, "all"])
def test_host_mode_greedy_generation_equals_transformers(ckpt, slots):
    path, ref = ckpt
    prompt = [5, 17, 42, 8, 23]
    model = OffloadedQwen3Moe.from_pretrained(path, cache_slots=slots, max_len=64, offload="host",
                                              hot_experts=_hot(ref.config.num_experts))
    ours = greedy_generate(model, prompt, 16)
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
    assert ours == theirs.tolist()


def test_reset_cache_keeps_the_mode_and_hot_set(ckpt):
    path, ref = ckpt
    E = ref.config.num_experts
    model = OffloadedQwen3Moe.from_pretrained(path, cache_slots=2, offload="host", hot_experts=_hot(E))
    model.reset_cache(3)
    assert isinstance(model.cache, HostComputeCache)
    assert model.cache.cached_experts() == [sorted(h[:3]) for h in _hot(E)]
    assert [sorted(r.nonzero()[0].tolist()) for r in model.cache.resident_mask()] == model.cache.cached_experts()
    assert model.cache.prefetch(0, [7, 6]) == [] and model.cache.cached_experts()[0] == sorted(_hot(E)[0][:3])
    empty = OffloadedQwen3Moe.from_pretrained(path, cache_slots=3, offload="host")  # no hot set: stays empty
    assert empty.cache.cached_experts() == [[]] * 4


def test_hot_experts_are_the_most_frequent():
    routing = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 1]], [[0, 1], [3, 1]]])  # (N=3, L=2, k=2)
    assert hot_experts(routing, 4, 2) == [[0, 1], [1, 2]]   # layer 1: 1, 2, 3 twice each: ties to the lower id
    assert hot_experts(routing, 4, 0) == [[], []]
    assert hot_experts(routing, 4, 4)[0] == [0, 1, 2, 3]


def test_bad_offload_and_hot_set_are_input_errors(ckpt, capsys):
    path, ref = ckpt
    with pytest.raises(SpecFitInputError, match="offload"):
        OffloadedQwen3Moe.from_pretrained(path, offload="gpu")
    with pytest.raises(SpecFitInputError, match="hot_experts"):
        OffloadedQwen3Moe.from_pretrained(path, cache_slots=2, offload="host", hot_experts=[[0]])
    with pytest.raises(SpecFitInputError, match="hot_experts"):
        OffloadedQwen3Moe.from_pretrained(path, cache_slots=2, offload="host", hot_experts=[[99]] * 4)
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "--model", str(path), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--offload", "gpu"])
    assert exc.value.code == 2


@pytest.mark.parametrize("offload", ["host", "auto"])
def test_cli_generate_offload_modes(ckpt, capsys, offload):
    path, _ = ckpt
    argv = ["generate", "--model", str(path), "--prompt-ids", "5,17,42", "--max-new-tokens", "6", "--cache-slots", "2",
            "--json"]
    assert cli_main(argv) == 0
    transfer = json.loads(capsys.readouterr().out)
    assert cli_main(argv + ["--offload", offload]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["output_ids"] == transfer["output_ids"]
    assert got["stats"]["offload"] == offload and got["stats"]["total"]["host_computed"] > 0
    if offload == "host":
        assert got["stats"]["total"]["bytes_moved"] == 0           # the host mode copies nothing
    assert "host_computed" not in transfer["stats"]["total"]   # the transfer mode's stats are unchanged


# -- the auto mode: copy or compute on the host, per expert -------------------------------------------

def _profile(pe: float, pr: float = 0.0):
    """A host-regime profile whose host experts cost ``pe`` ms (+ ``pr`` per row); copies 0.4 ms."""
    from specfit.core.cost import CostModel, HostProfile

    return HostProfile("t", CostModel(4.8, 0.1, 0.4, reference_layers=48), 80.0, pe, pr, 0.03)


@pytest.mark.parametrize("slots", [0, 1, 2, 5, "all"])
def test_auto_mode_equals_the_other_modes_and_counts_every_lookup(ckpt, slots):
    path, ref = ckpt
    E = ref.config.num_experts
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(1))
    transfer, auto, _ = _equal_to_transfer(path, slots, prompt, offload="auto", hot_experts=_hot(E),
                                           offload_cost=_profile(pe=0.3))
    st = auto.cache.stats()
    t, tt = st["total"], transfer.cache.stats()["total"]
    assert st["offload"] == "auto"
    assert t["hits"] + t["misses"] + t["host_computed"] == tt["hits"] + tt["misses"]
    assert t["bytes_moved"] == t["misses"] * auto.store.expert_bytes   # what it copied, it counted
    n = E if slots == "all" else slots
    assert all(len(c) <= n for c in auto.cache.cached_experts())
    if n in (0, E):
        assert t["misses"] == 0             # nothing to copy into, or nothing uncached
    else:
        assert t["misses"] > 0 and t["host_computed"] > 0    # slow host experts: it did both


def test_auto_mode_copies_only_when_that_shortens_the_layer(ckpt):
    path, ref = ckpt
    E = ref.config.num_experts
    prompt = torch.arange(12) % VOCAB
    cheap = OffloadedQwen3Moe.from_pretrained(path, cache_slots=3, offload="auto", hot_experts=_hot(E),
                                              offload_cost=_profile(pe=1e-4))
    host = OffloadedQwen3Moe.from_pretrained(path, cache_slots=3, offload="host", hot_experts=_hot(E))
    cheap.prefill(prompt), host.prefill(prompt)
    a, b = cheap.cache.stats(), host.cache.stats()
    assert a["total"]["misses"] == 0                       # host experts nearly free: nothing copied ...
    assert [x["host_computed"] for x in a["layers"]] == [x["host_computed"] for x in b["layers"]]   # ... as host
    slow = OffloadedQwen3Moe.from_pretrained(path, cache_slots=3, offload="auto", hot_experts=_hot(E),
                                             offload_cost=_profile(pe=5.0))
    out = slow.prefill(prompt)
    for layer, st in enumerate(slow.cache.stats()["layers"]):
        hot = set(_hot(E)[layer][:3])
        needed = set(torch.unique(out.routing[:, layer]).tolist())
        free = 3 - len(needed & hot)
        assert st["misses"] == min(free, len(needed - hot))   # slow host: it copies all it can
        assert st["misses"] + st["host_computed"] == len(needed - hot)


def test_auto_mode_admits_what_it_copies_and_resets_to_the_hot_set(ckpt):
    path, ref = ckpt
    E = ref.config.num_experts
    model = OffloadedQwen3Moe.from_pretrained(path, cache_slots=2, offload="auto", hot_experts=_hot(E),
                                              offload_cost=_profile(pe=5.0))
    first = model.cache.cached_experts()
    assert first == [sorted(h[:2]) for h in _hot(E)]
    greedy_generate(model, [5, 17, 42, 8, 23], 6)
    assert model.cache.cached_experts() != first               # copied experts were admitted
    absent = min(set(range(E)) - set(model.cache.cached_experts()[0]))
    assert model.cache.prefetch(0, [absent]) == [absent]       # a dynamic cache: prefetch moves experts
    assert absent in model.cache.cached_experts()[0]
    assert [sorted(r.nonzero()[0].tolist()) for r in model.cache.resident_mask()] == model.cache.cached_experts()
    model.reset_cache(2)
    assert type(model.cache).__name__ == "AutoOffloadCache" and model.cache.cached_experts() == first
    with pytest.raises(SpecFitInputError, match="host_profile"):
        from specfit.models.host_compute import AutoOffloadCache
        AutoOffloadCache(model.store, "cpu", 2, cost="not a profile")



def test_cli_generate_auto_mode_text_splits_the_uncached_experts(ckpt, capsys):
    path, _ = ckpt
    assert cli_main(["generate", "--model", str(path), "--prompt-ids", "5,17,42", "--max-new-tokens", "4",
                     "--cache-slots", "2", "--offload", "auto"]) == 0
    out = capsys.readouterr().out
    assert "copied H2D" in out and "computed on the host" in out and "misses" not in out
