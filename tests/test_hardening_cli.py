"""The command line keeps its word: help text, flag names in errors, one rule per option, Ctrl-C.

Every error is one stderr line ``specfit <command>: error: <flag or field>: <rule>``, exit 2, no
traceback; the flag appears when the value came from the command line, the field name in the API.
"""

from __future__ import annotations

import json

import pytest

from specfit.cli import build_parser, main
from specfit.core.errors import SpecFitInputError
from specfit.models.proxy import paths as proxy_paths

INSTANCE = {"parents": [-1, 0, 0], "path_prob": [1.0, 0.6, 0.3], "num_experts": 4,
            "experts": [[[0]], [[1]], [[2]]], "cache": [[0]],
            "cost": {"fixed_ms": 5.0, "per_node_ms": 0.3, "per_expert_ms": 0.2}}


def one_line_error(capsys, argv, *needles) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.fixture
def instance(tmp_path):
    path = tmp_path / "inst.json"
    path.write_text(json.dumps(INSTANCE))
    return path


def test_solve_help_lists_the_solvers_it_accepts(capsys):
    from specfit.solvers import available_solvers

    with pytest.raises(SystemExit):
        main(["solve", "--help"])
    text = capsys.readouterr().out
    assert "--list-solvers" not in text
    assert all(name in text for name in available_solvers())


def test_top_level_help_has_no_internal_note(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "No logic of its own" not in text and "parse arguments" not in text
    assert "speculative decoding" in text


def test_argparse_errors_are_one_line(capsys):
    for argv in (["solve"], ["solve", "x.json", "--max-nodes", "many"], ["nosuchcommand"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1 and ": error: " in err and "usage" not in err, err


@pytest.mark.parametrize("solver", ["greedy", "eagle", "scan", "bruteforce"])
def test_time_limit_with_a_solver_that_has_none(instance, capsys, solver):
    from specfit.solvers import get_solver

    with pytest.raises(SpecFitInputError) as info:
        get_solver(solver, time_limit_s=1.0)
    assert info.value.field == "time_limit_s" and "not accepted by solver" in info.value.rule
    err = one_line_error(capsys, ["solve", str(instance), "--solver", solver, "--time-limit", "1"],
                         "--time-limit: not accepted by solver")
    assert "takes no arguments" not in err


@pytest.mark.parametrize("solver", ["exact", "cpsat"])
def test_time_limit_with_solvers_that_take_one(instance, capsys, solver):
    assert main(["solve", str(instance), "--solver", solver, "--time-limit", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["solver"] == solver


@pytest.mark.parametrize("value", ["-1", "0"])
def test_max_nodes_one_rule(instance, capsys, value):
    from dataclasses import replace

    from specfit.core.instance import load_instance

    with pytest.raises(SpecFitInputError, match=r"^max_nodes: must be an integer >= 1 .* got"):
        replace(load_instance(instance), max_nodes=int(value))
    one_line_error(capsys, ["solve", str(instance), "--max-nodes", value], "--max-nodes: must be an integer >= 1")


def test_field_names_in_the_api_flag_names_on_the_command_line(capsys):
    from specfit.eval.run import EvalConfig, plan

    with pytest.raises(SpecFitInputError) as info:
        plan(EvalConfig(cache_slots=-3, methods=("ar",), datasets=("gsm8k",), limit=1, out="/nonexistent/x"))
    assert info.value.field == "cache_slots"
    with pytest.raises(SpecFitInputError) as info:
        plan(EvalConfig(max_new_tokens=0))
    assert info.value.field == "max_new_tokens"
    one_line_error(capsys, ["eval", "--cache-slots", "-3", "--methods", "ar", "--limit", "1", "--dataset", "gsm8k",
                            "--out", "/nonexistent/x"], "specfit eval: error: --cache-slots: ")


# --- generate -----------------------------------------------------------------------------------
def test_generate_missing_model_dir_is_named(tmp_path, capsys):
    from specfit import SpecFit

    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(SpecFitInputError, match="no such checkpoint folder") as info:
        SpecFit.from_pretrained(missing)
    assert info.value.field == "target_dir"
    err = one_line_error(capsys, ["generate", "--model", str(missing), "--prompt", "hi", "--max-new-tokens", "2"],
                         "--model: no such checkpoint folder", str(missing))
    assert "tokenizer" not in err


@pytest.mark.parametrize("value", ["0", "-10"])
def test_max_new_tokens_one_rule_in_generate_and_eval(capsys, value):
    proxy = proxy_paths()["target"]
    rule = f"--max-new-tokens: must be a positive integer, got {value}"
    one_line_error(capsys, ["generate", "--model", str(proxy), "--prompt-ids", "1,2,3", "--max-new-tokens", value], rule)
    one_line_error(capsys, ["eval", "--max-new-tokens", value, "--out", "/nonexistent/x"], rule)


def test_max_new_tokens_past_the_context_is_refused(tmp_path, capsys):
    from specfit import SpecFit

    proxy = proxy_paths()["target"]  # max_position_embeddings 2048
    with pytest.raises(SpecFitInputError, match="exceed the model's context of 2048 tokens") as info:
        SpecFit.from_pretrained(proxy).generate([1, 2, 3], method="ar", max_new_tokens=5000)
    assert info.value.field == "max_new_tokens"
    one_line_error(capsys, ["generate", "--model", str(proxy), "--prompt-ids", "1,2,3", "--max-new-tokens", "5000"],
                   "--max-new-tokens: the prompt (3 tokens) plus 5000 new tokens exceed the model's context")
    one_line_error(capsys, ["eval", "--methods", "ar", "--dataset", "gsm8k", "--limit", "1", "--max-new-tokens",
                            "5000", "--out", str(tmp_path / "out")], "--max-new-tokens: ", "context of 2048")
    assert not (tmp_path / "out").exists()


def test_cache_slots_all_wherever_a_slot_count_is_accepted(tmp_path, capsys):
    from specfit.eval.run import EvalConfig, plan

    assert plan(EvalConfig(cache_slots="all", methods=("ar",), datasets=("gsm8k",), limit=1,
                           out=str(tmp_path / "p"))).config.cache_slots == 128
    out = tmp_path / "out"
    assert main(["eval", "--cache-slots", "all", "--methods", "ar", "--dataset", "gsm8k", "--limit", "1",
                 "--max-new-tokens", "2", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert json.loads((out / "config.json").read_text())["cache_slots"] == 128
    one_line_error(capsys, ["eval", "--cache-slots", "200", "--methods", "ar", "--dataset", "gsm8k", "--limit", "1",
                            "--out", str(tmp_path / "o2")], "--cache-slots: must be an integer in [0, 128] or 'all'")
    one_line_error(capsys, ["eval", "--cache-slots", "16,200", "--methods", "ar", "--dataset", "gsm8k", "--limit", "1",
                            "--out", str(tmp_path / "o3")],
                   "--cache-slots: entry 2 of '16,200': must be an integer in [0, 128] or 'all', got '200'")
    assert not (tmp_path / "o3").exists()  # checked before the first size runs
    proxy = proxy_paths()["target"]
    assert main(["generate", "--model", str(proxy), "--prompt-ids", "1,2", "--max-new-tokens", "1",
                 "--cache-slots", "all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["slots"] == 128


# --- Ctrl-C -------------------------------------------------------------------------------------
def test_ctrl_c_during_eval(tmp_path, capsys, monkeypatch):
    from specfit.engine import SpecDecoder
    from specfit.eval.run import read_results

    out = tmp_path / "out"
    argv = ["eval", "--methods", "ar", "--dataset", "gsm8k", "--limit", "2", "--max-new-tokens", "2",
            "--out", str(out), "--no-progress"]
    real, calls = SpecDecoder.generate, []

    def interrupted_on_the_second_prompt(self, prompt_ids, max_new_tokens, eos_id=None):
        calls.append(1)
        if len(calls) == 3:  # warm-up, first prompt, then Ctrl-C
            raise KeyboardInterrupt
        return real(self, prompt_ids, max_new_tokens, eos_id)

    monkeypatch.setattr(SpecDecoder, "generate", interrupted_on_the_second_prompt)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err == "specfit eval: interrupted; rerun the same command to resume\n"
    assert len(read_results(out / "results.jsonl")) == 1  # the finished prompt is kept
    monkeypatch.setattr(SpecDecoder, "generate", real)
    assert main(argv) == 0
    assert "1 new generations, 1 resumed" in capsys.readouterr().out
    assert len(read_results(out / "results.jsonl")) == 2


def test_cli_maps_only_given_flags():
    parser = build_parser()
    args = parser.parse_args(["solve", "x.json"])
    from specfit.cli import _flag_names

    names = _flag_names(parser, args)
    assert "max_nodes" not in names and names["solver"] == "--solver"


def test_negative_seed_is_one_rule(tmp_path, capsys):
    from specfit.eval.instances import generate_instances, get_preset

    with pytest.raises(SpecFitInputError, match="^seed: must be an integer >= 0"):
        next(generate_instances(get_preset("small"), [4], 1, seed=-1))
    one_line_error(capsys, ["compare-solvers", "--preset", "small", "--sizes", "4", "--count", "1", "--seed", "-1",
                            "--out", str(tmp_path / "o"), "--no-progress"], "--seed: must be an integer >= 0")
    one_line_error(capsys, ["eval", "--seed", "-1", "--out", str(tmp_path / "e")], "--seed: must be an integer >= 0")
    assert not (tmp_path / "o").exists() and not (tmp_path / "e").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--prompt-ids", ","], "--prompt-ids: must contain at least one token"),
    (["--prompt-ids", "99999"], "--prompt-ids: token ids must lie in [0, 4096)"),
    (["--prompt", ""], "--prompt: encodes to no tokens"),
])
def test_generate_prompt_errors_name_the_flag(capsys, argv, needle):
    proxy = proxy_paths()["target"]
    one_line_error(capsys, ["generate", "--model", str(proxy), "--max-new-tokens", "2", *argv], needle)


def test_unknown_names_in_lists_name_the_list_flag(tmp_path, capsys):
    one_line_error(capsys, ["eval", "--methods", "ar,nope", "--out", str(tmp_path / "e")],
                   "--methods: unknown methods 'nope'")
    one_line_error(capsys, ["compare-solvers", "--preset", "small", "--sizes", "4", "--count", "1", "--solvers",
                            "exact,simplex", "--out", str(tmp_path / "o"), "--no-progress"],
                   "--solvers: unknown solver 'simplex'")


def test_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    one_line_error(capsys, ["compare-solvers", "--preset", "small", "--sizes", "4", "--count", "1",
                            "--out", str(blocker / "out"), "--no-progress"], str(blocker))
    one_line_error(capsys, ["eval", "--methods", "ar", "--dataset", "gsm8k", "--limit", "1", "--max-new-tokens", "1",
                            "--out", str(blocker / "out"), "--no-progress"], str(blocker))


def test_generate_gpu_memory_error_names_the_flag(capsys):
    proxy = proxy_paths()["target"]
    one_line_error(capsys, ["generate", "--model", str(proxy), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                            "--gpu-memory", "lots"], "--gpu-memory: ")


def test_solve_error_shows_plain_numbers(tmp_path, capsys):
    bad = tmp_path / "inst.json"
    bad.write_text('{"parents": [-1, 0, 0], "path_prob": [1.0, 0.5, 1.5], "num_experts": 4, '
                   '"experts": [[[0]], [[1]], [[2]]], "cost": {"fixed_ms": 1, "per_node_ms": 0.1, "per_expert_ms": 0.1}}')
    err = one_line_error(capsys, ["solve", str(bad)], "path_prob[2]: must lie in [0, 1], got 1.5")
    assert "np.float" not in err


def test_an_unknown_draft_head_names_the_shipped_ones(tmp_path, capsys):
    one_line_error(capsys, ["eval", "--draft", str(tmp_path / "nosuch"), "--limit", "1", "--out", str(tmp_path / "out")],
                   "--draft: no EAGLE-3 head (config.json) in", "name a shipped head: lite (default), strong")
    # refused even when no method drafts (it was silently ignored: the summary named head `None`)
    one_line_error(capsys, ["eval", "--draft", str(tmp_path / "nosuch"), "--methods", "ar", "--limit", "1",
                            "--out", str(tmp_path / "out")], "--draft: no EAGLE-3 head (config.json) in")
    assert not (tmp_path / "out").exists()


def test_an_out_folder_that_cannot_be_created_is_out_s_error(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    one_line_error(capsys, ["eval", "--methods", "ar", "--limit", "1", "--no-progress", "--out", str(blocker / "sub")],
                   "--out: cannot create the folder", str(blocker / "sub"))
