"""The resident path reads nothing back from the device: forwards whose experts are all resident run under a
dispatch mode that fails on every op that synchronises the host with the device (or would on CUDA:
:data:`specfit.models.devices.SYNC_OPS`), on the shipped proxy (128 experts, top-8). The guard itself is
checked to catch each kind of sync, and the offloaded path (missing experts) to be caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specfit.models.devices import SYNC_OPS, HostSyncGuard, OpCounter
from specfit.models.proxy import paths
from specfit.models.qwen3_moe import OffloadedQwen3Moe
from torch_features import needs_cpu_grouped_mm

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def proxy(device, slots="all", **attrs) -> OffloadedQwen3Moe:
    model = OffloadedQwen3Moe.from_pretrained(paths()["target"], device=device, dtype=torch.float32,
                                              cache_slots=slots, max_len=160)
    for k, v in attrs.items():
        setattr(model, k, v)
    return model


def tree(n: int, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """n random tokens and a random tree of n nodes (each node's parent uniform among the earlier ones)."""
    rng = np.random.default_rng(seed)
    return torch.as_tensor(rng.integers(0, 4096, n)), [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


@pytest.mark.parametrize("sync", ["item", "int", "nonzero", "bool_index", "unique", "masked_select", "where"])
def test_guard_catches_each_sync(sync):
    """(``.tolist()``/``.numpy()`` of a host tensor dispatch no op; on CUDA they copy to the host first,
    which the guard catches on a CUDA device.)"""
    t = torch.arange(6)
    ops = {"item": lambda: t.sum().item(), "int": lambda: int(t[2]), "nonzero": lambda: t.nonzero(),
           "bool_index": lambda: t[t > 2], "unique": lambda: torch.unique(t), "masked_select": lambda: t.masked_select(t > 1),
           "where": lambda: torch.where(t > 2)}
    with pytest.raises(AssertionError, match="host sync"):
        with HostSyncGuard():
            ops[sync]()
    assert "_local_scalar_dense" in SYNC_OPS and "nonzero" in SYNC_OPS


def test_guard_allows_device_only_work():
    with HostSyncGuard():
        x = torch.randn(4, 4)
        y = torch.softmax(x @ x.T, dim=-1).topk(2, dim=-1).indices.sort(dim=1).values
        torch.searchsorted(y.reshape(-1).sort().values, torch.arange(4))


def test_ar_step_with_every_expert_resident_never_syncs(device):
    """The default path of an AR step (gathered expert weights, or the grouped kernel where it runs)."""
    model = proxy(device)
    model.prefill(torch.arange(20) * 7 % 4096)
    ref = model.decode(5)                                    # warm-up: builds the slot tables
    model.kv_len -= 1
    with HostSyncGuard(device):
        out = model.decode(5)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.routing, ref.routing)


@pytest.mark.parametrize("path", ["gather", "grouped_kernel"])
def test_verify_with_every_expert_resident_never_syncs(path, device):
    """A 32-node verify on the resident paths a GPU takes: gathered weights (forced here to 32 tokens) and
    the grouped kernel (forced on; on the CPU torch multiplies group by group). Its outputs equal the
    host-routed path's (routing exactly, logits within float32 rounding: products of other row counts)."""
    tokens, parents = tree(32)
    attrs = {"gather_max_tokens": 32, "gather_max_bytes": None} if path == "gather" else {"grouped_kernel": True}
    if path == "grouped_kernel":
        from specfit.models.qwen3_moe.model import grouped_mm_function
        if grouped_mm_function() is None:
            pytest.skip("this torch has no grouped_mm")
        if device.startswith("cuda"):  # float32 grouped_mm there is torch's fallback, which reads offs on the host
            pytest.skip("on CUDA the grouped kernel runs in bfloat16 only: test_decode_graph.py's bfloat16 tests")
    model, base = proxy(device, **attrs), proxy(device)
    for m in (model, base):
        m.prefill(torch.arange(20) * 7 % 4096)
    for m in (model, base):
        m.verify(tokens, parents)                           # warm-up
    with HostSyncGuard(device):
        out = model.verify(tokens, parents)
    ref = base.verify(tokens, parents)
    assert torch.equal(out.routing, ref.routing)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=0)
    model.commit([0, 1])
    base.commit([0, 1])
    got, want = model.cache.stats()["total"], base.cache.stats()["total"]
    assert {k: v for k, v in got.items() if not k.endswith("_ms")} == {k: v for k, v in want.items()
                                                                      if not k.endswith("_ms")}
    assert got["hits"] > 0 and got["misses"] == 0


def test_offloaded_path_is_caught(device):
    """With missing experts the host reads the layer's routing once (what the guard must see)."""
    model = proxy(device, slots=5)
    model.prefill(torch.arange(20) * 7 % 4096)
    with pytest.raises(AssertionError, match="host sync|device-to-host"):
        with HostSyncGuard(device):
            model.decode(5)


def test_resident_ar_step_dispatches_fewer_ops_than_the_offloaded_one():
    """The resident AR step's op count stays below the host-routed path's (counts, not times)."""
    counts = []
    for slots in ("all", 0):
        model = proxy("cpu", slots=slots)
        model.prefill(torch.arange(20) * 7 % 4096)
        model.decode(5)
        with OpCounter() as c:
            model.decode(6)
        counts.append(c.total)
    assert counts[0] < counts[1]


@pytest.mark.parametrize("slots", ["all", 5])
def test_root_only_verify_is_the_tree_verify_and_its_commit_the_decode(slots):
    """A one-node verify (the engine's AR step) takes the decode forward without building a tree: bitwise the
    tree path's outputs (parents given as a tensor take that path), and after its commit the KV and the next
    forward are bitwise what a decode of the same token leaves."""
    fast, tree, dec = (proxy("cpu", slots=slots) for _ in range(3))
    for m in (fast, tree, dec):
        m.prefill(torch.arange(20) * 7 % 4096)
    a, b = fast.verify([9], [-1]), tree.verify([9], torch.tensor([-1]))
    assert torch.equal(a.logits, b.logits) and torch.equal(a.routing, b.routing)
    assert torch.equal(a.aux_hidden, b.aux_hidden)
    fast.commit([0])
    c = dec.decode(9)
    assert torch.equal(a.logits, c.logits) and fast.kv_len == dec.kv_len == 21
    assert torch.equal(fast.k_cache, dec.k_cache) and torch.equal(fast.v_cache, dec.v_cache)
    assert torch.equal(fast.decode(4).logits, dec.decode(4).logits)


@needs_cpu_grouped_mm
def test_ar_step_reads_slots_in_place_where_the_grouped_kernel_runs(monkeypatch):
    """Where the grouped kernel runs (bfloat16 on sm90/sm100) the eager AR step multiplies the slots in place, as
    its static forward does, instead of gathering 8 experts' weights per layer (a copy of ~75 MB per layer at
    Qwen3-30B-A3B's shape); elsewhere it gathers. Forced here on the CPU, whose grouped_mm multiplies group by group."""
    import specfit.models.qwen3_moe.model as model_module

    gathered = proxy("cpu")
    gathered.prefill(torch.arange(20) * 7 % 4096)
    ref = gathered.decode(5)
    assert gathered.gather_max_tokens == 1 and gathered._gathered
    monkeypatch.setattr(model_module, "grouped_kernel_available", lambda *args: True)
    grouped = proxy("cpu")
    grouped.prefill(torch.arange(20) * 7 % 4096)
    with HostSyncGuard("cpu"):
        out = grouped.decode(5)
    assert grouped.gather_max_tokens == 0 and not grouped._gathered
    assert torch.equal(out.routing, ref.routing)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=0)


def test_a_torch_without_a_cpu_grouped_mm_kernel_routes_on_the_host(monkeypatch):
    """torch 2.8 has ``torch._grouped_mm`` without a CPU kernel (it raises NotImplementedError) and 2.9+ refuse
    strides that are not 16-byte multiples: the runtime probes it, and where it does not run a resident verify
    takes the host-routed rounds instead, with the same logits."""
    import specfit.models.qwen3_moe.model as model_module

    def no_cpu_kernel(*args, **kwargs):
        raise NotImplementedError("no CPU kernel")

    tokens, parents = torch.tensor([5, 9, 11, 2]), [-1, 0, 0, 1]
    this_torch = model_module.cpu_grouped_mm_available(torch.float32, 128, 64)
    runs = []
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(model_module, "grouped_mm_function", lambda: no_cpu_kernel)
        model = proxy("cpu")
        model.prefill(torch.arange(20) * 7 % 4096)
        runs.append((model.resident_grouped_mm, model.verify(tokens, parents)))
    assert [r[0] for r in runs] == [this_torch, False]
    assert torch.equal(runs[0][1].routing, runs[1][1].routing)
    assert torch.equal(runs[0][1].logits, runs[1][1].logits)
