"""The static AR step (``decode_graph``): the same greedy tokens, routing and expert-cache counts as the eager
step, no host sync, one graph for dynamo (what a CUDA graph capture needs), used only where it applies. On a
CUDA device (``pytest --device cuda``) the captured graph's replays are checked the same way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specfit.core.errors import SpecFitInputError
from specfit.models.devices import HostSyncGuard
from specfit.models.proxy import paths
from specfit.models.qwen3_moe import OffloadedQwen3Moe, greedy_generate
from specfit.models.qwen3_moe.decode_graph import StaticForward
from torch_features import needs_cpu_grouped_mm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = torch.arange(20) * 7 % 4096


def proxy(device, mode, slots="all", dtype=torch.float32, max_len=160) -> OffloadedQwen3Moe:
    model = OffloadedQwen3Moe.from_pretrained(paths()["target"], device=device, dtype=dtype, cache_slots=slots,
                                              max_len=max_len)
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
    assert 1 in static._static and not eager._static  # the static step did run
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


def random_tree(n: int, rng: np.random.Generator) -> tuple[torch.Tensor, list[int]]:
    return torch.as_tensor(rng.integers(0, 4096, n)), [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


@needs_cpu_grouped_mm
def test_static_verify_equals_eager_verify_and_commits_the_same_kv(device):
    """Trees of 2 to 100 nodes padded to VERIFY_SIZES: the same experts routed to, logits within rounding, the same
    expert cache counts; after committing a random root path both decode the same tokens."""
    rng = np.random.default_rng(3)
    eager, static = proxy(device, "off", max_len=256), proxy(device, "static", max_len=256)
    for m in (eager, static):
        m.prefill(PROMPT)
    tok = 5
    for n in (2, 5, 8, 13, 32, 64, 100):
        tokens, parents = random_tree(n, rng)
        va, vb = eager.verify(tokens, parents), static.verify(tokens, parents)
        # the same experts per node and layer (two of near-equal router weight may swap ranks within rounding)
        assert torch.equal(va.routing.sort(-1).values, vb.routing.sort(-1).values), n
        assert torch.allclose(va.logits, vb.logits, atol=1e-4) and va.logits.shape == vb.logits.shape == (n, 4096)
        assert torch.allclose(va.aux_hidden, vb.aux_hidden, atol=1e-4)
        path = [n - 1]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        for m in (eager, static):
            m.commit(path[::-1])
        ra, rb = eager.decode(tok), static.decode(tok)
        assert torch.equal(ra.routing, rb.routing) and int(ra.logits.argmax()) == int(rb.logits.argmax()), n
        tok = int(ra.logits.argmax())
    assert sorted(static._static) == [1, 2, 8, 16, 32, 64, 128]
    assert eager.cache.stats()["total"] == static.cache.stats()["total"]
    assert [r.tolist() for r in eager.cache.recency()] == [r.tolist() for r in static.cache.recency()]


def test_eager_verify_where_no_padded_size_applies():
    """A tree above the largest size, or too few KV rows left for its padding: the eager forward, bitwise."""
    rng = np.random.default_rng(4)
    eager, static = proxy("cpu", "off"), proxy("cpu", "static")
    for m in (eager, static):
        m.prefill(PROMPT)
    tokens, parents = random_tree(130, rng)                    # above VERIFY_SIZES
    assert torch.equal(eager.verify(tokens, parents).logits, static.verify(tokens, parents).logits)
    for m in (eager, static):
        m.kv_len = m.max_len - 20                           # 20 rows left: a 17-node tree would pad to 24
    tokens, parents = random_tree(17, rng)
    assert torch.equal(eager.verify(tokens, parents).logits, static.verify(tokens, parents).logits)
    assert not static._static


@needs_cpu_grouped_mm
def test_speculative_generation_with_static_forwards_equals_ar():
    """The public API with every forward static (AR steps and verifies): each method's greedy output equals AR's."""
    from specfit import SpecFit

    sf = SpecFit.from_pretrained(paths()["target"], paths()["eagle3"], cache_slots="all", max_len=256)
    prompt = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"
    ref = sf.generate(prompt, method="ar", max_new_tokens=24).output_ids
    sf.target.decode_graph = "static"
    for method in ("ar", "eagle3", "specfit"):
        out = sf.generate(prompt, method=method, max_new_tokens=24)
        assert out.output_ids == ref, method
    assert len(sf.target._static) > 1                       # verifies ran static too


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
    assert 1 in static._static
    assert torch.equal(ra.routing, rb.routing) and int(ra.logits.argmax()) == int(rb.logits.argmax())
    for m in (eager, static):
        m.commit([0])
        assert m.kv_len == len(PROMPT) + 1


def test_compiled_step_equals_eager_step():
    """``"compiled"``: inductor's kernels (seconds to compile on a CPU), the same greedy tokens and routing."""
    eager, compiled = proxy("cpu", "off"), proxy("cpu", "compiled")
    assert greedy_side_by_side(eager, compiled, 12) < 1e-4
    assert eager.cache.stats()["total"] == compiled.cache.stats()["total"]


@needs_cpu_grouped_mm
def test_static_step_and_verify_never_sync(device):
    """The static AR step never syncs; nor does the static verify where it runs (the CPU; on CUDA bfloat16 with the
    grouped kernel: a float32 verify there takes the host-routed rounds, whose one sync per layer is by design)."""
    model = proxy(device, "static", dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model.prefill(PROMPT)
    tokens, parents = random_tree(32, np.random.default_rng(5))
    model.decode(5)                                      # warm-up: lazily built buffers
    model.verify(tokens, parents)
    with HostSyncGuard(device):
        model.decode(6)
        if model.resident_grouped_mm:
            model.verify(tokens, parents)
    assert model.resident_grouped_mm or device.startswith("cuda")  # the CPU always checks the verify


@pytest.mark.parametrize("dtype,rows,grouped", [(torch.float32, 1, False), (torch.bfloat16, 1, False),
                                               pytest.param(torch.bfloat16, 1, True, marks=needs_cpu_grouped_mm),
                                               pytest.param(torch.bfloat16, 8, True, marks=needs_cpu_grouped_mm)])
def test_static_forward_is_one_graph_for_dynamo(dtype, rows, grouped):
    """``fullgraph=True`` fails on any graph break; the eager backend traces without compiling kernels. (torch's
    meta kernel of ``grouped_mm`` takes bfloat16 only, the dtype its CUDA kernel runs.) Rows > 1: a chain."""
    model = proxy("cpu", "off", dtype=dtype)
    model.prefill(PROMPT)
    graph = StaticForward(model, rows, capture=False, grouped=grouped)
    traced = torch.compile(graph.forward, backend="eager", fullgraph=True, dynamic=False)
    for prefix, token in ((20, 5), (21, 9)):            # another prefix reuses the graph (no shape change)
        graph._inputs[:, 0] = token
        graph._inputs[:, 1] = prefix + torch.arange(rows)
        graph._inputs[:, 2] = prefix + torch.arange(rows)
        graph._inputs[:, 3] = prefix
        graph._inputs[:, 4:] = torch.ones(rows, rows, dtype=torch.long).tril()
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
    assert not static._static


def test_a_new_cache_gets_a_new_graph():
    model = proxy("cpu", "static")
    model.prefill(PROMPT)
    model.decode(5)
    first = model._static[1]
    model.reset_cache(5)                                # not full: eager
    model.decode(6)
    model.reset_cache("all")
    model.decode(7)
    assert model._static[1] is not first and model._static[1].cache is model.cache


def test_a_new_cache_releases_the_full_caches_slots():
    """At the real shape a full cache is ~58 GB: after ``reset_cache`` nothing, the static forwards included,
    may keep it alive beside the new one."""
    import gc
    import weakref

    model = proxy("cpu", "static")
    model.prefill(PROMPT)
    model.decode(5)                                     # builds the full cache's static AR step
    full = weakref.ref(model.cache)
    model.reset_cache(5)
    gc.collect()
    assert full() is None


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
    assert graphed._static[1]._graph is not None  # captured once, replayed since
    assert eager.cache.stats()["total"]["hits"] == graphed.cache.stats()["total"]["hits"]


def test_cuda_graph_verifies_match_the_eager_verifies_in_bfloat16(device):
    """Where the grouped kernel runs (bfloat16, compute capability 9.x/10.x) verifies replay their padded sizes'
    graphs: logits within the bfloat16 tie bound of the eager verify, nearly every node's experts the same."""
    if not device.startswith("cuda"):
        pytest.skip("CUDA graphs need a CUDA device (pytest --device cuda)")
    eager = proxy(device, "off", dtype=torch.bfloat16, max_len=256)
    graphed = proxy(device, "cuda-graph", dtype=torch.bfloat16, max_len=256)
    if not graphed.resident_grouped_mm:
        pytest.skip("no sync-free grouped kernel on this GPU: verifies run eagerly")
    rng = np.random.default_rng(6)
    for m in (eager, graphed):
        m.prefill(PROMPT)
    for n in (5, 32, 64):
        tokens, parents = random_tree(n, rng)
        for _ in range(2):                                  # the capture, then a replay
            va, vb = eager.verify(tokens, parents), graphed.verify(tokens, parents)
        assert (va.logits - vb.logits).abs().max().item() < 0.25, n
        same = (va.routing.sort(-1).values == vb.routing.sort(-1).values).all(-1).float().mean().item()
        assert same > 0.95, (n, same)
    assert graphed._static[64]._graph is not None
