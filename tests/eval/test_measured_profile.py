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


def edited(edit) -> list[dict]:
    results = grid()
    edit(results)
    return results


@pytest.mark.parametrize("results,field", [
    (grid()[::2], "bench.layers"),                                           # one layer count
    (grid()[:2], "bench.experts_moved"),                                     # nothing transferred
    (edited(lambda r: r[0].update(dtype="torch.float32") or r[1].update(dtype="torch.bfloat16")), "bench.dtype"),
    (edited(lambda r: r[0].update(grouped_experts=False) or r[2].update(grouped_experts=True)), "bench.grouped_experts"),
    (edited(lambda r: r[1]["modes"].update(prefill={"total_ms": 1, "experts_moved": 0})), "bench[1]: modes"),
    (edited(lambda r: r[1]["modes"]["verify_8"].pop("experts_moved")), "bench[1]: modes.verify_8.experts_moved"),
    (edited(lambda r: r[2]["modes"]["ar_decode"].update(total_ms=float("nan"))), "bench[2]: modes.ar_decode.total_ms"),
    (edited(lambda r: r[3]["modes"].update(verify_16=3)), "bench[3]: modes.verify_16"),
    (edited(lambda r: r[0].update(layers=0)), "bench[0]: layers"),
    (edited(lambda r: r[0].update(layers="x")), "bench[0]: layers"),
    (edited(lambda r: r[0].update(modes=[])), "bench[0]"),
    (edited(lambda r: r[1]["modes"].update(verify_0={"total_ms": 1, "experts_moved": 0})), "bench[1]: modes"),
    (edited(lambda r: r[1]["modes"].update({"verify_\u00b2": {"total_ms": 1, "experts_moved": 0}})), "bench[1]: modes"),
    (edited(lambda r: r[0].update(layers=1e308)), "bench[0]: layers"),
    (edited(lambda r: r[2]["modes"]["verify_8"].update(total_ms=1e308)), "bench[2]: modes.verify_8.total_ms"),
    (edited(lambda r: [m.update(total_ms=0) for res in r for m in res["modes"].values()]), "bench.total_ms"),
])
def test_bad_benchmarks_are_refused_by_field(results, field):
    with pytest.raises(SpecFitInputError) as err:
        fit_profile(results, name="x")
    assert str(err.value).startswith(field), str(err.value)


def test_cli_errors_name_the_file(tmp_path, capsys):
    good = [tmp_path / f"g{i}.json" for i in range(4)]
    for path, res in zip(good, grid()):
        path.write_text(json.dumps(res))
    for bad, content in (("text.json", b"not json"), ("latin.json", b"\xff\xfe\x00")):
        (tmp_path / bad).write_bytes(content)
        assert main([str(tmp_path / bad)] + [str(g) for g in good] + ["--name", "x"]) == 2
        assert str(tmp_path / bad) in capsys.readouterr().err
    (tmp_path / "deep.json").write_text("[" * 100_000)
    assert main([str(tmp_path / "deep.json")] + [str(g) for g in good] + ["--name", "x"]) == 2
    assert "deep.json" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.json"), str(good[0]), "--name", "x"]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main([str(g) for g in good] + ["--name", "x", "--json", str(tmp_path / "no" / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "p.json" in err and "--json" in err
    assert main([str(g) for g in good] + ["--name", "x", "--like", "nope"]) == 2
    assert "profile" in capsys.readouterr().err


def test_cli_on_two_measured_layer_counts(tmp_path, capsys):
    """runtime_bench at 2 and 4 layers of the tiny shape, then the fit's CLI; a --per-expert run beside them
    is refused (one runtime configuration per fit)."""
    paths = []
    for layers, extra in ((2, []), (4, []), (4, ["--per-expert"])):
        out = tmp_path / f"b{layers}{''.join(extra)}.json"
        proc = subprocess.run([sys.executable, "-m", "specfit.eval.runtime_bench", "--synthetic", "tiny", "--layers",
                               str(layers), "--repeats", "2", "--json", str(out), *extra],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        res = json.loads(out.read_text())
        assert res["layers"] == layers and res["grouped_experts"] is (not extra)
        paths.append(str(out))
    assert main(paths + ["--name", "x"]) == 2 and "bench.grouped_experts" in capsys.readouterr().err
    paths = paths[:2]
    assert main(paths + ["--name", "tiny-measured", "--like", "qwen3-30b-a3b-pcie4", "--json", str(tmp_path / "p.json")]) == 0
    got = json.loads((tmp_path / "p.json").read_text())
    assert got["profile"]["name"] == "tiny-measured" and got["profile"]["draft_level_ms"] == 0.5
    assert got["fit"]["layer_counts"] == [2, 4] and got["profile"]["fixed_ms"] > 0
    assert main(paths[:1] + ["--name", "x"]) == 2 and "bench.layers" in capsys.readouterr().err
