"""Behaviour pinned: on fixed prompts the engine makes the decisions, verifies the nodes and commits the
tokens that the golden records say (``golden/cycles.json``, written by ``golden/make_cycles.py``).

Both shipped heads, expert caches of 16, 32 and every slot, the methods ``ar``, ``eagle3``,
``eagle3-scan``, ``specfit`` and ``oracle``; every non-timing field of every cycle record is compared
(floats to 1e-9 relative). The engine runs with a frozen clock
(:class:`specfit.engine.clock.FrozenClock`): measured host time feeds its decisions, so with the
machine's clocks two runs of the same prompts may decide differently.
"""

import json
import math
from pathlib import Path

import pytest

GOLDEN = Path(__file__).with_name("golden")


def _load_generator():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_cycles", GOLDEN / "make_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _diff(expected, got, where: str) -> list[str]:
    """Where ``got`` differs from ``expected`` (floats to 1e-9 relative), as readable lines."""
    if isinstance(expected, float) or isinstance(got, float):
        ok = (expected is not None and got is not None
              and math.isclose(expected, got, rel_tol=1e-9, abs_tol=1e-9))
        return [] if ok else [f"{where}: {expected!r} != {got!r}"]
    if isinstance(expected, dict) and isinstance(got, dict):
        if set(expected) != set(got):
            return [f"{where}: fields {sorted(expected)} != {sorted(got)}"]
        return [line for k in expected for line in _diff(expected[k], got[k], f"{where}.{k}")]
    if isinstance(expected, list) and isinstance(got, list):
        if len(expected) != len(got):
            return [f"{where}: length {len(expected)} != {len(got)}"]
        return [line for i, (e, g) in enumerate(zip(expected, got)) for line in _diff(e, g, f"{where}[{i}]")]
    return [] if expected == got else [f"{where}: {expected!r} != {got!r}"]


@pytest.mark.slow
def test_cycle_records_equal_the_golden_ones(one_torch_thread):
    gen = _load_generator()
    golden = json.loads((GOLDEN / "cycles.json").read_text())
    assert golden["new_tokens"] == gen.NEW_TOKENS and golden["prompts"] == list(gen.PROMPTS)
    settings = gen.generate_all()
    assert len(settings) == len(golden["settings"]) == 30
    diffs = []
    for want, got in zip(golden["settings"], settings):
        where = f"{want['head']}/{want['cache_slots']}/{want['method']}"
        diffs += _diff(want, got, where)
    assert not diffs, f"{len(diffs)} differences, first ones:\n" + "\n".join(diffs[:20])


def test_the_comparison_sees_a_changed_decision():
    """The comparison is not vacuous: one changed decision, count or float is reported."""
    rec = {"decision": "draft", "nodes_verified": 3, "expected_tokens": 1.5, "transferred": [1, 2]}
    assert not _diff(rec, dict(rec), "r")
    assert _diff(rec, {**rec, "decision": "ar"}, "r") == ["r.decision: 'draft' != 'ar'"]
    assert _diff(rec, {**rec, "nodes_verified": 4}, "r")
    assert _diff(rec, {**rec, "expected_tokens": 1.5 + 1e-6}, "r")
    assert _diff(rec, {**rec, "transferred": [1, 3]}, "r")
    assert not _diff(rec, {**rec, "expected_tokens": 1.5 + 1e-12}, "r")
