"""The realism report: routing statistics on hand-made traces, and the report on the shipped proxy (small setting)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specfit.eval import realism
from specfit.eval.realism import acceptance, cache_hit_rate, experts_covering, overlap_at_lag, reuse_within

# one layer, top-2, one prompt of 5 tokens
ROUTING = np.array([[[0, 1]], [[1, 2]], [[1, 2]], [[3, 4]], [[0, 1]]])
OFFSETS = np.array([0, 5])


def test_overlap_at_lag_counts_shared_experts_within_a_prompt():
    # lag 1: {1} of (1,2), {1,2} of (1,2), {} of (3,4), {} of (0,1) -> 3 / 8
    assert overlap_at_lag(ROUTING, OFFSETS, 1).tolist() == [3 / 8]
    # lag 2: (1,2)v(0,1): 1, (3,4)v(1,2): 0, (0,1)v(1,2): 1 -> 2 / 6
    assert overlap_at_lag(ROUTING, OFFSETS, 2).tolist() == [2 / 6]
    # a prompt boundary is never crossed: split after token 2, lag 1 loses the (1,2)->(1,2) pair
    assert overlap_at_lag(ROUTING, np.array([0, 2, 5]), 1).tolist() == [1 / 6]
    assert np.isnan(overlap_at_lag(ROUTING, np.array([0, 2, 4, 5]), 2)).all()


def test_reuse_within_looks_back_a_window():
    # window 8 (whole prompt): token1 {1}, token2 {1,2}, token3 {}, token4 {0,1} -> 5 / 8
    assert reuse_within(ROUTING, OFFSETS, 8).tolist() == [5 / 8]
    assert reuse_within(ROUTING, OFFSETS, 1).tolist() == overlap_at_lag(ROUTING, OFFSETS, 1).tolist()


def test_lru_and_lfu_differ_where_they_should():
    # 2 slots, top-1: a a b c a -> LRU: a(miss) a(hit) b(miss) c(miss, evicts a) a(miss) = 1 hit
    # LFU keeps a (used twice) and evicts b: a a b c a -> hits: a, a = 2
    r = np.array([0, 0, 1, 2, 0])[:, None, None]
    assert cache_hit_rate(r, 4, 2, "lru").tolist() == [1 / 5]
    assert cache_hit_rate(r, 4, 2, "lfu").tolist() == [2 / 5]
    assert cache_hit_rate(ROUTING, 8, 8, "lru").tolist() == [5 / 10]  # everything fits: only first uses miss


def test_experts_covering_mass():
    r = np.array([0, 0, 0, 0, 0, 0, 1, 1, 2, 3])[:, None, None]  # shares .6 .2 .1 .1
    assert experts_covering(r, 4, 0.5).tolist() == [1]
    assert experts_covering(r, 4, 0.9).tolist() == [3]
    assert experts_covering(r, 4, 0.8).tolist() == [2]


def test_acceptance_by_depth_from_records():
    recs = [{"dataset": "gsm8k", "accept_lengths": [0, 2, 3], "new_tokens": 8},
            {"dataset": "gsm8k", "accept_lengths": [1], "new_tokens": 2}]
    a = acceptance(recs, 4)["gsm8k"]
    assert a["tau"] == pytest.approx(1 + 6 / 4)
    assert a["accept_by_depth"] == [0.75, 0.5, 0.25, 0.0]
    assert a["cycles"] == 4 and a["new_tokens"] == 10


def test_report_on_the_shipped_proxy_small_setting(tmp_path, capsys):
    out = tmp_path / "realism.json"
    assert realism.main(["--train-prompts", "2", "--eval-prompts", "2", "--max-tokens", "24", "--tau-prompts", "1",
                         "--max-new-tokens", "6", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert not list(tmp_path.glob(".*tmp*"))  # written through a temporary file and a rename
    assert rep["draft"].endswith("eagle3-lite")  # the default head of specfit eval
    L = rep["num_layers"]
    for key, values in rep["routing"].items():
        assert len(values) == L, key
    assert all(0 <= v <= 1 for v in rep["routing"]["lru_0.5"]) and len(rep["recall_per_layer"]) == L
    # more cache never hurts LRU on the same stream
    assert np.all(np.array(rep["routing"]["lru_0.5"]) >= np.array(rep["routing"]["lru_0.125"]))
    assert set(rep["acceptance"]) == {"gsm8k", "cnndm"} and rep["acceptance"]["gsm8k"]["tau"] >= 1
    # every row cites a source or says none was found, and states a bias
    for row in rep["rows"]:
        assert (row["public"] == "not found") == (row["source"] == "")
        assert row["bias"]
        assert row["source"] == "" or row["source"].startswith("https://")
    text = capsys.readouterr().out
    assert "| statistic |" in text and "not found" in text and "kekzl/imp" in text


def test_bad_numbers_are_refused(tmp_path):
    from specfit.core.errors import SpecFitInputError

    with pytest.raises(SpecFitInputError, match="n_eval"):
        realism.run(n_eval=0)
    with pytest.raises(SpecFitInputError, match="--draft"):
        realism.run(draft=tmp_path / "missing", n_eval=1)
