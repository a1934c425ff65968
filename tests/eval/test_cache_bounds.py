"""True-future cache bounds on an eval run (eval/cache_bounds.py): the LRU replay is the run's ar, Belady the least."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specfit.core.errors import SpecFitInputError
from specfit.eval.run import evaluate
from specfit.eval.cache_bounds import belady_demand, main, replay, run_bounds, run_folders
from specfit.eval.records import read_results


@pytest.fixture(scope="module")
def sweep(tiny, tmp_path_factory):  # noqa: F811
    """A 2-size sweep of ar and ar+lookahead on the tiny target (16 experts, top-4): 2 GSM8K prompts x 8 tokens."""
    out = tmp_path_factory.mktemp("bounds") / "sweep"
    evaluate(model=str(tiny / "target"), draft=str(tiny / "head"), datasets="gsm8k", limit=2,
             methods="ar,ar+lookahead", max_new_tokens=8, cache_slots="5,8", eviction="lookahead", out=str(out))
    return out


def test_lru_replay_is_the_runs_ar_miss_for_miss_and_belady_is_least(sweep):
    folders = run_folders(sweep)
    assert [f.name for f in folders] == ["slots-5", "slots-8"]
    for folder in folders:
        res = run_bounds(folder, horizons=(1, 4), decay=0.5)
        ar = [r for r in read_results(folder / "results.jsonl") if r.method == "ar"]
        v = res["datasets"]["gsm8k"]
        assert v["lru_equals_ar"] and v["prompts"] == 2
        pol = v["policies"]
        assert pol["LRU"]["misses"] == sum(r.experts_transferred for r in ar) > 0
        assert pol["LRU"]["per_token"] == pytest.approx(v["methods"]["ar"]["experts_per_token"])
        assert pol["LRU"]["hit_rate"] == pytest.approx(v["methods"]["ar"]["cache_hit_rate"])
        assert pol["LRU"]["modeled_tokens_per_s"] == pytest.approx(v["methods"]["ar"]["modeled_tokens_per_s"])
        for name in ("true next 1, 0.5^j", "true next 4, 0.5^j", "LRU"):
            assert pol["Belady"]["misses"] <= pol[name]["misses"]
            assert pol["Belady"]["modeled_tokens_per_s"] >= pol[name]["modeled_tokens_per_s"]


def test_belady_demand_evicts_the_farthest_next_use():
    # one layer, 4 experts, 2 slots, one expert per forward: 0 1 2 0 1 ... Belady keeps the nearer reuse
    decode = np.array([0, 1, 2, 0, 2, 1, 0])[:, None, None]
    lru = replay(None, decode, 4, 2).sum()
    opt = replay(None, decode, 4, 2, belady_demand(decode, 4)).sum()
    brute = min_misses(decode[:, 0, 0].tolist(), 2)
    assert opt == brute < lru


def min_misses(seq, slots):
    """Fewest misses of any eviction on a request sequence (exhaustive over the victims)."""
    def go(i, cache):
        if i == len(seq):
            return 0
        e = seq[i]
        if e in cache:
            return go(i + 1, cache)
        if len(cache) < slots:
            return 1 + go(i + 1, cache | {e})
        return 1 + min(go(i + 1, (cache - {v}) | {e}) for v in cache)
    return go(0, frozenset())


def test_cli_prints_one_row_per_size_and_writes_json(sweep, tmp_path, capsys):
    path = tmp_path / "bounds.json"
    assert main([str(sweep), "--horizons", "2", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| gsm8k |")]
    assert [r.split("|")[2].strip() for r in rows] == ["5", "8"]
    assert "| ar | ar+lookahead | true next 2, 0.5^j | Belady |" in text
    doc = json.loads(path.read_text())
    assert [r["slots"] for r in doc[str(sweep)]] == [5, 8]


def test_a_folder_without_ar_is_refused(sweep, tmp_path):
    bad = tmp_path / "run"
    bad.mkdir()
    (bad / "config.json").write_text((sweep / "slots-5" / "config.json").read_text())
    lines = (sweep / "slots-5" / "results.jsonl").read_text().splitlines(keepends=True)
    (bad / "results.jsonl").write_text("".join(x for x in lines if json.loads(x)["method"] != "ar"))
    with pytest.raises(SpecFitInputError, match="no 'ar' record"):
        run_bounds(bad)
