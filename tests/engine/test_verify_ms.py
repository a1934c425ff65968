"""The engine's one price of a verify (``specfit.engine.decoder.verify_ms``) reads every routed expert."""

import pytest

from specfit.core.cost import CostModel, HostProfile
from specfit.engine.decoder import verify_ms


def test_a_drafted_verify_with_every_expert_resident_pays_each_routed_experts_read():
    cost = CostModel(6.0, 0.1, (1.0, 2.0), read_ms=0.25, experts_per_token=8)
    # 4 nodes, nothing copied, 20 and 24 distinct experts routed in the two layers
    assert verify_ms(cost, 4, [0, 0], [20, 24]) == pytest.approx(6.0 + 0.4 + 0.25 * 44)
    # copied experts: their copy and their read; the resident rest: their read
    assert verify_ms(cost, 4, [3, 1], [20, 24]) == pytest.approx(6.0 + 0.4 + 1.0 * 3 + 2.0 * 1 + 0.25 * 44)
    # one node without routed counts: its top-k experts per layer (the AR step)
    assert verify_ms(cost, 1, [0, 0]) == pytest.approx(6.0 + 0.1 + 0.25 * 16)
    assert verify_ms(cost, 1, [0, 0]) == verify_ms(cost, 1, [0, 0], [8, 8])


def test_the_host_regime_reads_the_routed_experts_neither_computed_on_the_host_nor_copied():
    gpu = CostModel(6.0, 0.1, 1.0, read_ms=0.25, experts_per_token=8)
    prof = HostProfile(name="test", gpu=gpu, dram_gb_per_s=50.0, host_per_expert_ms=0.5, host_per_row_ms=0.01, sync_ms=0.0)
    host, rows, copied, routed = [2, 1], [3, 1], [1, 0], [20, 10]
    want = prof.cycle_ms(4, host, rows, copied, [20 - 2 - 1, 10 - 1 - 0])
    assert verify_ms(prof, 4, host, routed, rows, copied) == pytest.approx(want)
    assert want > prof.cycle_ms(4, host, rows, copied, [0, 0])
