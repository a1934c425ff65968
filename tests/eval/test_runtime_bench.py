"""Smoke test of eval/runtime_bench.py on a tiny synthetic checkpoint (counts, not timings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from torch_features import needs_cpu_grouped_mm


def test_runtime_bench_counts(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "specfit.eval.runtime_bench", "--synthetic", "tiny", "--repeats", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert list(res["modes"]) == ["ar_decode", "verify_8", "verify_16", "verify_32", "verify_64"]
    layers, top_k, experts = 4, 4, 16                    # the "tiny" shape
    assert res["modes"]["ar_decode"]["experts_moved"] == layers * top_k   # cache_slots=0: all transferred
    for n in (8, 16, 32, 64):
        m = res["modes"][f"verify_{n}"]
        assert layers * top_k < m["experts_moved"] <= layers * experts
        assert m["repeats"] == 2 and m["total_ms"] > 0
    assert res["expert_bytes"] == 3 * 64 * 32 * 4
    assert set(res["calibration"]["cost"]) == {"fixed_ms", "per_node_ms", "per_expert_ms"}
    assert "| verify_64 |" in proc.stdout


@needs_cpu_grouped_mm
def test_runtime_bench_times_the_static_ar_step(tmp_path):
    """Every expert resident and ``--decode-graph static``: the AR step as the static forward is a mode of its own."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "specfit.eval.runtime_bench", "--synthetic", "tiny", "--repeats", "2",
                           "--in-memory", "--cache-slots", "all", "--decode-graph", "static", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    modes = json.loads(out.read_text())["modes"]
    assert list(modes)[:4] == ["ar_decode", "ar_decode_static", "verify_8", "verify_8_static"]
    assert modes["verify_64_static"]["experts_moved"] == 0
    assert modes["ar_decode_static"]["experts_moved"] == 0 and modes["ar_decode_static"]["repeats"] == 2
    assert "| ar_decode_static |" in proc.stdout


def test_the_ar_steps_against_the_profiles_modeled_step():
    """At the profile's own layer count the AR step modes are reported as multiples of its modeled step (fixed +
    per node + one device-memory read per routed expert); a slice of the layers is not compared."""
    from specfit.core.cost import get_profile
    from specfit.eval.runtime_bench import format_table, modeled_ar_step

    cost = get_profile("qwen3-30b-a3b-h200")
    m = modeled_ar_step("qwen3-30b-a3b-h200", 48)
    assert abs(m["ms"] - (cost.fixed_ms + cost.per_node_ms + 48 * 8 * cost.read_ms)) < 1e-9
    assert modeled_ar_step("qwen3-30b-a3b-h200", 4) is None
    row = {"total_ms": 2 * m["ms"], "dense_ms": 1.0, "expert_ms": 1.0, "h2d_ms": 0.0, "experts_moved": 0,
           "gb_per_s": float("nan"), "ms_per_expert": float("nan")}
    result = {"modes": {"ar_decode": {**row, "total_ms": 8 * m["ms"]}, "ar_decode_cuda-graph": row},
              "modeled_ar_steps": [m, modeled_ar_step("qwen3-30b-a3b-h100", 48)], "cache_slots": 128,
              "num_experts": 128,
              "calibration": {"records": 1, "rel_residual": 0.0, "cost": {}}}
    assert "models this AR step (every expert resident) at 3.78 ms: ar_decode 8.00 x, ar_decode_cuda-graph 2.00 x" \
        in format_table(result)
    assert "profile qwen3-30b-a3b-h100 models this AR step (every expert resident) at 4.41 ms" in format_table(result)
    assert "models this AR step" not in format_table({**result, "cache_slots": 32})


def test_a_gpu_is_compared_with_its_own_datasheet_profile():
    """An H100 SXM is priced by the h100 profile (its HBM3's 3.35 TB/s), an H200 and any other device by h200's;
    the H100's PCIe and NVL boards have other memories."""
    from specfit.core.cost import datasheet_profile, get_profile

    assert datasheet_profile("NVIDIA H100 80GB HBM3") == "qwen3-30b-a3b-h100"
    assert datasheet_profile("NVIDIA H200") == "qwen3-30b-a3b-h200"
    assert datasheet_profile("NVIDIA H100 PCIe") == datasheet_profile("NVIDIA H100 NVL") == "qwen3-30b-a3b-h200"
    assert datasheet_profile("NVIDIA A100-SXM4-80GB") == "qwen3-30b-a3b-h200"
    h100, h200 = get_profile("qwen3-30b-a3b-h100"), get_profile("qwen3-30b-a3b-h200")
    assert h100.read_ms == pytest.approx(9_437_184 / 3.35e12 * 1e3, abs=1e-6)
    assert h100.read_ms > h200.read_ms
    assert h100.per_expert_ms == h200.per_expert_ms


def test_a_bad_profile_is_refused_before_the_benchmark_runs(capsys):
    from specfit.eval.runtime_bench import main

    with pytest.raises(SystemExit):
        main(["--synthetic", "tiny", "--profile", "no-such-gpu"])
    assert "no-such-gpu" in capsys.readouterr().err
