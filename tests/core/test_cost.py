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


def test_resident_experts_cost_their_read_and_missing_ones_copy_plus_read():
    # the instance of the union test, with read_ms: every routed expert of S is read once per layer
    exp = [[[1, 2], [3, 3]], [[2, 4], [3, 3]], [[5, 6], [0, 0]]]
    cache = np.zeros((2, 8), dtype=bool)
    cache[0, 4] = True
    inst = Instance(DraftTree([-1, 0, 0], path_prob=[1, 0.5, 0.25], experts=exp, num_experts=8),
                    CostModel(10.0, 1.0, [0.5, 2.0], read_ms=0.25), cache)
    ev = evaluate(inst, [0, 1])
    # U_0 = {1, 2, 4} (4 resident: read only), U_1 = {3}: copies 2 + 1, reads 3 + 1
    assert ev.new_experts.tolist() == [2, 1]
    assert ev.predicted_ms == 10.0 + 2 * 1.0 + (2 * 0.5 + 1 * 2.0) + (3 * 0.25 + 1 * 0.25)
    assert inst.read_per_layer([0, 1]).tolist() == [3, 1]
    # every expert resident: no copy, but the reads remain and grow with the union
    full = Instance(inst.tree, inst.cost, np.ones((2, 8), dtype=bool))
    assert evaluate(full, [0]).predicted_ms == 10.0 + 1.0 + 3 * 0.25
    assert evaluate(full, [0, 1, 2]).predicted_ms == 10.0 + 3.0 + (5 + 2) * 0.25


def test_read_term_prices_a_wide_tree_at_qwen3_shape_above_the_root():
    # a full EAGLE tree: 33 nodes over 48 layers x 128 experts, top-8, every expert resident (h200)
    rng = np.random.default_rng(0)
    n, L, E, k = 33, 48, 128, 8
    experts = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for _ in range(n)])
    tree = DraftTree([-1] + [0] * (n - 1), path_prob=[1.0] + [0.5] * (n - 1), experts=experts, num_experts=E)
    prof = get_profile("qwen3-30b-a3b-h200")
    inst = Instance(tree, prof, np.ones((L, E), dtype=bool))
    root, full = evaluate(inst, [0]).predicted_ms, evaluate(inst, range(n)).predicted_ms
    assert root == pytest.approx(3.0 + 0.03 + L * k * prof.read_ms)  # 384 reads at 4.8 TB/s: 0.75 ms
    reads = int(inst.read_per_layer(range(n)).sum())
    assert reads > 100 * L  # ~110 distinct experts per layer
    assert full == pytest.approx(3.0 + 0.03 * n + reads * prof.read_ms)
    assert full - root > 9.0  # ~50 GB of bf16 weights at 4.8 TB/s


def test_profiles_state_bandwidths_and_derive_the_expert_terms():
    for name, mem, link in (("qwen3-30b-a3b-pcie4", 1008.0, 24.0), ("qwen3-30b-a3b-h200", 4800.0, 50.0)):
        p = get_profile(name)
        assert (p.expert_bytes, p.memory_gb_per_s, p.link_gb_per_s) == (QWEN3_30B_A3B_EXPERT_BYTES, mem, link)
        assert p.read_ms == pytest.approx(QWEN3_30B_A3B_EXPERT_BYTES / (mem * 1e9) * 1e3, abs=1e-6)
        assert p.per_expert_ms == pytest.approx(QWEN3_30B_A3B_EXPERT_BYTES / (link * 1e9) * 1e3, abs=1e-4)


@pytest.mark.parametrize("field", ["memory_gb_per_s", "link_gb_per_s"])
@pytest.mark.parametrize("bad", [None, -1.0, 0.0, float("nan"), float("inf"), "fast", True])
def test_bad_or_missing_bandwidth_is_one_error_naming_the_field(field, bad):
    kw = dict(expert_bytes=QWEN3_30B_A3B_EXPERT_BYTES, memory_gb_per_s=1000.0, link_gb_per_s=25.0)
    kw[field] = bad
    with pytest.raises(SpecFitInputError) as err:
        CostModel.from_bandwidths(3.0, 0.1, **kw)
    assert err.value.field == f"cost.{field}"


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "x"])
def test_bad_read_ms_or_expert_bytes_is_one_error_naming_the_field(bad):
    with pytest.raises(SpecFitInputError) as err:
        CostModel(3.0, 0.1, 0.2, read_ms=bad)
    assert err.value.field == "cost.read_ms"
    with pytest.raises(SpecFitInputError) as err:
        CostModel.from_bandwidths(3.0, 0.1, expert_bytes=0, memory_gb_per_s=1.0, link_gb_per_s=1.0)
    assert err.value.field == "cost.expert_bytes"


def test_read_ms_round_trips_in_json_and_defaults_to_zero_for_old_instances():
    c = CostModel(3.0, 0.1, 0.2, read_ms=0.01)
    assert c.to_json()["read_ms"] == 0.01 and CostModel.from_json(c.to_json()) == c
    old = {"fixed_ms": 3.0, "per_node_ms": 0.1, "per_expert_ms": 0.2}
    assert CostModel.from_json(old).read_ms == 0.0 and "read_ms" not in CostModel.from_json(old).to_json()
    with pytest.raises(SpecFitInputError) as err:
        CostModel.from_json({**old, "read_ms": -1})
    assert err.value.field == "cost.read_ms"


def test_for_layers_scales_the_read_term_like_the_copy_term():
    p = get_profile("qwen3-30b-a3b-pcie4").for_layers(4)
    assert p.read_ms == pytest.approx(get_profile("qwen3-30b-a3b-pcie4").read_ms * 12)
    assert p.per_expert_ms == pytest.approx(get_profile("qwen3-30b-a3b-pcie4").per_expert_ms * 12)
    assert p.cycle_ms(1, [1, 0, 0, 0], None, [8, 8, 8, 8]) == pytest.approx(
        6.0 + 0.1 + p.per_expert_ms + 32 * p.read_ms)


def test_a_profile_file_is_a_profile_and_bad_fields_name_themselves(tmp_path):
    import json

    from specfit.core.cost import load_profile

    good = {"name": "mine", "fixed_ms": 3.0, "per_node_ms": 0.03, "expert_bytes": QWEN3_30B_A3B_EXPERT_BYTES,
            "memory_gb_per_s": 4800.0, "link_gb_per_s": 50.0, "draft_level_ms": 0.25, "reference_layers": 48,
            "about": {"source": "datasheet"}}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(good))
    p = get_profile(str(path))  # a path where a name is expected
    h200 = get_profile("qwen3-30b-a3b-h200")
    assert (p.name, p.read_ms, p.draft_level_ms, p.reference_layers) == ("mine", h200.read_ms, 0.25, 48)
    assert p.per_expert_ms == pytest.approx(h200.per_expert_ms, abs=1e-4)
    fitted = {"fixed_ms": 3.0, "per_node_ms": 0.03, "per_expert_ms": 0.2, "read_ms": 0.002}  # times in ms suffice
    path.write_text(json.dumps(fitted))
    assert (load_profile(path).per_expert_ms, load_profile(path).read_ms) == (0.2, 0.002)
    for bad, field in (({**good, "memory_gb_per_s": -1}, "profile.memory_gb_per_s"),
                       ({**good, "link_gb_per_s": float("nan")}, "profile.link_gb_per_s"),
                       ({k: v for k, v in good.items() if k != "memory_gb_per_s"}, "profile.memory_gb_per_s"),
                       ({**fitted, "read_ms": -0.1}, "profile.read_ms"),
                       ({**good, "fast": 1}, "profile.fast"),
                       ({k: v for k, v in good.items() if k != "fixed_ms"}, "profile.fixed_ms")):
        path.write_text(json.dumps(bad, allow_nan=True))
        with pytest.raises(SpecFitInputError) as err:
            load_profile(path)
        assert err.value.field == field, (bad, err.value)
    with pytest.raises(SpecFitInputError) as err:
        get_profile(str(tmp_path / "missing.json"))
    assert err.value.field == "profile"


def test_a_verify_priced_without_its_routed_counts_reads_at_least_top_k_per_layer():
    p = get_profile("qwen3-30b-a3b-h200")  # experts_per_token 8
    assert p.experts_per_token == 8
    # the AR step (one node): 8 reads per layer, exact, whether its experts are resident or copied
    assert p.cycle_ms(1, [0] * 48) == pytest.approx(3.03 + 384 * p.read_ms)
    assert p.cycle_ms(1, [3] * 48) == pytest.approx(3.03 + 144 * p.per_expert_ms + 384 * p.read_ms)
    assert p.cycle_ms(1, [0] * 48) == p.cycle_ms(1, [0] * 48, None, [8] * 48)
    # more nodes: a lower bound of what their routed counts give
    assert p.cycle_ms(5, [0] * 48) < p.cycle_ms(5, [0] * 48, None, [20] * 48)
    # without experts_per_token only the copied experts are known to be read
    c = CostModel(3.0, 0.1, 0.2, read_ms=0.01)
    assert c.cycle_ms(1, [2, 0]) == pytest.approx(3.1 + 2 * 0.21)
