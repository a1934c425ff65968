"""Reproducible modeled figures: two runs of one `specfit eval` command (the shipped proxy with its lite
head, 2 prompts x 8 tokens) give identical modeled tokens/s and identical records but for this machine's
timings, because the engine's host work is priced from its counts (the counted clock, the default on the
CPU); the run records its clock, and a run on another clock does not resume into its folder."""

import json

import pytest

from specfit.core.errors import SpecFitInputError
from specfit.core.host_cost import HOST_COSTS
from specfit.eval.run import evaluate, read_results

#: Record fields that are this machine's timings.
TIMING = ("wall_s", "prefill_s", "measured_ms")


def run(out, **kw):
    opts = dict(datasets="gsm8k", limit=2, methods="ar,specfit", max_new_tokens=8, out=str(out))
    return evaluate(**{**opts, **kw})


@pytest.mark.slow
def test_two_runs_of_one_command_give_the_same_modeled_figures(tmp_path):
    first, second = run(tmp_path / "a"), run(tmp_path / "b")
    rows = [[(r.method, r.modeled_tokens_per_s, r.tau, r.host_ms_per_token) for r in res["rows"]]
            for res in (first, second)]
    assert rows[0] == rows[1]
    recs = [[{k: v for k, v in r.to_json().items() if k not in TIMING} for r in read_results(d / "results.jsonl")]
            for d in (tmp_path / "a", tmp_path / "b")]
    assert recs[0] == recs[1]
    spec = [r for r in read_results(tmp_path / "a" / "results.jsonl") if r.method == "specfit"]
    assert all(r.modeled["host_ms"] > 0 for r in spec)  # priced, not frozen at 0
    assert all(r.measured_ms["host_thread"] > 0 for r in spec)  # this machine's, reported beside
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert cfg["clock"] == summary["clock"] == "counted" and summary["host_costs"] == HOST_COSTS.to_json()
    with pytest.raises(SpecFitInputError) as e:  # learned on the counted clock: a measured run does not resume there
        run(tmp_path / "a", clock="measured")
    assert e.value.field == "out" and "clock" in e.value.rule


def test_an_unknown_clock_is_refused_naming_the_field(tmp_path):
    with pytest.raises(SpecFitInputError) as e:
        run(tmp_path / "x", clock="frozen")
    assert e.value.field == "clock"
    assert not (tmp_path / "x").exists()
