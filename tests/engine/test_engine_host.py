"""The engine in the host-compute regime: a HostProfile drives selection, stop rule and AR gate, and
every method's greedy output still equals ar's."""

import pytest

from specfit.core.cost import CostModel, HostProfile
from specfit.core.instance import Instance
from specfit.core.objective import evaluate
from specfit.core.tree import DraftTree
from specfit.engine import SpecDecoder, TreeSettings, get_method
from test_engine import LAYERS, PROMPTS, FixedPredictor, SelfDrafter, ckpt, load  # noqa: F401 (fixture)

GPU = CostModel(6.0, 0.1, 0.0, reference_layers=48, draft_level_ms=0.5, host_level_ms=0.6)
#: cheap host experts and rows, so that the cost-aware methods verify real trees
HOST = HostProfile("test-host", GPU, 80.0, 0.01, 0.002, 0.01).for_layers(LAYERS)


def host_decoder(ckpt, method, drafter, offload="host", **kw):
    m = get_method(method)
    target = _host_target(ckpt, offload)
    ref = load(ckpt, slots="all") if m.needs_reference else None
    return SpecDecoder(target, drafter, m, cost=HOST, predictor=FixedPredictor(), reference=ref, **kw)


def _host_target(ckpt, offload="host"):
    from specfit.models.qwen3_moe import OffloadedQwen3Moe

    return OffloadedQwen3Moe.from_pretrained(ckpt, cache_slots=4, max_len=512, offload=offload,
                                             offload_cost=AUTO if offload == "auto" else None)


#: for the auto mode: host experts slow enough that copying some pays
AUTO = HostProfile("test-auto", CostModel(6.0, 0.1, 0.05, reference_layers=48), 80.0, 0.2, 0.01, 0.01)


@pytest.mark.parametrize("offload", ["host", "auto"])
@pytest.mark.parametrize("method", ["eagle3", "eagle3-scan", "specfit", "oracle"])
def test_host_regime_methods_equal_ar(ckpt, method, offload):
    ar = host_decoder(ckpt, "ar", None, offload)
    dec = host_decoder(ckpt, method, SelfDrafter(ckpt), offload, tree=TreeSettings(total_tokens=8, depth=3, top_k=3))
    drafted = copied = 0
    for prompt in PROMPTS:
        gen = dec.generate(prompt, 12)
        assert gen.output_ids == ar.generate(prompt, 12).output_ids
        for c in gen.cycles:
            assert c.host and len(c.host["computed"]) == LAYERS  # the runtime computed on the host
            drafted += c.nodes_verified > 1
            copied += sum(c.transferred)
    assert drafted > 0  # cheap host experts: the cost-aware methods do verify trees
    assert (copied > 0) == (offload == "auto")  # only the auto mode copies (and here it does)


def test_auto_mode_prices_the_counterfactual_ar_step_with_the_split(ckpt):
    import numpy as np

    auto = host_decoder(ckpt, "specfit", SelfDrafter(ckpt), "auto")
    host = host_decoder(ckpt, "specfit", SelfDrafter(ckpt), "host")
    for u in ([0] * LAYERS, [1, 2, 3, 4][:LAYERS] + [0] * (LAYERS - 4), [8] * LAYERS):
        u = np.array(u)
        assert host._ar_step_ms(u) == pytest.approx(HOST.cycle_ms(1, u))
        assert auto._ar_step_ms(u) == pytest.approx(HOST.split_cycle_ms(1, [[1] * int(x) for x in u]))
        assert auto._ar_step_ms(u) <= host._ar_step_ms(u) + 1e-12


def test_host_selection_prices_the_whole_cycle_with_the_host_objective(ckpt):
    dec = host_decoder(ckpt, "specfit", SelfDrafter(ckpt), tree=TreeSettings(8, 3, 3))
    gen = dec.generate(PROMPTS[1], 12)
    for c in gen.cycles:
        if c.decision == "draft" and c.levels:
            # T of the verified subtree on the host profile plus the levels paid (extra_ms, outside the max):
            # each a head forward and the host ms measured per level (>= 0), and the cycle's measured host ms
            assert c.predicted_ms >= HOST.gpu_ms(c.nodes_verified) + c.levels * HOST.draft_level_ms - 1e-9
    assert dec.online.host_ms[3] > 0 and dec.online.host_level_ms(1e9) < 1e9  # the drafted cycles were measured
    # the sunk level time is added outside the per-layer max, as the selection's instance sees it
    tree = DraftTree([-1, 0], path_prob=[1.0, 0.5], experts=[[[0]] * LAYERS] * 2, num_experts=16)
    inst = Instance(tree, HOST.plus_ms(2.2))
    assert evaluate(inst, [0, 1]).predicted_ms == pytest.approx(HOST.cycle_ms(2, [1] * LAYERS, [2] * LAYERS) + 2.2)
