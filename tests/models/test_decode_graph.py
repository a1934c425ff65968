"""The static AR step (``decode_graph``): the same greedy tokens, routing and expert-cache counts as the eager
step, no host sync, one graph for dynamo (what a CUDA graph capture needs), used only where it applies. On a
CUDA device (``pytest --device cuda``) the captured graph's replays are checked the same way."""

from __future__ import annotations

import pytest
import torch

from specfit.core.errors import SpecFitInputError
from specfit.models.devices import HostSyncGuard
from specfit.models.proxy import paths
from specfit.models.qwen3_moe import OffloadedQwen3Moe, greedy_generate
from specfit.models.qwen3_moe.decode_graph import DecodeGraph

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = torch.arange(20) * 7 % 4096


def proxy(device, mode, slots="all", dtype=torch.float32) -> OffloadedQwen3Moe:
    model = OffloadedQwen3Moe.from_pretrained(paths()["target"], device=device, dtype=dtype, cache_slots=slots,
                                              max_len=160)
    model.decode_graph = mode
    return model


def greedy_side_by_side(a: OffloadedQwen3Moe, b: OffloadedQwen3Moe, steps: int) -> float:
    """Decode both greedily from PROMPT; every step's token and routing must agree. Returns max |logit diff|."""
    ta = tb = int(a.prefill(PROMPT).logits[-1].argmax())
    b.prefill(PROMPT)
    worst = 0.0
    for step in range(steps):
        ra, rb = a.decode(ta), b.decode(tb)
        assert torch.equal(ra.routing, rb.routing), step
        assert ra.aux_hidden.shape == rb.aux_hidden.shape and ra.last_hidden.shape == rb.last_hidden.shape
        worst = max(worst, (ra.logits - rb.logits).abs().max().item())
        ta, tb = int(ra.logits.argmax()), int(rb.logits.argmax())
        assert ta == tb, step
    return worst


def test_static_step_equals_eager_step(device):
    eager, static = proxy(device, "off"), proxy(device, "static")
    assert greedy_side_by_side(eager, static, 32) < 1e-4
    assert static._decode_graph is not None and eager._decode_graph is None  # the static step did run
    assert eager.cache.stats()["total"] == static.cache.stats()["total"]
    assert eager.cache.recency()[0].tolist() == static.cache.recency()[0].tolist()
    # the KV rows it wrote are the eager step's: a tree verified after them sees the same prefix
    tokens, parents = torch.tensor([3, 9, 11, 40, 7]), [-1, 0, 0, 1, 3]
    va, vb = eager.verify(tokens, parents), static.verify(tokens, parents)
    assert torch.equal(va.routing, vb.routing) and torch.allclose(va.logits, vb.logits, atol=1e-4)


def test_static_step_up_to_the_last_kv_row_and_after_a_reset():
    """Positions from 0 (after a reset, no prefill) to max_len - 1: the static step attends to exactly the rows
    the eager step does; past max_len both refuse."""
    eager, static = proxy("cpu", "off"), proxy("cpu", "static")
    for m in (eager, static):
        m.prefill(PROMPT)
        m.reset()
    ta = tb = 7
    for step in range(eager.max_len):
        ra, rb = eager.decode(ta), static.decode(tb)
        assert torch.equal(ra.routing, rb.routing) and torch.allclose(ra.logits, rb.logits, atol=1e-4), step
        ta, tb = int(ra.logits.argmax()), int(rb.logits.argmax())
        assert ta == tb, step
    assert static.kv_len == static.max_len
    with pytest.raises(SpecFitInputError, match="max_len"):
        static.decode(tb)


def test_one_node_verify_and_greedy_generate_take_the_static_step(device):
    eager, static = proxy(device, "off"), proxy(device, "static")
    ids_a = greedy_generate(eager, PROMPT, 24)
    ids_b = greedy_generate(static, PROMPT, 24)
    assert torch.equal(torch.as_tensor(ids_a), torch.as_tensor(ids_b))
    for m in (eager, static):
        m.reset()
        m.prefill(PROMPT)
    ra, rb = eager.verify([5], [-1]), static.verify([5], [-1])  # an AR step through the verify interface
    assert torch.allclose(ra.logits, rb.logits, atol=1e-4) and torch.equal(ra.routing, rb.routing)
    for m in (eager, static):
        m.commit([0])
    assert eager.kv_len == static.kv_len == len(PROMPT) + 1


def test_a_bfloat16_one_node_verify_takes_the_static_step():
    """In bfloat16 a one-node verify runs the masked tree forward eagerly, except where the static step applies
    (the public API's AR step is such a verify)."""
    eager, static = proxy("cpu", "off", dtype=torch.bfloat16), proxy("cpu", "static", dtype=torch.bfloat16)
    for m in (eager, static):
        m.prefill(PROMPT)
    ra, rb = eager.verify([5], [-1]), static.verify([5], [-1])
    assert static._decode_graph is not None
    assert torch.equal(ra.routing, rb.routing) and int(ra.logits.argmax()) == int(rb.logits.argmax())
    for m in (eager, static):
        m.commit([0])
        assert m.kv_len == len(PROMPT) + 1


def test_compiled_step_equals_eager_step():
    """``"compiled"``: inductor's kernels (seconds to compile on a CPU), the same greedy tokens and routing."""
    eager, compiled = proxy("cpu", "off"), proxy("cpu", "compiled")
    assert greedy_side_by_side(eager, compiled, 12) < 1e-4
    assert eager.cache.stats()["total"] == compiled.cache.stats()["total"]


def test_static_step_never_syncs(device):
    model = proxy(device, "static")
    model.prefill(PROMPT)
    model.decode(5)                                      # warm-up: lazily built buffers
    with HostSyncGuard(device):
        model.decode(6)


@pytest.mark.parametrize("dtype,grouped", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_static_forward_is_one_graph_for_dynamo(dtype, grouped):
    """``fullgraph=True`` fails on any graph break; the eager backend traces without compiling kernels. (torch's
    meta kernel of ``grouped_mm`` takes bfloat16 only, the dtype its CUDA kernel runs.)"""
    model = proxy("cpu", "off", dtype=dtype)
    model.prefill(PROMPT)
    graph = DecodeGraph(model, capture=False, grouped=grouped)
    traced = torch.compile(graph.forward, backend="eager", fullgraph=True, dynamic=False)
    for position, token in ((20, 5), (21, 9)):          # a second position reuses the graph (no shape change)
        graph._ids.fill_(token)
        graph._pos.fill_(position)
        ref, out = graph.forward(), traced()
        assert all(torch.equal(r, o) for r, o in zip(ref, out))


@pytest.mark.parametrize("case", ["partial cache", "profile", "per-expert"])
def test_eager_step_where_the_static_step_does_not_apply(case, device):
    """A cache that is not full, per-expert timing or the per-expert path: the eager step, bitwise."""
    slots = 5 if case == "partial cache" else "all"
    eager, static = proxy(device, "off", slots), proxy(device, "static", slots)
    if case == "profile":
        eager.profile = static.profile = True
    if case == "per-expert":
        eager.grouped_experts = static.grouped_experts = False
    for m in (eager, static):
        m.prefill(PROMPT)
    assert torch.equal(eager.decode(5).logits, static.decode(5).logits)
    assert static._decode_graph is None


def test_a_new_cache_gets_a_new_graph():
    model = proxy("cpu", "static")
    model.prefill(PROMPT)
    model.decode(5)
    first = model._decode_graph
    model.reset_cache(5)                                # not full: eager
    model.decode(6)
    model.reset_cache("all")
    model.decode(7)
    assert model._decode_graph is not first and model._decode_graph.cache is model.cache


def test_the_default_mode_is_the_cuda_graph_on_cuda_and_off_elsewhere(device):
    model = OffloadedQwen3Moe.from_pretrained(paths()["target"], device=device, dtype=torch.float32, max_len=8)
    assert model.decode_graph == ("cuda-graph" if device.startswith("cuda") else "off")


def test_bad_mode_is_refused_naming_the_field():
    model = proxy("cpu", "off")
    with pytest.raises(SpecFitInputError, match="decode_graph.*one of off, static, compiled, cuda-graph, compiled-"):
        model.decode_graph = "graphs"
    for mode in ("cuda-graph", "compiled-cuda-graph"):
        with pytest.raises(SpecFitInputError, match="decode_graph.*needs a CUDA device"):
            model.decode_graph = mode
    assert model.decode_graph == "off"


@pytest.mark.parametrize("mode", ["cuda-graph", "compiled-cuda-graph"])
def test_cuda_graph_replays_equal_the_eager_step(device, mode):
    if not device.startswith("cuda"):
        pytest.skip("CUDA graphs need a CUDA device (pytest --device cuda)")
    eager, graphed = proxy(device, "off"), proxy(device, mode)
    assert greedy_side_by_side(eager, graphed, 32) < 1e-3
    assert graphed._decode_graph._graph is not None  # captured once, replayed since
    assert eager.cache.stats()["total"]["hits"] == graphed.cache.stats()["total"]["hits"]
