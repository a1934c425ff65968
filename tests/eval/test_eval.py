"""`specfit eval` end to end on tiny random models: files, schema, resume after an interruption,
equality with AR for every lossless method, and bad input (exit 2, nothing written)."""

import json
import shutil

import pytest
import torch

from specfit.core.errors import SpecFitInputError
from specfit.eval.run import EvalConfig, default_out, evaluate, read_results
from specfit.cli import build_parser, main

METHODS = "ar,eagle3-vanilla,eagle3,eagle3-scan,specfit,oracle"
RECORD_KEYS = {"id", "dataset", "method", "output_ids", "new_tokens", "cycles", "accept_lengths", "wall_s",
               "modeled_ms", "experts_transferred"}
ROW_KEYS = {"dataset", "method", "tau", "tokens_per_s", "modeled_tokens_per_s", "speedup_vs_ar", "speedup_vs_eagle3",
            "experts_per_token", "cache_hit_rate", "solve_share", "equal_to_ar"}


def eval_args(tiny, out, *extra):
    return ["eval", "--model", str(tiny / "target"), "--draft", str(tiny / "head"), "--out", str(out),
            "--dataset", "gsm8k,cnndm", "--limit", "1", "--methods", METHODS, "--max-new-tokens", "6",
            "--cache-slots", "4", "--total-tokens", "6", "--depth", "3", "--top-k", "2", "--no-progress", *extra]


@pytest.fixture(scope="module")
def first_run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_run") / "out"
    assert main(eval_args(tiny, out)) == 0
    return out


def test_files_and_schema(first_run):
    names = {p.name for p in first_run.iterdir()}
    assert {"results.jsonl", "summary.json", "summary.md", "config.json", "throughput_vs_tree_size.png",
            "experts_per_token.png", "acceptance_by_depth.png"} <= names
    assert not [n for n in names if n.endswith(".tmp")]
    recs = read_results(first_run / "results.jsonl")
    n_methods = len(METHODS.split(","))
    assert len(recs) == 2 * n_methods
    for r in recs:
        assert RECORD_KEYS <= set(r.to_json())
        assert r["new_tokens"] == len(r["output_ids"]) <= 6
        assert len(r["accept_lengths"]) == r["cycles"] >= 1
        assert r["modeled_ms"] > 0 and r["wall_s"] > 0
    summary = json.loads((first_run / "summary.json").read_text())
    assert {"config", "versions", "machine", "cost_scaling"} <= set(summary)
    assert {"torch", "transformers", "specfit", "python"} <= set(summary["versions"])
    assert {"platform", "cpu_count"} <= set(summary["machine"])
    assert "48/3" in summary["cost_scaling"]
    rows = summary["rows"]
    assert len(rows) == 2 * n_methods
    for row in rows:
        assert ROW_KEYS <= set(row)
        assert row["tau"] >= 1.0
    for row in rows:
        ratio = row["predicted_vs_transferred"]
        assert (ratio is not None and ratio >= 0) if row["method"] in ("eagle3-scan", "specfit") else ratio is None
    ar = [r for r in rows if r["method"] == "ar"]
    assert all(r["tau"] == 1.0 and r["speedup_vs_ar"] == 1.0 and r["equal_to_ar"] is None for r in ar)
    assert "| gsm8k | specfit |" in (first_run / "summary.md").read_text()


def test_every_lossless_method_equals_ar(first_run):
    rows = json.loads((first_run / "summary.json").read_text())["rows"]
    assert all(r["equal_to_ar"] is True for r in rows if r["method"] != "ar")
    recs = read_results(first_run / "results.jsonl")
    for dataset in ("gsm8k", "cnndm"):
        outs = {r["method"]: r["output_ids"] for r in recs if r["dataset"] == dataset}
        assert len(set(map(tuple, outs.values()))) == 1
        # so are the task metrics computed from them
        scores = [json.dumps(r["score"], sort_keys=True) for r in recs if r["dataset"] == dataset]
        assert len(set(scores)) == 1


def test_vanilla_transfers_at_least_as_many_experts_as_eagle3(first_run):
    recs = read_results(first_run / "results.jsonl")
    by = {(r["dataset"], r["method"]): r for r in recs}
    for d in ("gsm8k", "cnndm"):
        # without a cache every looked-up expert is transferred
        v = by[(d, "eagle3-vanilla")]
        assert v["experts_transferred"] == v["experts_looked_up"]


def test_resume_after_interruption_has_no_duplicates(tiny, first_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(first_run, out)
    path = out / "results.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    last = json.loads(lines[-1])
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # torn last line
    assert main(eval_args(tiny, out)) == 0
    recs = read_results(out / "results.jsonl")
    keys = [(r["id"], r["dataset"], r["method"]) for r in recs]
    assert len(keys) == len(set(keys)) == len(lines)
    redone = next(r for r in recs if (r["id"], r["dataset"], r["method"]) == (last["id"], last["dataset"], last["method"]))
    assert redone["output_ids"] == last["output_ids"]
    assert path.read_bytes().endswith(b"\n")


def test_resume_refuses_a_different_configuration(tiny, first_run, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(first_run, out)
    before = (out / "results.jsonl").read_bytes()
    assert main(eval_args(tiny, out)[:-1] + ["--max-new-tokens", "7", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "max_new_tokens" in err[0]
    assert (out / "results.jsonl").read_bytes() == before


def test_the_refusal_names_the_folder_these_settings_get_by_default(tiny, first_run, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(first_run, out)
    assert main(eval_args(tiny, out)[:-1] + ["--max-new-tokens", "7", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    named = default_out(EvalConfig(model=str(tiny / "target"), draft=str(tiny / "head"), cache_slots="4",
                                   max_new_tokens=7, total_tokens=6, depth=3, top_k=2))
    assert err.endswith(f"; leave out --out (these settings write to {named}) or name another folder"), err


def test_default_out_is_named_from_the_settings():
    assert default_out(EvalConfig()) == "runs/eval-lite-pcie4-32slots"
    assert default_out(EvalConfig(draft="strong")) == "runs/eval-strong-pcie4-32slots"
    assert default_out(EvalConfig(draft="models/proxy/eagle3/", profile="qwen3-30b-a3b-h200", cache_slots="all",
                                  offload="host")) == "runs/eval-eagle3-h200-allslots-host"
    assert default_out(EvalConfig(), sweep=True) == "runs/sweep-lite-pcie4"
    assert default_out(EvalConfig(model="/ckpt/qwen3/")) == "runs/eval-qwen3-lite-pcie4-32slots"
    # a profile file (cost_fit's --json) by its file name: no folders of its path under runs/
    assert default_out(EvalConfig(profile="/tmp/fits/my-gpu.json")).startswith("runs/eval-lite-my-gpu-32slots")
    # datasets, methods and the limit resume in one folder; every other setting that tells results apart moves it
    assert default_out(EvalConfig(datasets=("gsm8k",), methods=("ar",), limit=3)) == default_out(EvalConfig())
    hashed = {default_out(EvalConfig(**{k: v})) for k, v in
              [("max_new_tokens", 16), ("max_new_tokens", 17), ("eviction", "lfu"), ("temperature", 0.5), ("depth", 3)]}
    assert len(hashed) == 5 and all(h.startswith("runs/eval-lite-pcie4-32slots-x") for h in hashed)


def test_runs_of_other_settings_without_out_go_to_their_own_folders(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = eval_args(tiny, "unused", "--dataset", "gsm8k", "--methods", "ar,eagle3")
    del args[args.index("--out"):args.index("--out") + 2]
    assert main(args) == 0
    assert main([*args, "--max-new-tokens", "5"]) == 0  # other settings, no --out: no refusal
    folders = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(folders) == 2 and all(f.startswith("eval-target-head-pcie4-4slots-x") for f in folders), folders
    for f in folders:
        assert (tmp_path / "runs" / f / "summary.md").is_file()


def test_adding_a_method_to_a_run_resumes_it(tiny, tmp_path, capsys):
    """A first run of ar alone needs no head or routing trace; adding specfit (which needs both) to the
    same folder resumes it instead of refusing the trace as a changed setting (newcomer finding)."""
    out = tmp_path / "out"
    args = eval_args(tiny, out, "--dataset", "gsm8k")
    methods = args.index("--methods") + 1
    args[methods] = "ar"
    assert main(args) == 0
    args[methods] = "ar,specfit"
    assert main(args) == 0
    recs = read_results(out / "results.jsonl")
    assert sorted(r["method"] for r in recs) == ["ar", "specfit"]
    args[methods] = "ar"  # and back: the folder keeps the trace it knows
    assert main(args) == 0 and "predictor_trace" in (out / "config.json").read_text()


@pytest.mark.parametrize("change, field", [
    (["--dataset", "nosuch"], "--dataset"),
    (["--methods", "ar,medusa"], "method"),
    (["--model", "MISSING"], "--model"),
    (["--draft", "MISSING"], "--draft"),
    (["--profile", "tpu"], "profile"),
    (["--limit", "0"], "--limit"),
    (["--dataset", "BADJSONL"], "prompt"),
    (["--predictor-trace", "MISSING"], "--predictor-trace"),
])
def test_bad_input_exits_2_and_writes_nothing(tiny, tmp_path, capsys, change, field):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine", "id": 1}\n{"id": 2, "text": "no prompt here"}\n')
    change = [{"MISSING": str(tmp_path / "missing"), "BADJSONL": str(bad)}.get(c, c) for c in change]
    out = tmp_path / "out"
    args = eval_args(tiny, out)
    for i in range(0, len(change), 2):
        j = args.index(change[i]) if change[i] in args else None
        if j is None:
            args += change[i:i + 2]
        else:
            args[j + 1] = change[i + 1]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specfit eval: error: ") and field in err[0]
    assert not out.exists()


def test_dtype_runs_the_models_in_it_and_is_recorded(tiny, tmp_path, capsys):
    """--dtype bfloat16 (the CUDA default) on the CPU: the summary names the device and dtype, the
    folder's settings record the dtype used, and a float32 rerun into it is refused, naming both; a
    run left at the default (float32 here) resumes under an explicit --dtype float32 and
    --device cpu:0; a dtype outside float32/bfloat16 is refused without writing."""
    out = tmp_path / "out"
    args = eval_args(tiny, out, "--dataset", "gsm8k", "--dtype", "bfloat16")
    args[args.index("--methods") + 1] = "ar,specfit"
    assert main(args) == 0
    assert "device cpu (bfloat16)" in (out / "summary.md").read_text()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert main(args[:-1] + ["float32"]) == 2
    assert "dtype='bfloat16', this run has dtype='float32'" in capsys.readouterr().err
    default = eval_args(tiny, tmp_path / "default", "--dataset", "gsm8k", "--methods", "ar")
    assert main(default) == 0 and main(default + ["--dtype", "float32", "--device", "cpu:0"]) == 0
    assert "0 new generations" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(args[:-1] + ["int8"])
    for bad in ("int8", "float16", torch.float16):
        with pytest.raises(SpecFitInputError, match="dtype: must be 'float32' or 'bfloat16'"):
            evaluate(model=str(tiny / "target"), out=str(tmp_path / "bad"), dtype=bad, limit=1, methods="ar")
    assert not (tmp_path / "bad").exists()
    res = evaluate(model=str(tiny / "target"), out=str(tmp_path / "api"), dtype=torch.bfloat16, limit=1,
                   methods="ar", datasets="gsm8k", max_new_tokens=4, cache_slots=4)
    assert "device cpu (bfloat16)" in res["markdown"]


def test_user_jsonl_prompts(tiny, tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text('{"prompt": "Once upon a time", "id": "a"}\n\n{"prompt": "The cat sat"}\n')
    out = tmp_path / "out"
    args = eval_args(tiny, out)
    args[args.index("--dataset") + 1] = str(data)
    args[args.index("--methods") + 1] = "ar,specfit"
    args[args.index("--limit") + 1] = "5"
    assert main(args) == 0
    recs = read_results(out / "results.jsonl")
    assert sorted({r["id"] for r in recs}) == ["3", "a"] and {r["dataset"] for r in recs} == {"mine"}
    assert all(r["score"] == {} for r in recs)


def test_cli_defaults_match_the_library_defaults():
    args = build_parser().parse_args(["eval"])
    cfg = EvalConfig()
    assert tuple(args.datasets.split(",")) == cfg.datasets and tuple(args.methods.split(",")) == cfg.methods
    for name in ("limit", "max_new_tokens", "cache_slots", "eviction", "admission", "profile", "temperature", "top_p", "seed", "total_tokens",
                 "depth", "top_k", "device", "dtype", "threads", "out"):
        assert getattr(args, name) == getattr(cfg, name), name


def test_each_dataset_learns_afresh(tiny, tmp_path, monkeypatch):
    """specfit's online model (acceptance, corrections, the AR gate's Ŝ) carries from one prompt to the
    next of a dataset, but each dataset, and its first prompt after the untimed warm-up, starts with
    nothing learned: a dataset's rows do not depend on the dataset run before it."""
    from specfit.pipeline import SpecFit

    seen = []  # (method, drafted and shadow cycles the decoder's online model already learned from)
    decoder = SpecFit.decoder

    def spy(self, method="specfit", **kw):
        dec = decoder(self, method, **kw)
        seen.append((dec.method.name, dec.online.policy.state.drafted + dec.online.policy.shadow.drafted
                     if dec.online is not None else None))
        return dec

    monkeypatch.setattr(SpecFit, "decoder", spy)
    args = eval_args(tiny, tmp_path / "out")
    args[args.index("--methods") + 1] = "ar,specfit"
    args[args.index("--limit") + 1] = "2"
    assert main(args) == 0
    drafted = [d for m, d in seen if m == "specfit"]
    assert len(drafted) == 5  # the warm-up, then gsm8k's two prompts and cnndm's two
    assert drafted[0] == 0 and drafted[1] == 0 and drafted[3] == 0  # warm-up's learning and gsm8k's are gone
    assert drafted[2] > 0 and drafted[4] > 0  # the second prompt of a dataset starts from the first's
