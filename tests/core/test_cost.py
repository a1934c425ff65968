"""Cost model: T(S), hardware profiles, NNLS calibration."""

import numpy as np
import pytest

from specfit.core.cost import PROFILES, QWEN3_30B_A3B_EXPERT_BYTES, CostModel, calibrate, get_profile
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance
from specfit.core.objective import evaluate
from specfit.core.tree import DraftTree


def test_expert_bytes_match_qwen3_30b_a3b_dimensions():
    hidden, moe_intermediate = 2048, 768
    assert QWEN3_30B_A3B_EXPERT_BYTES == 3 * hidden * moe_intermediate * 2  # gate, up, down in bf16


def test_profiles_h2d_ms_per_expert_from_bandwidth():
    # 9,437,184 bytes at 24 GB/s and 50 GB/s (SPECFIT.md §5)
    assert get_profile("qwen3-30b-a3b-pcie4").per_expert_ms == pytest.approx(0.3932, abs=1e-4)
    assert get_profile("qwen3-30b-a3b-h200").per_expert_ms == pytest.approx(0.1887, abs=1e-4)
    assert set(PROFILES) >= {"qwen3-30b-a3b-pcie4", "qwen3-30b-a3b-h200"}
    with pytest.raises(SpecFitInputError, match="profile"):
        get_profile("tpu")


def test_predicted_ms_counts_union_of_experts_minus_cache_once_per_layer():
    # root needs {1,2} / {3}; node 1 needs {2,4} / {3}; node 2 needs {5,6} / {0}; cache holds expert 4 of layer 0
    exp = [[[1, 2], [3, 3]], [[2, 4], [3, 3]], [[5, 6], [0, 0]]]
    cache = np.zeros((2, 8), dtype=bool)
    cache[0, 4] = True
    inst = Instance(DraftTree([-1, 0, 0], path_prob=[1, 0.5, 0.25], experts=exp, num_experts=8),
                    CostModel(10.0, 1.0, [0.5, 2.0]), cache)
    ev = evaluate(inst, [0, 1])
    assert ev.new_experts.tolist() == [2, 1]       # layer 0: {1,2,4}-{4}; layer 1: {3}
    assert ev.predicted_ms == pytest.approx(10.0 + 2 * 1.0 + 2 * 0.5 + 1 * 2.0)
    assert ev.expected_tokens == pytest.approx(1.5)
    ev = evaluate(inst, [0, 1, 2])
    assert ev.new_experts.tolist() == [4, 2]
    assert ev.throughput == pytest.approx(1000 * 1.75 / (10 + 3 + 4 * 0.5 + 2 * 2.0))


def test_calibration_recovers_constants_from_noisy_cycles():
    rng = np.random.default_rng(0)
    r, layers = 200, 4
    nodes = rng.integers(1, 64, size=r)
    misses = rng.integers(0, 40, size=(r, layers))
    true = CostModel(7.0, 0.2, 0.39)
    ms = np.array([true.cycle_ms(n, m) for n, m in zip(nodes, misses)]) + rng.normal(0, 0.05, size=r)
    cal = calibrate(nodes, misses, ms)
    assert cal.cost.fixed_ms == pytest.approx(7.0, abs=0.1)
    assert cal.cost.per_node_ms == pytest.approx(0.2, abs=0.01)
    assert cal.cost.per_expert_ms == pytest.approx(0.39, abs=0.01)
    assert cal.rmse_ms < 0.1 and cal.num_records == r
    per_layer = calibrate(nodes, misses, ms, per_layer=True)
    assert len(per_layer.cost.per_expert_ms) == layers


def test_calibration_is_non_negative_and_checks_shapes():
    nodes = [1, 2, 3, 4]
    misses = [[0], [0], [0], [0]]
    cal = calibrate(nodes, misses, [5.0, 4.0, 3.0, 2.0])  # time falling with nodes: slope clipped at 0
    assert cal.cost.per_node_ms == 0.0
    with pytest.raises(SpecFitInputError, match="misses_per_layer"):
        calibrate(nodes, [[0]], [1.0] * 4)
    with pytest.raises(SpecFitInputError, match="cycle records"):
        calibrate([1], [[0]], [1.0])


def test_calibration_keeps_a_cycle_positive_when_transfers_explain_all_time():
    # Noise on a loaded machine can leave NNLS with fixed_ms = per_node_ms = 0 (here the unconstrained
    # intercept is negative and the node slope too); the fitted model must still be a valid CostModel
    # (every cycle takes time), with fixed_ms the smallest part of a cycle transfers do not explain.
    nodes = [5, 4, 3, 2, 1]
    misses = [[2], [6], [10], [4], [8]]
    ms = [0.34 * m[0] - 0.1 for m in misses]
    cal = calibrate(nodes, misses, ms)
    assert cal.cost.fixed_ms > 0 and cal.cost.per_node_ms == 0.0
    residual = [y - cal.cost.per_expert_ms * m[0] for y, m in zip(ms, misses)]
    assert cal.cost.fixed_ms == max(min(residual), 1e-6)


def test_calibrate_when_the_misses_explain_every_millisecond():
    from specfit.core.cost import calibrate

    fit = calibrate([1, 1, 1, 1], [[1], [2], [3], [4]], [1.0, 2.0, 3.0, 4.0])  # NNLS: fixed = per_node = 0
    assert fit.cost.per_expert_ms == pytest.approx(1.0) and 0 < fit.cost.fixed_ms <= 1e-6


def test_plus_ms_adds_to_fixed_ms_only_and_refuses_bad_ms():
    from dataclasses import replace
    for cost in (get_profile("qwen3-30b-a3b-h200").for_layers(6), CostModel(1.0, 0.1, (0.2, 0.3))):
        plus = cost.plus_ms(0.75)
        assert plus == replace(cost, fixed_ms=cost.fixed_ms + 0.75) and type(plus) is type(cost)
        assert (plus.name, plus.draft_level_ms, plus.host_level_ms) == (cost.name, cost.draft_level_ms, cost.host_level_ms)
        assert plus.cycle_ms(3, [1, 2]) == pytest.approx(cost.cycle_ms(3, [1, 2]) + 0.75)
        assert cost.fixed_ms != plus.fixed_ms  # the original is untouched
        for bad in (-1.0, float("nan"), float("inf"), "x"):
            with pytest.raises(SpecFitInputError, match="ms"):
                cost.plus_ms(bad)



def test_host_profile_plus_ms_refuses_bad_ms_as_the_cost_model_does():
    from specfit.core.cost import HOST_PROFILES
    for host in HOST_PROFILES.values():
        assert host.plus_ms(0.5).extra_ms == pytest.approx(host.extra_ms + 0.5)
        assert host.plus_ms(0.5).plus_ms(0.25).extra_ms == pytest.approx(host.extra_ms + 0.75)
        for bad in (-1.0, float("nan"), "x"):
            with pytest.raises(SpecFitInputError, match="^ms"):
                host.plus_ms(bad)


def test_per_expert_array_is_kept_read_only_and_rechecked_per_layer_count():
    per_layer = CostModel(1.0, 0.1, (0.5, 0.25, 0.125))
    w = per_layer.per_expert_array(3)
    assert w.tolist() == [0.5, 0.25, 0.125] and per_layer.per_expert_array(3) is w
    with pytest.raises(ValueError):
        w[0] = 9.0  # shared by every later call: read-only
    with pytest.raises(SpecFitInputError, match="per_expert_ms"):
        per_layer.per_expert_array(4)  # another layer count is checked again, not served from the kept one
    flat = CostModel(1.0, 0.1, 0.5)
    assert flat.per_expert_array(2).tolist() == [0.5, 0.5] and flat.per_expert_array(4).tolist() == [0.5] * 4
    assert flat.plus_ms(1.0).cycle_ms(1, [1, 1, 1, 1]) == 1.0 + 1.0 + 0.1 + 2.0  # a copy prices the same
    assert flat == CostModel(1.0, 0.1, 0.5)  # equality and hashing ignore what is kept
    assert hash(flat) == hash(CostModel(1.0, 0.1, 0.5))
