"""The cache-size sweep (`specfit eval --cache-slots 16,32,64,96,all`): parsing, one-line errors,
resume of an interrupted sweep, and the crossover table and plot on hand-made rows."""

import json
import re

import numpy as np
import pytest

from specfit.cli import main
from specfit.core.errors import SpecFitInputError
from specfit.eval.crossover import crossover_rows, write_crossover
from specfit.eval.run import evaluate, read_results
from specfit.eval.sweep import parse_cache_slots
from test_eval import eval_args  # the tiny target and head are conftest's session fixture


@pytest.mark.parametrize("value, sizes", [
    (32, None), ("32", None), ("all", None),
    ("16,32,64,96,all", [16, 32, 64, 96, "all"]), (" 16, all ", [16, "all"]), ([16, "all", "8"], [16, "all", 8]),
    ((0,), [0]), (np.int64(32), None), ([np.int64(16), "all"], [16, "all"]),
])
def test_parse_cache_slots(value, sizes):
    assert parse_cache_slots(value) == sizes


@pytest.mark.parametrize("value, rule", [
    ("16,,x", "entry 2 of '16,,x' is empty"), ("16,x", "entry 2"), ("16,-1", "integer >= 0 or 'all'"),
    ("16,16", "twice"), (",", "entry 1"), ([], "at least one"), ([16, 1.5], "entry 2"), ([True, 2], "entry 1"),
    (16.0, "must be an integer >= 0, 'all', a comma-separated string or a list"), ({16: 1}, "a list of those"),
])
def test_parse_cache_slots_errors(value, rule):
    with pytest.raises(SpecFitInputError, match="cache_slots") as err:
        parse_cache_slots(value)
    assert rule in err.value.rule


@pytest.mark.parametrize("slots, needle", [("16,,x", "entry 2"), ("2,99", "[0, 16]"), ("16,all", "twice"),
                                           ("2,", "entry 2")])
def test_cli_bad_lists_are_one_line_errors(tiny, tmp_path, capsys, slots, needle):  # noqa: F811
    args = eval_args(tiny, tmp_path / "out")
    args[args.index("--cache-slots") + 1] = slots
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specfit eval: error: --cache-slots: ") and needle in err[0]
    assert not (tmp_path / "out").exists()


def test_sweep_writes_table_and_plot_and_resumes(tiny, tmp_path):  # noqa: F811
    out = tmp_path / "sweep"
    opts = dict(model=str(tiny / "target"), draft=str(tiny / "head"), datasets="gsm8k", limit=1,
                methods="ar,eagle3,specfit", max_new_tokens=4, total_tokens=4, depth=2, top_k=2, out=str(out))
    first = evaluate(cache_slots="2,all", **opts)
    assert first["ran"] == 6 and first["skipped"] == 0
    assert {p.name for p in out.iterdir()} == {"slots-2", "slots-all", "sweep.json", "sweep.md", "crossover.png"}
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert [(r["cache_slots"], r["method"]) for r in rows] == [(2, "ar"), (2, "eagle3"), (2, "specfit"),
                                                               (16, "ar"), (16, "eagle3"), (16, "specfit")]
    assert rows[3]["cached_fraction"] == 1.0 and rows[3]["experts_per_token"] == 0.0
    # interrupt: the second size lost its last generation, the table is gone
    results = out / "slots-all" / "results.jsonl"
    lines = results.read_bytes().splitlines(keepends=True)
    results.write_bytes(b"".join(lines[:-1]))
    (out / "sweep.md").unlink()
    again = evaluate(cache_slots=[2, "all"], **opts)
    assert (again["ran"], again["skipped"]) == (1, 5)
    assert len(read_results(results)) == 3 and (out / "sweep.md").is_file()
    assert [r["modeled_tokens_per_s"] for r in again["rows"][:3]] == [r["modeled_tokens_per_s"] for r in rows[:3]]


def test_one_size_and_a_sweep_do_not_share_an_out_folder(tiny, tmp_path):  # noqa: F811
    opts = dict(model=str(tiny / "target"), draft=str(tiny / "head"), datasets="gsm8k", limit=1, methods="ar",
                max_new_tokens=4)
    sweep, single = tmp_path / "sweep", tmp_path / "single"
    (sweep / "slots-2").mkdir(parents=True)
    (sweep / "slots-2" / "config.json").write_text("{}")
    with pytest.raises(SpecFitInputError, match="out") as err:
        evaluate(cache_slots=2, out=str(sweep), **opts)
    assert "holds a cache-size sweep" in err.value.rule
    single.mkdir()
    (single / "config.json").write_text("{}")
    with pytest.raises(SpecFitInputError, match="out") as err:
        evaluate(cache_slots="2,all", out=str(single), **opts)
    assert "holds the results of one cache size" in err.value.rule
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.json", "config.json", "single", "slots-2", "sweep"]


def test_a_sweep_into_a_folder_of_other_settings_names_the_sweeps_folder(tiny, tmp_path):  # noqa: F811
    opts = dict(model=str(tiny / "target"), draft=str(tiny / "head"), datasets="gsm8k", limit=1, methods="ar",
                max_new_tokens=4)
    (tmp_path / "slots-2").mkdir()
    (tmp_path / "slots-2" / "config.json").write_text(json.dumps({"profile": "qwen3-30b-a3b-h200"}))
    with pytest.raises(SpecFitInputError, match="out") as err:
        evaluate(cache_slots="2,all", out=str(tmp_path), **opts)
    assert "profile='qwen3-30b-a3b-h200'" in err.value.rule
    assert re.search(r"leave out --out \(these settings write to runs/sweep-target-head-pcie4-x[0-9a-f]{8}\) or "
                     r"name another folder$", err.value.rule), err.value.rule


def test_crossover_writer_on_hand_made_rows(tmp_path):
    def row(dataset, method, tps, tau=1.0):
        return {"dataset": dataset, "method": method, "modeled_tokens_per_s": tps, "speedup_vs_ar": None,
                "speedup_vs_eagle3": None, "tau": tau, "cache_hit_rate": 0.5, "experts_per_token": 3.0}

    summaries = [(64, [row("gsm8k", "ar", 10.0), row("gsm8k", "eagle3", 12.0, 2.0), row("gsm8k", "specfit", 15.0, 2.0),
                       row("cnndm", "specfit", 5.0)]),
                 (16, [row("gsm8k", "ar", 8.0), row("gsm8k", "specfit", 6.0), row("gsm8k", "oracle", 7.5)]),
                 (128, [row("gsm8k", "ar", 20.0)])]
    rows = crossover_rows(summaries, num_experts=128)
    assert [(r["dataset"], r["cache_slots"], r["method"]) for r in rows] == [
        ("gsm8k", 16, "ar"), ("gsm8k", 16, "specfit"), ("gsm8k", 16, "oracle"), ("gsm8k", 64, "ar"),
        ("gsm8k", 64, "eagle3"), ("gsm8k", 64, "specfit"), ("gsm8k", 128, "ar"), ("cnndm", 64, "specfit")]
    oracle = {(r["cache_slots"], r["method"]): r["vs_oracle"] for r in rows if r["dataset"] == "gsm8k"}
    assert oracle[(16, "specfit")] == 6.0 / 7.5 and oracle[(64, "specfit")] is None  # no oracle at 64 slots
    best = {(r["cache_slots"], r["method"], r["dataset"]): r["vs_best_baseline"] for r in rows}
    assert best[(64, "specfit", "gsm8k")] == 15.0 / 12.0 and best[(16, "specfit", "gsm8k")] == 6.0 / 8.0
    assert best[(64, "specfit", "cnndm")] is None                      # no baseline in that dataset
    assert rows[0]["cached_fraction"] == 0.125
    text, paths = write_crossover(tmp_path, rows, {"note": "hand-made"})
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows) and "| gsm8k | 64 | 0.50 | specfit | 15.0 | - | - | 1.250 | - | 2.00 |" in text
    assert "| gsm8k | all | 1.00 | ar |" in text  # every expert cached: printed as the CLI's "all"
    assert paths["crossover_png"].read_bytes()[:4] == b"\x89PNG"
    assert json.loads(paths["sweep_json"].read_text())["rows"] == rows


def test_sweep_summary_names_where_specfit_wins_and_where_it_takes_ar_steps():
    from specfit.eval.crossover import printed_markdown, sweep_summary

    def row(method, tps, tau=1.0, ept=3.0, ar_share=None, vs_ar=None):
        return {"dataset": "gsm8k", "method": method, "modeled_tokens_per_s": tps, "speedup_vs_ar": vs_ar,
                "speedup_vs_eagle3": None, "tau": tau, "cache_hit_rate": 0.5, "experts_per_token": ept,
                "ar_share": ar_share, "tokens_per_s": 5.0, "equal_to_ar": method != "ar" or None}

    rows = crossover_rows([(16, [row("ar", 10.0, ept=12.0), row("eagle3", 4.0, 2.0, 40.0, vs_ar=0.4),
                                 row("specfit", 10.0, ar_share=1.0, vs_ar=1.0)]),
                           (128, [row("ar", 20.0, ept=0.0), row("eagle3", 22.0, 2.0, 0.0, vs_ar=1.1),
                                  row("specfit", 26.4, 2.2, 0.0, ar_share=0.0, vs_ar=1.32)])], num_experts=128)
    text = sweep_summary(rows)
    assert text.startswith("gsm8k: specfit wins at all slots: 1.20 × eagle3 (26.4 against 22.0 tok/s, τ 2.20).")
    assert ("It takes AR steps in most cycles at 16 slots (100% of cycles, 1.000 × ar: drafting does not pay there, eagle3 runs at "
            "0.40 × ar, copying 40.0 experts per token against ar's 12.0).") in text
    assert "128" not in text.split("It takes AR steps")[1]  # all slots drafted: not an AR-step cell
    resident = crossover_rows([(128, [row("ar", 20.0, ept=0.0), row("eagle3", 12.0, 2.0, 0.0, vs_ar=0.6),
                                      row("specfit", 19.0, ar_share=0.7, vs_ar=0.95)])], num_experts=128)
    assert sweep_summary(resident).endswith("It takes AR steps in most cycles at all slots (70% of cycles, 0.950 × ar: drafting does not "
                                            "pay there, eagle3 runs at 0.60 × ar, every expert resident: a verify "
                                            "reads the weights of every expert its tokens route to).")
    looked = crossover_rows([(16, [row("ar", 10.0, ept=12.0), row("ar+lookahead", 11.4, ept=10.0, vs_ar=1.14),
                                   row("eagle3", 4.0, 2.0, 40.0, vs_ar=0.4),
                                   row("specfit", 11.3, ar_share=1.0, vs_ar=1.13)])], num_experts=128)
    assert ("at 16 slots (100% of cycles, 1.130 × ar, ar+lookahead 1.140 × ar: drafting does not pay there"
            in sweep_summary(looked))  # the AR steps' gain is the lookahead cache's, as ar+lookahead's
    lose = crossover_rows([(16, [row("ar", 10.0), row("specfit", 9.95, ar_share=0.2)])], num_experts=128)
    assert sweep_summary(lose) == "gsm8k: specfit does not beat the best of ar by 1% at any size."
    table = printed_markdown(rows).splitlines()
    assert table[0] == ("| dataset | slots | method | τ | tok/s modeled | tok/s wall | × ar | × eagle3 | experts/token "
                        "| AR-step share | = ar |")
    assert table[-1] == "| gsm8k | all | specfit | 2.20 | 26.4 | 5.0 | 1.320 | - | 0.0 | 0% | yes |"
