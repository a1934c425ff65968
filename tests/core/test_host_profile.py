"""Host-regime profiles: per MoE layer max(GPU part, host part) + sync; existing profiles untouched."""

from __future__ import annotations

import pytest

from specfit.core.cost import (DRAM_GB_PER_S, HOST_PROFILES, PROFILES, QWEN3_30B_A3B_EXPERT_BYTES, CostModel,
                               HostProfile, get_host_profile)
from specfit.core.errors import SpecFitInputError

GPU = CostModel(4.8, 0.1, 0.4, reference_layers=48, draft_level_ms=0.5)


def profile(**kw) -> HostProfile:
    return HostProfile("t", GPU, 80.0, kw.get("pe", 0.1), kw.get("pr", 0.02), kw.get("sync", 0.03))


def test_nothing_on_the_host_costs_the_gpu_forward():
    p = profile()
    assert p.cycle_ms(1, [0] * 48, [0] * 48) == pytest.approx(4.9)
    assert p.for_layers(6).cycle_ms(10, [0] * 6, [0] * 6) == pytest.approx(5.8)


def test_layer_time_is_the_max_of_gpu_and_host_plus_sync():
    p = profile(pe=0.1, pr=0.02, sync=0.03)
    g = 4.9 / 48                                    # one node: the GPU part of one layer (0.102 ms)
    # layer 0: 3 host experts, 3 rows -> host 0.36 > g; layer 1: none -> g, no sync
    assert p.for_layers(2).cycle_ms(1, [3, 0], [3, 0]) == pytest.approx(24 * ((0.36 + 0.03) + g))
    # a host part below the GPU part is hidden behind it (only the sync shows)
    assert p.for_layers(1).cycle_ms(1, [1], [0]) == pytest.approx(48 * (g + 0.03))


def test_for_layers_scales_each_layer_to_the_reference():
    p = profile()
    u, r = [2, 4, 6], [2, 5, 9]
    per48 = p.cycle_ms(3, u * 16, r * 16)
    assert p.for_layers(3).cycle_ms(3, u, r) == pytest.approx(per48)
    with pytest.raises(SpecFitInputError, match="host_rows"):
        p.cycle_ms(1, [1, 2], [1])
    with pytest.raises(SpecFitInputError, match="num_layers"):
        p.for_layers(0)


def test_named_host_profiles_read_experts_at_datasheet_bandwidth():
    assert DRAM_GB_PER_S["ddr5-5600-2ch"] == 89.6
    assert DRAM_GB_PER_S["ddr4-3200-2ch"] == pytest.approx(51.2)
    for p in HOST_PROFILES.values():
        assert p.host_per_expert_ms == pytest.approx(QWEN3_30B_A3B_EXPERT_BYTES / (p.dram_gb_per_s * 1e9) * 1e3, rel=1e-3)
        assert p.gpu is PROFILES[p.gpu.name] and p.draft_level_ms == p.gpu.draft_level_ms
        assert p.to_json()["regime"] == "host"
    # the host regime's premise: reading an expert from DRAM beats copying it over PCIe 4
    ddr5 = get_host_profile("qwen3-30b-a3b-pcie4+host-ddr5-5600-2ch")
    assert ddr5.host_per_expert_ms < PROFILES["qwen3-30b-a3b-pcie4"].per_expert_ms
    with pytest.raises(SpecFitInputError, match="host_profile"):
        get_host_profile("nope")


def test_transfer_profiles_are_unchanged():
    assert set(PROFILES) == {"qwen3-30b-a3b-pcie4", "qwen3-30b-a3b-h200", "qwen3-30b-a3b-h100"}
    # the copy term as before; the read of every routed expert at the RTX 4090's 1,008 GB/s is the new term
    assert PROFILES["qwen3-30b-a3b-pcie4"].to_json() == {"fixed_ms": 6.0, "per_node_ms": 0.1, "per_expert_ms": 0.3932,
                                                         "read_ms": 0.009362}
    # the H100 SXM's: h200's link and launches, its HBM3's 3.35 TB/s (datasheet)
    assert PROFILES["qwen3-30b-a3b-h100"].to_json() == {"fixed_ms": 3.3, "per_node_ms": 0.03, "per_expert_ms": 0.1887,
                                                        "read_ms": 0.002817}


def test_node_extra_is_paid_per_draft_node_outside_the_max_and_round_trips():
    p = profile(pe=0.1, pr=0.02, sync=0.03).for_layers(2)
    q = HostProfile(p.name, p.gpu, p.dram_gb_per_s, p.host_per_expert_ms, p.host_per_row_ms, p.sync_ms, 2,
                    node_extra_ms=0.7)
    assert q.cycle_ms(1, [3, 0], [3, 0]) == pytest.approx(p.cycle_ms(1, [3, 0], [3, 0]))   # the root pays none
    assert q.cycle_ms(5, [3, 1], [6, 2]) == pytest.approx(p.cycle_ms(5, [3, 1], [6, 2]) + 4 * 0.7)
    assert q.min_node_ms == 0.7
    assert HostProfile.from_json(q.to_json()) == q
    assert q.gpu_only().cycle_ms(4, [0]) == pytest.approx(q.cycle_ms(4, [0, 0], [0, 0]))
    with pytest.raises(SpecFitInputError, match="node_extra_ms"):
        HostProfile("t", GPU, 80.0, 0.1, 0.02, 0.03, node_extra_ms=-1.0)
