"""Output a strict reader takes: strict JSON (no NaN/Infinity), a closed pipe ends quietly, one
stderr line per refusal (third-party warnings silenced), and a failed write under ``--out`` is
reported as ``--out`` and the file asked for, never a temporary file's name."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specfit.cli import main
from specfit.core.io import atomic_write_text, dumps, json_ready
from specfit.models.proxy import paths as proxy_paths

INSTANCE = {"parents": [-1, 0, 0], "path_prob": [1.0, 0.6, 0.3], "num_experts": 4,
            "experts": [[[0]], [[1]], [[2]]], "cache": [[0]],
            "cost": {"fixed_ms": 5.0, "per_node_ms": 0.3, "per_expert_ms": 0.2}}


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_dumps_writes_strict_json():
    obj = {"a": float("nan"), "b": [1.0, float("inf"), (float("-inf"), 2)], "c": "x"}
    text = dumps(obj)
    assert _strict(text) == {"a": None, "b": [1.0, None, [None, 2]], "c": "x"}
    import numpy as np

    assert json_ready(np.float32(np.nan)) is None and json_ready(np.int64(3)) == 3


def test_no_writer_allows_nan():
    """Every JSON/JSONL writer of the package goes through ``dumps`` (allow_nan=False)."""
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for folder in ("specfit", "eval", "solvers", "models"):
        for path in (root / folder).rglob("*.py"):
            if "proxy" in path.parts:  # the proxy's training scripts log their own runs
                continue
            text = path.read_text()
            for needle in ("json.dumps(", "json.dump("):
                if needle in text and path.name != "io.py":
                    offenders += [f"{path.relative_to(root)}:{i + 1}" for i, line in enumerate(text.splitlines())
                                  if needle in line and "allow_nan=False" not in line and "settings" not in line]
    assert not offenders, offenders


def test_solve_json_is_strict_on_extreme_accepted_costs(tmp_path, capsys):
    obj = dict(INSTANCE, cost={"fixed_ms": 1e-6, "per_node_ms": 0.0, "per_expert_ms": 1e9})
    path = tmp_path / "i.json"
    path.write_text(json.dumps(obj))
    assert main(["solve", str(path), "--json"]) == 0
    sel = _strict(capsys.readouterr().out)
    assert all(math.isfinite(v) for v in sel.values() if isinstance(v, float))


def test_closed_pipe_ends_quietly(tmp_path):
    """``specfit solve ... | head -1``: the reader is gone before the writer writes; no traceback, no
    "[Errno 32]", exit 0 or 141 (128 + SIGPIPE)."""
    path = tmp_path / "i.json"
    path.write_text(json.dumps(INSTANCE))
    for extra in ([], ["--json"]):
        proc = subprocess.Popen([sys.executable, "-m", "specfit", "solve", str(path), *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # closed before the child's first write (it takes ~1 s to start)
        err = proc.stderr.read().decode()
        rc = proc.wait()
        assert rc in (0, 141) and err == "", (rc, err)


def test_read_only_out_is_reported_as_out(tmp_path, capsys, monkeypatch):
    """A write under ``--out`` that fails names ``--out`` and the file asked for (it named the
    temporary ``.summary.json.tmp<pid>``)."""
    import specfit.core.io as io

    real = io.os.replace

    def replace(src, dst):
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(io.os, "replace", replace)
    with pytest.raises(OSError) as info:
        atomic_write_text(tmp_path / "f.json", "{}")
    assert info.value.filename == str(tmp_path / "f.json") and not list(tmp_path.iterdir())
    out = tmp_path / "o"
    rc = main(["compare-solvers", "--preset", "small", "--sizes", "3", "--count", "1", "--solvers", "exact",
               "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    monkeypatch.setattr(io.os, "replace", real)
    assert rc == 2 and err.count("\n") == 1 and "error: --out: cannot write " in err and ".tmp" not in err, err
    assert str(out) in err


def test_prompt_longer_than_the_context_is_one_line():
    """transformers' "Token indices sequence length is longer than the specified maximum" warning
    came before the error line."""
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}
    proc = subprocess.run([sys.executable, "-m", "specfit", "generate", "--model", str(proxy_paths()["target"]),
                           "--prompt", "the cat sat " * 1000, "--max-new-tokens", "1"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.count("\n") == 1 and "--max-new-tokens: the prompt" in proc.stderr, proc.stderr
