"""One test per input-validation rule (SPECFIT.md §4), through the API and through ``specfit solve``.

Bad input must raise :class:`SpecFitInputError` naming the field; the command must exit with code 2,
print one line on stderr that names the field, no traceback, and nothing on stdout.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest

from specfit.solvers import available_solvers, get_solver
from specfit.cli import main
from specfit.core.errors import SpecFitInputError
from specfit.core.instance import Instance, load_instance

VALID = {
    "parents": [-1, 0, 0, 1],
    "path_prob": [1.0, 0.6, 0.3, 0.42],
    "num_experts": 8,
    "experts": [[[3, 5], [1, 4]], [[3, 6], [4, 7]], [[2, 5], [1, 4]], [[3, 6], [0, 7]]],
    "cache": [[3], [4, 7]],
    "cost": {"fixed_ms": 12.0, "per_node_ms": 0.3, "per_expert_ms": 0.19},
    "max_nodes": None,
    "max_new_experts_per_layer": None,
}


def _set(path, value):
    def mutate(obj):
        *head, last = path
        for key in head:
            obj = obj[key]
        obj[last] = value
    return mutate


def _delete(*path):
    def mutate(obj):
        *head, last = path
        for key in head:
            obj = obj[key]
        del obj[last]
    return mutate


# (rule, mutation of VALID, field the error must name)
CASES = [
    ("cycle", _set(["parents"], [-1, 0, 3, 2]), "parents[2]"),
    ("parent >= own index", _set(["parents"], [-1, 0, 0, 3]), "parents[3]"),
    ("parents[0] != -1", _set(["parents"], [0, 0, 0, 1]), "parents[0]"),
    ("second root", _set(["parents"], [-1, -1, 0, 1]), "parents[1]"),
    ("probability above 1", _set(["path_prob", 2], 1.3), "path_prob[2]"),
    ("probability below 0", _set(["path_prob", 2], -0.1), "path_prob[2]"),
    ("NaN probability", _set(["path_prob", 1], math.nan), "path_prob[1]"),
    ("path_prob[0] != 1", _set(["path_prob", 0], 0.9), "path_prob[0]"),
    ("increasing path probability", _set(["path_prob", 3], 0.7), "path_prob[3]"),
    ("path_prob length", _set(["path_prob"], [1.0, 0.6, 0.3]), "path_prob"),
    ("ragged layers", _set(["experts", 2], [[2, 5]]), "experts[2]"),
    ("ragged top-k", _set(["experts", 1, 0], [3]), "experts[1][0]"),
    ("expert id out of range", _set(["experts", 1, 1], [1, 8]), "experts[1][1]"),
    ("negative expert id", _set(["experts", 3, 0], [-1, 6]), "experts[3][0]"),
    ("num_experts < 1", _set(["num_experts"], 0), "num_experts"),
    ("empty expert lists", _set(["experts"], [[[], []]] * 4), "experts"),
    ("cache id out of range", _set(["cache", 1], [4, 9]), "cache[1]"),
    ("cache layers", _set(["cache"], [[3]]), "cache"),
    ("negative cost", _set(["cost", "per_node_ms"], -0.1), "cost.per_node_ms"),
    ("negative per-layer cost", _set(["cost", "per_expert_ms"], [0.2, -1.0]), "cost.per_expert_ms[1]"),
    ("NaN cost", _set(["cost", "fixed_ms"], math.nan), "cost.fixed_ms"),
    ("per-layer cost length", _set(["cost", "per_expert_ms"], [0.2, 0.2, 0.2]), "cost.per_expert_ms"),
    ("missing field", _delete("experts"), "experts"),
    ("missing cost field", _delete("cost", "fixed_ms"), "cost.fixed_ms"),
    ("unknown field", _set(["verify_width"], 4), "verify_width"),
    ("unknown cost field", _set(["cost", "per_token_ms"], 1.0), "cost.per_token_ms"),
    ("infeasible max_nodes", _set(["max_nodes"], 0), "max_nodes"),
    ("infeasible expert budget", _set(["max_new_experts_per_layer"], 0), "max_new_experts_per_layer"),
    ("non-integer budget", _set(["max_nodes"], "3"), "max_nodes"),
]


def _bad(mutate) -> dict:
    obj = copy.deepcopy(VALID)
    mutate(obj)
    return obj


def _cli(capsys, argv) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_one_line_error(rc: int, out: str, err: str, field: str) -> None:
    assert rc == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"specfit solve: error: {field}: "), err
    assert "Traceback" not in err


def test_valid_instance_loads():
    inst = Instance.from_json(copy.deepcopy(VALID))
    assert inst.n == 4 and inst.num_layers == 2


@pytest.mark.parametrize("rule,mutate,field", CASES, ids=[c[0] for c in CASES])
def test_rule_through_api(rule, mutate, field):
    with pytest.raises(SpecFitInputError) as info:
        Instance.from_json(_bad(mutate))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize("rule,mutate,field", CASES, ids=[c[0] for c in CASES])
def test_rule_through_cli(rule, mutate, field, tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_bad(mutate)))
    _assert_one_line_error(*_cli(capsys, ["solve", str(path), "--solver", "greedy", "--json"]), field)


@pytest.mark.parametrize("content,rule", [('{"parents": [-1, 0,', "not valid JSON"), (None, "cannot read")],
                         ids=["bad JSON", "missing file"])
def test_unreadable_instance_file(content, rule, tmp_path, capsys):
    path = tmp_path / "instance.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpecFitInputError, match=rule) as info:
        load_instance(path)
    assert info.value.field == "instance"
    _assert_one_line_error(*_cli(capsys, ["solve", str(path), "--json"]), "instance")


def test_not_an_object(tmp_path, capsys):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    _assert_one_line_error(*_cli(capsys, ["solve", str(path), "--json"]), "instance")


def test_unknown_solver(tmp_path, capsys):
    with pytest.raises(SpecFitInputError, match="unknown solver") as info:
        get_solver("simplex")
    assert info.value.field == "solver"
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(VALID))
    _assert_one_line_error(*_cli(capsys, ["solve", str(path), "--solver", "simplex", "--json"]), "--solver")  # the flag on the command line


# the command line names its flags (flag names on the command line, field names in the API)
@pytest.mark.parametrize("argv,field", [(["--max-nodes", "0"], "--max-nodes"), (["--max-nodes", "-1"], "--max-nodes"),
                                        (["--rate", "-5"], "--rate"), (["--rate", "nan"], "--rate"),
                                        (["--solver", "cpsat", "--time-limit", "0"], "--time-limit"),
                                        (["--solver", "greedy", "--time-limit", "3"], "--time-limit")])
def test_bad_command_line_options(argv, field, tmp_path, capsys):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(VALID))
    _assert_one_line_error(*_cli(capsys, ["solve", str(path), "--json", *argv]), field)


@pytest.mark.parametrize("solver", available_solvers())
def test_success_prints_one_selection_object(solver, tmp_path, capsys):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(VALID))
    rc, out, err = _cli(capsys, ["solve", str(path), "--solver", solver, "--json"])
    assert rc == 0 and err == ""
    assert out.count("\n") == 1
    sel = json.loads(out)
    assert {"solver", "nodes", "expected_tokens", "predicted_ms", "throughput", "solve_ms"} <= set(sel)
    assert sel["solver"] == solver
    assert sel["nodes"] == sorted(sel["nodes"]) and sel["nodes"][0] == 0
    assert math.isclose(sel["throughput"], 1000.0 * sel["expected_tokens"] / sel["predicted_ms"], rel_tol=1e-12)


def test_command_end_to_end_in_a_fresh_process(tmp_path):
    good, bad = tmp_path / "ok.json", tmp_path / "bad.json"
    good.write_text(json.dumps(VALID))
    bad.write_text(json.dumps(_bad(_set(["path_prob", 1], math.nan))))
    ok = subprocess.run([sys.executable, "-m", "specfit", "solve", str(good), "--json"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["nodes"][0] == 0
    fail = subprocess.run([sys.executable, "-m", "specfit", "solve", str(bad), "--json"], capture_output=True, text=True)
    assert fail.returncode == 2 and fail.stdout == ""
    assert fail.stderr.count("\n") == 1 and "path_prob[1]" in fail.stderr and "Traceback" not in fail.stderr
