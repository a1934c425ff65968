"""eval/measured_profile.py: a profile fitted from runtime benchmarks at two layer counts, extrapolated."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specfit.core.cost import get_profile
from specfit.core.errors import SpecFitInputError
from specfit.eval.measured_profile import TERMS, fit_profile, main

TRUTH = dict(a=4.0, b=1.5, c=0.2, p=0.05, q=0.19)  # ms: see the module docstring's model


def bench(layers: int, moved: dict[int, float]) -> dict:
    """A runtime_bench result whose medians follow TRUTH exactly (``moved``: experts per mode's nodes)."""
    t = TRUTH
    modes = {}
    for n, m in moved.items():
        total = t["a"] + t["b"] * layers + t["c"] * n + t["p"] * layers * n + t["q"] * m
        modes["ar_decode" if n == 1 else f"verify_{n}"] = {"total_ms": total, "experts_moved": m}
    return {"layers": layers, "modes": modes}


def grid() -> list[dict]:
    resident = {1: 0, 8: 0, 16: 0, 32: 0, 64: 0}
    return [bench(L, resident) for L in (2, 4)] + [bench(L, {1: 8 * L, 8: 46 * L, 16: 68 * L, 32: 91 * L, 64: 108 * L})
                                                   for L in (2, 4)]


def test_fit_recovers_the_model_and_extrapolates():
    cost, fit = fit_profile(grid(), name="measured", like=get_profile("qwen3-30b-a3b-h200"))
    for term, key in zip(TERMS, "abcpq"):
        assert fit[term] == pytest.approx(TRUTH[key], abs=1e-6)
    assert fit["rel_residual"] < 1e-9 and fit["records"] == 20 and fit["layer_counts"] == [2, 4]
    assert cost.fixed_ms == pytest.approx(4.0 + 1.5 * 48) and cost.per_node_ms == pytest.approx(0.2 + 0.05 * 48)
    assert cost.per_expert_ms == pytest.approx(0.19) and cost.reference_layers == 48
    h200 = get_profile("qwen3-30b-a3b-h200")
    assert (cost.draft_level_ms, cost.host_level_ms, cost.num_experts) == (h200.draft_level_ms, h200.host_level_ms, 128)


def test_a_cost_not_of_the_model_shows_in_the_residual():
    """A resident expert that costs as much as a copy (one eager call each): the fit says it does not fit."""
    results = grid()
    for res in results[:2]:  # resident runs: add 0.17 ms per distinct expert the verify ran
        for mode, m in res["modes"].items():
            m["total_ms"] += 0.17 * min(128, 8 * (1 if mode == "ar_decode" else int(mode[7:]))) * res["layers"]
    _, fit = fit_profile(results, name="measured")
    assert fit["rel_residual"] > 0.05


def test_one_layer_count_is_refused():
    with pytest.raises(SpecFitInputError, match="bench.layers"):
        fit_profile(grid()[::2], name="x")
    with pytest.raises(SpecFitInputError, match="bench.modes"):
        fit_profile([{"layers": 2, "modes": {"prefill": {"total_ms": 1, "experts_moved": 0}}}, grid()[1]], name="x")


def test_cli_on_two_measured_layer_counts(tmp_path, capsys):
    """runtime_bench at 2 and 4 layers of the tiny shape (one with --per-expert), then the fit's CLI."""
    paths = []
    for layers, extra in ((2, []), (4, ["--per-expert"])):
        out = tmp_path / f"b{layers}.json"
        proc = subprocess.run([sys.executable, "-m", "specfit.eval.runtime_bench", "--synthetic", "tiny", "--layers",
                               str(layers), "--repeats", "2", "--json", str(out), *extra],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        res = json.loads(out.read_text())
        assert res["layers"] == layers and res["grouped_experts"] is (not extra)
        paths.append(str(out))
    assert main(paths + ["--name", "tiny-measured", "--like", "qwen3-30b-a3b-pcie4", "--json", str(tmp_path / "p.json")]) == 0
    got = json.loads((tmp_path / "p.json").read_text())
    assert got["profile"]["name"] == "tiny-measured" and got["profile"]["draft_level_ms"] == 0.5
    assert got["fit"]["layer_counts"] == [2, 4] and got["profile"]["fixed_ms"] > 0
    assert main(paths[:1] + ["--name", "x"]) == 2 and "bench.layers" in capsys.readouterr().err
