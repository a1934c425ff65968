"""Every ```python block of README.md runs: each in a fresh interpreter, from the repository root, so
the documented API cannot drift from the code."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.M | re.S)


def test_the_readme_has_python_snippets():
    assert len(BLOCKS) >= 3
    assert any("specfit.select(" in b for b in BLOCKS) and any("SpecFit.from_pretrained(" in b for b in BLOCKS)
    assert any("specfit.evaluate(" in b for b in BLOCKS)
    for block in BLOCKS:  # "under ten lines": the code, imports and blank lines aside
        code = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith(("import ", "from "))]
        assert len(code) < 10, block


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_snippet_runs(block):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # a shared CI machine
    res = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"README snippet failed:\n{block}\n--- stderr ---\n{res.stderr[-3000:]}"
    assert res.stdout.strip(), "every snippet prints its result"


COMMANDS = [ln.split("  #")[0].strip() for b in re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"),
                                                           re.M | re.S)
            for ln in b.splitlines() if ln.startswith("specfit ")]
DEMO = re.search(r"^DEMO := (.*)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M).group(1)


def test_readme_commands_parse_and_each_eval_gets_its_own_folder(monkeypatch):
    """Every ``specfit`` command of the README parses, and the evaluations it suggests after ``make demo``
    write to folders of their own, so they run one after another without an ``--out`` refusal."""
    import shlex
    from dataclasses import fields

    import specfit
    from specfit.cli import build_parser, main
    from specfit.eval.run import EvalConfig, default_out

    assert any(c.startswith("specfit eval") for c in COMMANDS) and any(c.startswith("specfit generate") for c in COMMANDS)
    seen = []

    def fake(**kwargs):
        seen.append(kwargs)
        return {"table": "", "paths": {}, "ran": 0, "skipped": 0}

    monkeypatch.setattr(specfit, "evaluate", fake)
    for cmd in COMMANDS + [f"specfit {DEMO}"]:
        args = shlex.split(cmd)[1:]
        build_parser().parse_args(args)  # exits 2 on a flag the parser does not take
        if args[0] == "eval":
            assert main(args) == 0, cmd
    folders = []
    names = {f.name for f in fields(EvalConfig)}
    for kw in seen:
        opts = {k: v for k, v in kw.items() if k in names and k != "out"}
        for k in ("datasets", "methods"):
            opts[k] = tuple(opts[k].split(","))
        sweep = "," in str(opts["cache_slots"])
        folders.append(kw["out"] or default_out(EvalConfig(**opts), sweep=sweep))
    assert len(folders) == len(set(folders)) >= 4, folders


def test_readme_solve_example_runs(tmp_path, capsys):
    """The README's instance (a heredoc) solves with the command it shows, on its own cost model."""
    import json

    from specfit.cli import main

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    instance = re.search(r"<<'JSON'\n(.*?)^JSON$", text, re.M | re.S).group(1)
    cmd = next(c for c in COMMANDS if c.startswith("specfit solve"))
    path = tmp_path / "inst.json"
    path.write_text(instance, encoding="utf-8")
    assert main([a if a != "/tmp/inst.json" else str(path) for a in cmd.split()[1:]]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "optimal" and out["nodes"][0] == 0 and out["throughput"] > 0
    assert abs(out["throughput"] - 1000 * out["expected_tokens"] / out["predicted_ms"]) < 1e-6
