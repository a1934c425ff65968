"""The public API: the lazy `specfit` facade (no torch for the solver layer), one version for the
package, its metadata and `specfit --version`, the py.typed marker, `evaluate`, and the CLI as a
thin wrapper over the public functions."""

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import json

import pytest

import specfit
import specfit.solvers
from specfit.cli import main as cli_main
from specfit.core.errors import SpecFitInputError

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_import_specfit_and_the_solver_layer_import_no_torch():
    code = ("import sys, specfit\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'import specfit'\n"
            "for name in ('SpecFitInputError', 'DraftTree', 'CostModel', 'get_profile', 'Selection', "
            "'available_solvers', '__version__'):\n"
            "    getattr(specfit, name)\n"
            "assert 'torch' not in sys.modules, 'solver layer'\n"
            "assert 'SpecFit' not in vars(specfit), 'loaded eagerly'\n"
            "specfit.SpecFit\n"
            "assert 'torch' in sys.modules\n")
    res = _python(code)
    assert res.returncode == 0, res.stderr


def test_select_imports_no_torch():
    res = _python("import sys, specfit\nspecfit.select\nassert 'torch' not in sys.modules\n")
    if "AttributeError" in res.stderr:
        raise AttributeError(res.stderr.strip().splitlines()[-1])
    assert res.returncode == 0, res.stderr


def test_select_is_the_solver_layers_select():
    assert specfit.select is specfit.solvers.select


def test_every_public_name_resolves():
    assert set(specfit.__all__) <= set(dir(specfit))
    for name in specfit.__all__:
        assert getattr(specfit, name) is not None, name
    assert specfit.SpecFitInputError is SpecFitInputError
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        specfit.nope  # noqa: B018


def test_version_has_one_source():
    res = subprocess.run([sys.executable, "-m", "specfit", "--version"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == f"specfit {specfit.__version__}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "specfit.__version__"}
    # the installed metadata is built from the same attribute (reinstall after a version bump)
    assert importlib.metadata.version("specfit") == specfit.__version__
    assert f"## {specfit.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_py_typed_is_shipped():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["specfit"]
    assert (Path(specfit.__file__).parent / "py.typed").is_file()


def test_evaluate_takes_the_cli_settings(monkeypatch):
    from specfit.eval import run

    seen = {}
    monkeypatch.setattr(run, "run_eval", lambda config, progress: seen.update(config=config, progress=progress))
    run.evaluate(datasets="gsm8k, cnndm", methods=["ar", "specfit"], limit=2)
    assert seen["config"] == run.EvalConfig(datasets=("gsm8k", "cnndm"), methods=("ar", "specfit"), limit=2)
    assert seen["progress"] is False
    with pytest.raises(TypeError, match="'limt'"):
        run.evaluate(limt=2)


def test_evaluate_rejects_bad_settings_before_writing(tmp_path):
    with pytest.raises(SpecFitInputError, match="method"):
        specfit.evaluate(methods="ar,nope", out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_cli_eval_calls_evaluate(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return {"markdown": "FULL TABLE\n", "table": "TABLE\n", "paths": {"results": tmp_path / "r"}, "ran": 1,
                "skipped": 0}

    monkeypatch.setattr(specfit, "evaluate", fake)
    assert cli_main(["eval", "--dataset", "gsm8k", "--limit", "2", "--methods", "ar,specfit", "--no-progress"]) == 0
    assert seen["datasets"] == "gsm8k" and seen["methods"] == "ar,specfit" and seen["limit"] == 2
    assert seen["progress"] is False and capsys.readouterr().out.startswith("TABLE\n")


def test_cli_generate_calls_specfit(monkeypatch, capsys):
    calls = []

    class Fake:
        @classmethod
        def from_pretrained(cls, target_dir, **kwargs):
            calls.append(("load", target_dir, kwargs))
            return cls()

        def generate(self, prompt, **kwargs):
            calls.append(("generate", prompt, kwargs))
            return type("Out", (), {"to_json": lambda self: {"output_ids": [7], "text": "x"}})()

    monkeypatch.setattr(specfit, "SpecFit", Fake)
    assert cli_main(["generate", "--model", "M", "--prompt-ids", "1,2", "--max-new-tokens", "3",
                     "--gpu-memory", "2GiB", "--json"]) == 0
    assert calls[0] == ("load", "M", dict(cache_slots=None, gpu_memory_bytes="2GiB", eviction="lru", device="cpu",
                                           dtype=None, offload="transfer"))
    assert calls[1] == ("generate", [1, 2], dict(method="ar", max_new_tokens=3))
    assert capsys.readouterr().out.strip() == '{"output_ids": [7], "text": "x"}'


def test_select_takes_an_instance_with_its_own_cost_cache_and_budgets(tmp_path):
    from specfit.core.instance import load_instance
    from specfit.solvers import get_solver

    path = tmp_path / "inst.json"
    path.write_text(json.dumps({"parents": [-1, 0, 0, 1], "path_prob": [1.0, 0.6, 0.3, 0.42], "num_experts": 16,
                                "experts": [[[3, 9], [1, 4]], [[3, 5], [1, 4]], [[2, 9], [6, 4]], [[3, 9], [1, 7]]],
                                "cache": [[3], [4, 7]],
                                "cost": {"fixed_ms": 12.0, "per_node_ms": 0.3, "per_expert_ms": 0.19}}))
    inst = load_instance(path)
    assert specfit.select(inst).nodes == get_solver("exact").solve(inst).nodes
    assert specfit.select(inst, max_nodes=1).nodes == (0,)
    with pytest.raises(SpecFitInputError) as info:
        specfit.select(inst, "qwen3-30b-a3b-pcie4")
    assert info.value.field == "cost"
    with pytest.raises(SpecFitInputError) as info:
        specfit.select(inst, solver="scan", time_limit_s=1.0)
    assert info.value.field == "time_limit_s"


def test_cli_solve_calls_select(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake(instance, **kwargs):
        seen.update(kwargs)
        return type("Sel", (), {"to_json": lambda self: {"nodes": [0]}})()

    monkeypatch.setattr(specfit, "select", fake)
    monkeypatch.setattr(specfit, "load_instance", lambda path: path)
    assert cli_main(["solve", "X.json", "--solver", "scan", "--max-nodes", "2", "--json"]) == 0
    assert seen == dict(solver="scan", max_nodes=2, rate=None, time_limit_s=None)
    assert json.loads(capsys.readouterr().out) == {"nodes": [0]}
