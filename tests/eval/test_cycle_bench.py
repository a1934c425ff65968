"""The engine host-cost benchmark (specfit.eval.cycle_bench) drives SpecDecoder._draft_and_select
directly, outside a decode cycle: it must keep working when the engine's per-cycle state changes."""

from specfit.eval.cycle_bench import bench


def test_cycle_bench_times_the_engines_selection_outside_a_cycle():
    out = bench([8, 16], count=2, method="specfit", repeat=1)
    assert set(out) == {8, 16}
    for row in out.values():
        assert row["instances"] == 2 and row["median_ms"] > 0 and len(row["selections_sha256"]) == 16
    again = bench([8, 16], count=2, method="specfit", repeat=1)
    assert {n: r["selections_sha256"] for n, r in again.items()} == {n: r["selections_sha256"] for n, r in out.items()}


def test_cycle_bench_with_eviction_selects_the_same_nodes():
    """--evict-mb changes the caches the host work runs on, not what it selects."""
    warm = bench([8], count=2, method="specfit", repeat=1)
    cold = bench([8], count=2, method="specfit", repeat=1, evict_mb=1.0)
    assert cold[8]["selections_sha256"] == warm[8]["selections_sha256"]
    assert cold[8]["median_ms"] > 0
