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
from specfit.core.io import FLOAT_DIGITS, atomic_write_text, dumps, json_ready
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


def _significant_digits(x: float) -> int:
    """Significant decimal digits of ``x`` as Python prints it (``repr``)."""
    return len(repr(abs(x)).split("e")[0].replace(".", "").strip("0"))


def test_dumps_digits_drops_binary_round_off_only():
    obj = {"sum": 0.1 + 0.2, "ms": 12.0 + 4 * 0.3 + 5 * 0.19, "third": 1 / 3, "big": 2.0 ** 70, "nan": math.nan,
           "ids": [1, 2], "flag": True}
    assert dumps(obj).startswith('{"sum": 0.30000000000000004, "ms": 14.149999999999999')  # repr: full precision
    got = _strict(dumps(obj, digits=FLOAT_DIGITS))
    assert got == {"sum": 0.3, "ms": 14.15, "third": 0.333333333333333, "big": 1.18059162071741e+21, "nan": None,
                   "ids": [1, 2], "flag": True}
    for key in ("sum", "ms", "third", "big"):  # within 5e-15 of the value, DBL_DIG = 15 digits
        assert math.isclose(got[key], obj[key], rel_tol=5e-15) and _significant_digits(got[key]) <= 15


def test_solve_json_prints_each_float_at_its_precision(tmp_path, capsys):
    """The README's instance: T = 12 + 4 * 0.3 + 5 * 0.19 ms is 14.149999999999999 in binary; ``--json``
    prints 14.15, every computed float within 5e-15 of the API's (a reader may compare solvers' values),
    and ``solve_ms`` to the timer's resolution (1 ns on Linux)."""
    import time

    import specfit

    obj = {"parents": [-1, 0, 0, 1], "path_prob": [1.0, 0.6, 0.3, 0.42], "num_experts": 16,
           "experts": [[[3, 9], [1, 4]], [[3, 5], [1, 4]], [[2, 9], [6, 4]], [[3, 9], [1, 7]]],
           "cache": [[3], [4, 7]], "cost": {"fixed_ms": 12.0, "per_node_ms": 0.3, "per_expert_ms": 0.19}}
    path = tmp_path / "i.json"
    path.write_text(json.dumps(obj))
    api = specfit.select(specfit.load_instance(path), rate=50.0).to_json()
    assert api["predicted_ms"] == 14.149999999999999  # the round-off this is about
    assert main(["solve", str(path), "--rate", "50", "--json"]) == 0
    sel = _strict(capsys.readouterr().out)
    assert set(sel) == set(api) and sel["nodes"] == api["nodes"] and sel["predicted_ms"] == 14.15
    for key in ("expected_tokens", "predicted_ms", "throughput", "rate"):
        assert type(sel[key]) is float and _significant_digits(sel[key]) <= FLOAT_DIGITS, (key, sel[key])
        assert math.isclose(sel[key], api[key], rel_tol=5e-15), key
    decimals = round(-math.log10(time.get_clock_info("perf_counter").resolution * 1e3))
    assert type(sel["solve_ms"]) is float and sel["solve_ms"] == round(sel["solve_ms"], decimals) > 0


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
