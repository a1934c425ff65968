"""The instance generator and the ``specfit compare-solvers`` harness."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from specfit.eval.compare import Record, parse_sizes, summarize
from specfit.eval.instances import PRESETS, InstanceSpec, generate_instance, generate_instances, get_preset, with_options
from specfit.cli import main
from specfit.core.cost import PROFILES
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import save_instance


@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_generated_instances_are_valid_eagle_like_trees(n):
    spec = InstanceSpec(layers=3, experts=10, top_k=3, cache_fraction=0.3)
    inst = generate_instance(n, spec, np.random.default_rng(n))
    tree = inst.tree
    assert tree.n == n and tree.experts.shape == (n, 3, 3)
    assert np.all(np.diff(tree.depth) >= 0)  # BFS order
    assert np.all(tree.path_prob[1:] <= tree.path_prob[tree.parents[1:]])
    for v in range(n):
        for l in range(3):
            assert len(set(tree.experts[v, l].tolist())) == 3  # top-k experts are distinct
    assert np.all(inst.cache.sum(axis=1) == 3)
    # the n most probable nodes of the pool: every kept node is at least as likely as its children
    assert tree.path_prob[0] == 1.0


def test_generation_is_seeded_and_independent_of_other_sizes():
    spec = PRESETS["small"]
    a = {(n, i): inst for n, i, inst in generate_instances(spec, [5, 9], 2, seed=3)}
    b = {(n, i): inst for n, i, inst in generate_instances(spec, [9], 2, seed=3)}
    c = {(n, i): inst for n, i, inst in generate_instances(spec, [9], 2, seed=4)}
    assert a[9, 1].to_json() == b[9, 1].to_json()
    assert a[9, 1].to_json() != c[9, 1].to_json()


def test_full_sharing_copies_the_parents_experts():
    inst = generate_instance(20, with_options(PRESETS["small"], sharing=1.0), np.random.default_rng(0))
    e = np.sort(inst.tree.experts, axis=2)
    assert np.array_equal(e[1:], e[inst.tree.parents[1:]])


def test_no_sharing_draws_fresh_experts():
    spec = InstanceSpec(layers=8, experts=64, top_k=4, sharing=0.0, skew=0.0)
    inst = generate_instance(30, spec, np.random.default_rng(0))
    e = np.sort(inst.tree.experts, axis=2)
    assert not np.array_equal(e[1:], e[inst.tree.parents[1:]])


def test_popular_cache_holds_the_most_requested_experts():
    spec = InstanceSpec(layers=4, experts=32, top_k=4, skew=2.0, sharing=0.0, cache_fraction=0.25)
    inst = generate_instance(200, spec, np.random.default_rng(1))
    hit = inst.cache[np.arange(4)[None, :, None], inst.tree.experts].mean()
    assert hit > 0.5  # Zipf(2): the top quarter of experts carries most of the routing mass


def test_qwen3_preset():
    spec = get_preset("qwen3-30b-a3b")
    inst = generate_instance(16, spec, np.random.default_rng(0))
    assert inst.tree.experts.shape == (16, 48, 8) and inst.num_experts == 128
    assert inst.cost == PROFILES["qwen3-30b-a3b-pcie4"]
    assert np.all(inst.cache.sum(axis=1) == 32)


@pytest.mark.parametrize("options,field", [({"top_k": 20}, "top_k"), ({"sharing": 1.5}, "sharing"),
                                           ({"cache_fraction": -0.1}, "cache_fraction"), ({"layers": 0}, "layers"),
                                           ({"cache_policy": "lru"}, "cache_policy"), ({"profile": "tpu"}, "profile")])
def test_generator_options_are_validated(options, field):
    with pytest.raises(SpecFitInputError) as info:
        with_options(PRESETS["small"], **options)
    assert info.value.field == field


def test_unknown_preset_and_bad_sizes():
    with pytest.raises(SpecFitInputError, match="preset"):
        get_preset("llama")
    with pytest.raises(SpecFitInputError, match="sizes"):
        parse_sizes("16,x")
    with pytest.raises(SpecFitInputError, match="sizes"):
        parse_sizes("0")


def _rec(source, solver, objective, ms):
    return Record(source, 10, solver, "optimal", objective, objective, 1.0, 1.0, ms, ms, 1)


def test_summarize_gaps_agreement_and_percentiles():
    recs = [_rec("a", "exact", 100.0, 1.0), _rec("b", "exact", 50.0, 3.0),
            _rec("a", "greedy", 90.0, 2.0), _rec("b", "greedy", 50.0 * (1 - 1e-12), 4.0)]
    rows = {r["solver"]: r for r in summarize(recs)}
    g = rows["greedy"]
    assert g["mean_gap_pct"] == pytest.approx(5.0) and g["max_gap_pct"] == pytest.approx(10.0)
    assert g["agreement"] == 0.5 and g["disagreements"] == 1
    assert g["median_ms"] == 3.0 and g["p99_ms"] == pytest.approx(3.98)
    assert g["time_vs_ref"] == pytest.approx(3.0 / 2.0)
    assert rows["exact"]["agreement"] == 1.0
    assert summarize(recs, reference="cpsat")[0]["mean_gap_pct"] is None


def test_compare_solvers_command_writes_the_report(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["compare-solvers", "--preset", "small", "--sizes", "5,9", "--count", "4", "--seed", "2",
               "--solvers", "exact,bruteforce,cpsat,scan,greedy,eagle", "--max-nodes", "6", "--out", str(out),
               "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "| solver | n |" in text and "pinned" in text
    assert sorted(p.name for p in out.iterdir()) == ["compare_solvers.json", "compare_solvers.md", "compare_solvers.png"]
    assert (out / "compare_solvers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "compare_solvers.json").read_text())
    assert report["meta"]["settings"]["max_nodes"] == 6 and report["meta"]["instances"] == 8
    assert len(report["records"]) == 8 * 6
    assert all(r["num_nodes"] <= 6 for r in report["records"])
    rows = {(r["solver"], r["n"]): r for r in report["summary"]}
    for name in ("bruteforce", "cpsat"):
        assert rows[name, "all"]["agreement"] == 1.0 and rows[name, "all"]["max_gap_pct"] <= 1e-7
    for name in ("scan", "greedy", "eagle"):
        assert rows[name, "all"]["mean_gap_pct"] >= -1e-7


def test_compare_solvers_reads_a_folder(tmp_path, capsys):
    folder = tmp_path / "instances"
    folder.mkdir()
    for n, i, inst in generate_instances(PRESETS["small"], [6], 3, seed=1):
        save_instance(inst, folder / f"inst{i}.json")
    rc = main(["compare-solvers", "--instances", str(folder), "--solvers", "exact,greedy", "--rate", "80",
               "--out", str(tmp_path / "out"), "--no-progress"])
    assert rc == 0
    report = json.loads((tmp_path / "out" / "compare_solvers.json").read_text())
    assert report["meta"]["mode"] == "rate"
    assert sorted({r["source"] for r in report["records"]}) == ["inst0.json", "inst1.json", "inst2.json"]
    capsys.readouterr()


@pytest.mark.parametrize("argv,field", [(["--instances", "EMPTY"], "--instances"), (["--sizes", "a"], "--sizes"),
                                        (["--solvers", "exact,simplex"], "--solvers"), (["--count", "0"], "--count"),
                                        (["--sharing", "2"], "--sharing")])
def test_compare_solvers_bad_input_exits_2(argv, field, tmp_path, capsys):
    (tmp_path / "EMPTY").mkdir()
    argv = [a.replace("EMPTY", str(tmp_path / "EMPTY")) for a in argv]
    rc = main(["compare-solvers", "--preset", "small", "--sizes", "4", "--count", "1", "--out", str(tmp_path / "o"),
               "--no-progress", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"specfit compare-solvers: error: {field}") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_compare_solvers_on_host_regime_instances(tmp_path, capsys):
    from specfit.core.cost import DEFAULT_HOST_PROFILE, HostProfile

    inst = generate_instance(6, with_options(get_preset("small"), host_profile=DEFAULT_HOST_PROFILE),
                             np.random.default_rng(0))
    assert isinstance(inst.cost, HostProfile) and inst.cost.num_layers == get_preset("small").layers
    out = tmp_path / "host"
    rc = main(["compare-solvers", "--preset", "small", "--sizes", "5,9", "--count", "3", "--host-profile",
               DEFAULT_HOST_PROFILE, "--solvers", "exact,bruteforce,cpsat,scan", "--out", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads((out / "compare_solvers.json").read_text())
    assert report["meta"]["settings"]["host_profile"] == DEFAULT_HOST_PROFILE
    rows = {(r["solver"], r["n"]): r for r in report["summary"]}
    for name in ("bruteforce", "cpsat"):
        assert rows[name, "all"]["agreement"] == 1.0 and rows[name, "all"]["max_gap_pct"] <= 1e-7
    rc = main(["compare-solvers", "--preset", "small", "--sizes", "4", "--count", "1", "--host-profile", "nope",
               "--out", str(tmp_path / "bad"), "--no-progress"])
    assert rc == 2 and "host_profile" in capsys.readouterr().err


def test_every_command_writes_under_runs_by_default():
    """Every subcommand's default output folder lies under runs/ (git-ignored), as eval's and sweep's do."""
    from specfit.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    outs = {name: p.get_default("out") for name, p in subs.choices.items() if p.get_default("out") is not None}
    assert "compare-solvers" in outs
    assert all(str(o).startswith("runs/") for o in outs.values()), outs
