"""The auto offload mode's per-layer choice (HostProfile.split): copy H2D or compute on the host,
checked against brute force over every subset; its pricing reduces to both regimes."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.cost import CostModel, HostProfile, get_host_profile
from specfit.core.errors import SpecFitInputError


def profile(fixed=4.8, per_node=0.1, copy=0.4, pe=0.1, pr=0.04, sync=0.03) -> HostProfile:
    return HostProfile("t", CostModel(fixed, per_node, copy, reference_layers=48), 80.0, pe, pr, sync)


def brute_force(p: HostProfile, n: int, rows: list[int], max_copy: int) -> float:
    """min over every set C of copied experts, |C| <= max_copy, of the layer's time (HostProfile docstring)."""
    g = p.gpu_ms(n) / p.reference_layers
    best = float("inf")
    for k in range(min(max_copy, len(rows)) + 1):
        for copied in combinations(range(len(rows)), k):
            left = [r for i, r in enumerate(rows) if i not in copied]
            h = p.host_per_expert_ms * len(left) + p.host_per_row_ms * sum(left)
            best = min(best, max(g + p.copy_ms * k, h) + (p.sync_ms if left else 0.0))
    return best


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.integers(1, 9), max_size=7), max_copy=st.integers(0, 8), n=st.integers(1, 40),
       copy=st.floats(0.01, 1.0), pe=st.floats(0.0, 0.5), pr=st.floats(0.0, 0.2), sync=st.floats(0.0, 0.1))
def test_split_is_the_exact_minimum_over_every_copied_set(rows, max_copy, n, copy, pe, pr, sync):
    p = profile(copy=copy, pe=pe, pr=pr, sync=sync)
    rows = sorted(rows, reverse=True)
    k, ms = p.split(n, rows, max_copy)
    assert 0 <= k <= min(max_copy, len(rows))
    assert ms == pytest.approx(brute_force(p, n, rows, max_copy), rel=1e-9, abs=1e-12)
    # the time returned is that of copying the k experts with the most rows
    left = rows[k:]
    g = p.gpu_ms(n) / 48
    h = pe * len(left) + pr * sum(left)
    assert ms == pytest.approx(max(g + copy * k, h) + (sync if left else 0.0), rel=1e-9, abs=1e-12)


def test_copying_pays_only_when_the_host_part_binds():
    p = get_host_profile("qwen3-30b-a3b-pcie4+host-ddr5-5600-2ch")   # copy 0.39 ms, host 0.105 + 0.039/row
    assert p.split(1, [1, 1, 1], 8)[0] == 0          # AR, 3 host experts: 0.43 ms < GPU part + one copy
    assert p.split(1, [1] * 6, 8)[0] == 1            # 6 of them: copying one shortens the layer
    assert p.split(1, [1] * 6, 0)[0] == 0            # no free slot: nothing is copied
    assert p.split(32, [16, 1, 1], 8)[0] == 1        # an expert most tree nodes need is copied first
    assert p.split(1, [], 8) == (0, pytest.approx(p.gpu_ms(1) / 48))


def test_auto_pricing_reduces_to_both_regimes():
    p = profile().for_layers(3)
    u, r, c = [2, 0, 5], [3, 0, 9], [1, 2, 0]
    assert p.cycle_ms(4, u, r, [0, 0, 0]) == pytest.approx(p.cycle_ms(4, u, r))         # nothing copied: host
    gpu = CostModel(4.8, 0.1, 0.4, reference_layers=48).for_layers(3)
    assert p.cycle_ms(4, [0] * 3, [0] * 3, c) == pytest.approx(gpu.cycle_ms(4, c))      # nothing on the host: transfer
    # per layer: max(g + copies, host) + sync where the host computes
    g = p.gpu_ms(4) / 48
    want = 16 * (max(g + 0.4, 0.2 + 0.12) + 0.03 + g + 0.8 + max(g, 0.5 + 0.36) + 0.03)
    assert p.cycle_ms(4, u, r, c) == pytest.approx(want)
    with pytest.raises(SpecFitInputError, match="copied_per_layer"):
        p.cycle_ms(1, u, r, [1, 2])


def test_split_cycle_ms_is_never_above_the_host_regime():
    p = get_host_profile("qwen3-30b-a3b-pcie4+host-ddr5-5600-2ch").for_layers(4)
    for u in ([0, 0, 0, 0], [1, 2, 3, 4], [8, 8, 8, 8]):
        auto = p.split_cycle_ms(1, [[1] * x for x in u])
        assert auto <= p.cycle_ms(1, u) + 1e-12
    assert p.split_cycle_ms(1, [[1] * 8] * 4) < p.cycle_ms(1, [8] * 4)                 # 8 misses: copying pays
    # every expert resident: the GPU forward and the reads of the token's 8 experts in each of 48 real layers
    assert p.split_cycle_ms(1, [[]] * 4) == pytest.approx(p.gpu_ms(1) + 48 * 8 * p.read_ms)
