"""Evaluation metrics on hand-made traces, the modeled cycle time, the summary rows, prompt loading
and the results file's torn-line handling."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specfit.eval import metrics
from specfit.eval.datasets import load_prompts
from specfit.core.cost import PROFILES, CostModel, get_profile
from specfit.core.errors import SpecFitInputError
from specfit.engine import CycleRecord
from specfit.eval.modeled import cost_scaling_note, modeled_cycle_ms
from specfit.eval.records import ResultRecord, SummaryRow, append_result, read_results
from specfit.eval.report import summarise


def test_tau_counts_the_bonus_token():
    assert metrics.tau([0, 0, 0]) == 1.0  # AR: one token per cycle
    assert metrics.tau([3, 0, 1]) == pytest.approx((4 + 1 + 2) / 3)
    assert metrics.tau([]) == 0.0


def test_tokens_per_s_and_experts_per_token():
    assert metrics.tokens_per_s(50, 2000.0) == 25.0
    assert metrics.tokens_per_s(5, 0.0) == 0.0
    assert metrics.experts_per_token(96, 12) == 8.0
    assert metrics.experts_per_token(3, 0) == 0.0
    assert metrics.cache_hit_rate(30, 120) == 0.75
    assert metrics.cache_hit_rate(0, 0) == 0.0


@given(st.lists(st.integers(0, 6), max_size=40))
def test_acceptance_by_depth_is_a_non_increasing_survival_curve(accepts):
    curve = metrics.acceptance_by_depth(accepts, 6)
    assert len(curve) == 6
    assert all(0 <= a <= 1 for a in curve)
    assert all(a >= b for a, b in zip(curve, curve[1:]))
    if accepts:
        assert curve[0] == pytest.approx(sum(a >= 1 for a in accepts) / len(accepts))
        assert metrics.tau(accepts) == pytest.approx(1 + sum(curve))  # E[accepted] = sum_d P(accepted >= d)


def test_first_divergence():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert metrics.first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize("text, answer", [
    ("She makes 9 * 2 = $18 every day.\n#### 18", "18"),
    ("so 1,000 apples in total", "1000"),
    ("The answer is 3.50.", "3.5"),
    ("#### 7 and then 99", "7"),
    ("no digits", None),
])
def test_gsm8k_output_answer(text, answer):
    assert metrics.gsm8k_output_answer(text) == answer


def test_gsm8k_correct_uses_the_number_after_hashes():
    ref = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 1,018"
    assert metrics.gsm8k_reference_answer(ref) == "1018"
    assert metrics.gsm8k_correct("... so she makes 1018 dollars", ref)
    assert not metrics.gsm8k_correct("... so she makes 9 dollars", ref)
    assert not metrics.gsm8k_correct("1018", "no final answer marker")


def test_rouge_and_ptb_detokenisation():
    ref = "Locke 's side won on Friday . -LRB- Kilmarnock -RRB- ``fans'' cheered"
    assert metrics.detokenize_ptb(ref) == "Locke's side won on Friday. (Kilmarnock) \"fans\" cheered"
    same = metrics.rouge(metrics.detokenize_ptb(ref), ref)
    assert same == pytest.approx({"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0})
    assert metrics.rouge("completely unrelated words", ref)["rouge1"] == 0.0
    assert metrics.task_score("none", "x", "y") == {} and metrics.task_score("gsm8k", "x", None) == {}


def test_modeled_cycle_ms_by_hand():
    cost = CostModel(6.0, 0.1, 0.4, draft_level_ms=0.5).for_layers(4)  # per_expert_ms 0.4 * 48/4 = 4.8
    # host: the measured CPU ms (host_cpu_ms), not the wall-clock predict/solve ms a loaded machine inflates
    cycle = CycleRecord(nodes_verified=5, transferred=[1, 0, 2, 0], levels=3, predict_ms=20.0, solve_ms=30.0,
                        host_cpu_ms=0.5)
    got = modeled_cycle_ms(cycle, cost)
    assert got["compute_ms"] == pytest.approx(6.0 + 0.5)
    assert got["transfer_ms"] == pytest.approx(3 * 4.8)
    assert got["draft_ms"] == pytest.approx(1.5) and got["host_ms"] == pytest.approx(0.5)
    assert got["total_ms"] == pytest.approx(6.5 + 14.4 + 1.5 + 0.5)
    ahead = modeled_cycle_ms(CycleRecord(nodes_verified=5, transferred=[1, 0, 2, 0], levels=3, levels_ahead=1), cost)
    assert ahead["draft_ms"] == pytest.approx(2.0)  # the level launched ahead and not used is a head forward paid
    with pytest.raises(SpecFitInputError, match="draft_level_ms"):
        modeled_cycle_ms(cycle, CostModel(6.0, 0.1, 0.4))


def test_modeled_cycle_reads_every_routed_expert_once():
    cost = CostModel(6.0, 0.1, 0.4, draft_level_ms=0.5, read_ms=0.01).for_layers(4)  # x 48/4: 4.8 and 0.12
    cycle = CycleRecord(nodes_verified=5, transferred=[1, 0, 2, 0], true_experts=[9, 8, 12, 10], levels=3,
                        host_cpu_ms=0.5)
    got = modeled_cycle_ms(cycle, cost)
    assert got["compute_ms"] == pytest.approx(6.5)
    assert got["transfer_ms"] == pytest.approx(3 * 4.8 + 39 * 0.12)  # copies, and the reads of all 39 routed
    ar = CycleRecord(nodes_verified=1, transferred=[0, 0, 0, 0], true_experts=[8, 8, 8, 8])  # every expert resident
    assert modeled_cycle_ms(ar, cost)["total_ms"] == pytest.approx(6.1 + 32 * 0.12)


def test_every_profile_has_a_draft_level_time_and_the_note_states_the_scaling():
    assert all(p.draft_level_ms > 0 and p.reference_layers == 48 for p in PROFILES.values())
    assert all(p.for_layers(6).draft_level_ms == p.draft_level_ms for p in PROFILES.values())
    assert "48/6 = 8.00" in cost_scaling_note(6, "qwen3-30b-a3b-pcie4")
    assert "as they are" in cost_scaling_note(48, "qwen3-30b-a3b-h200")
    get_profile("qwen3-30b-a3b-h200")


def _rec(method, pid, out, accepts, wall_s, modeled_ms, transferred, looked_up, nodes):
    return ResultRecord(
        id=pid, dataset="d", method=method, task="none", prompt_tokens=3, output_ids=out, text="",
        new_tokens=len(out), committed=sum(a + 1 for a in accepts), cycles=len(accepts), accept_lengths=accepts,
        nodes_verified=nodes, levels=[0] * len(accepts), wall_s=wall_s, prefill_s=0.0, modeled_ms=modeled_ms,
        modeled={"compute_ms": modeled_ms / 2, "transfer_ms": modeled_ms / 2, "draft_ms": 0.0, "host_ms": 0.0},
        experts_transferred=transferred, experts_looked_up=looked_up,
        experts_predicted_new=transferred // 2 if method == "specfit" else 0,
        measured_ms={"solve": 1.0 if method == "specfit" else 0.0, "predict": 2.0 if method == "specfit" else 0.0,
                     "tree": 5.0 if method == "specfit" else 0.0}, score={})


def test_summary_rows_on_a_hand_made_trace():
    recs = [
        _rec("ar", "p", [1, 2, 3, 4], [0, 0, 0, 0], 2.0, 400.0, 32, 64, [1, 1, 1, 1]),
        _rec("eagle3", "p", [1, 2, 3, 4], [1, 1], 1.0, 400.0, 40, 50, [9, 9]),
        _rec("specfit", "p", [1, 2, 3, 9], [3], 1.0, 100.0, 8, 16, [5]),  # diverges at token 3
    ]
    rows = {r["method"]: r for r in summarise(recs, depth=3, temperature=0.0)}
    ar, eagle, spec = rows["ar"], rows["eagle3"], rows["specfit"]
    assert ar["tau"] == 1.0 and eagle["tau"] == 2.0 and spec["tau"] == 4.0
    assert ar["tokens_per_s"] == 2.0 and ar["modeled_tokens_per_s"] == 10.0
    assert spec["modeled_tokens_per_s"] == 40.0
    assert spec["speedup_vs_ar"] == 4.0 and spec["speedup_vs_eagle3"] == 4.0 and eagle["speedup_vs_ar"] == 1.0
    assert spec["speedup_vs_ar_wall"] == 2.0
    assert ar["experts_per_token"] == 8.0 and eagle["experts_per_token"] == 10.0 and spec["experts_per_token"] == 2.0
    assert ar["cache_hit_rate"] == 0.5 and spec["cache_hit_rate"] == 0.5
    assert eagle["mean_nodes_verified"] == 9.0
    assert spec["solve_share"] == pytest.approx(1.0 / 100.0)
    # the predictor's own ms, not the tree building's
    assert spec["predict_share"] == pytest.approx(2.0 / 100.0) and spec["solve_predict_share"] == pytest.approx(0.03)
    old = recs[2].to_json()
    del old["measured_ms"]["tree"]  # a record written before predict_ms was the predictor's alone
    rows = {r["method"]: r for r in summarise(recs[:2] + [ResultRecord.from_json(old)], depth=3, temperature=0.0)}
    assert rows["specfit"]["predict_share"] is None and rows["specfit"]["solve_predict_share"] is None
    assert spec["host_share"] == 0.0 and ar["host_share"] == 0.0  # the records' modeled host part
    assert ar["equal_to_ar"] is None and eagle["equal_to_ar"] is True
    assert spec["equal_to_ar"] is False and spec["first_divergence"] == {"p": 3}
    assert eagle["acceptance_by_depth"] == [1.0, 0.0, 0.0] and spec["acceptance_by_depth"] == [1.0, 1.0, 1.0]
    sampled = {r["method"]: r for r in summarise(recs, depth=3, temperature=0.7)}
    assert sampled["specfit"]["equal_to_ar"] is None  # outputs are compared under greedy decoding only
    # the predictor's count is reported for methods with an expert predictor only (Method.needs_predictor)
    assert spec.predicted_vs_transferred == 0.5 and eagle.predicted_vs_transferred is None
    # one schema: a row survives its JSON form
    assert SummaryRow.from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_result_record_json_round_trip_and_missing_field(tmp_path):
    rec = _rec("eagle3", "p", [1, 2], [1], 1.0, 10.0, 4, 8, [3])
    path = tmp_path / "results.jsonl"
    with open(path, "a") as f:
        append_result(f, rec)
    assert read_results(path) == [rec]
    obj = rec.to_json()
    del obj["wall_s"]
    path.write_text(json.dumps(obj) + "\n")
    with pytest.raises(SpecFitInputError) as err:
        read_results(path)
    assert err.value.field == "results.jsonl line 1.wall_s"


def test_read_results_ignores_and_repairs_a_torn_last_line(tmp_path):
    path = tmp_path / "results.jsonl"
    with open(path, "a") as f:
        append_result(f, _rec("ar", "a", [1], [0], 1.0, 1.0, 0, 0, [1]))
        append_result(f, _rec("ar", "b", [1], [0], 1.0, 1.0, 0, 0, [1]))
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"id": "c", "outp')
    assert [r.id for r in read_results(path)] == ["a", "b"]
    assert path.read_bytes() != whole  # not repaired unless asked
    assert [r.id for r in read_results(path, repair=True)] == ["a", "b"]
    assert path.read_bytes() == whole
    path.write_bytes(whole + b"not json\n")
    with pytest.raises(SpecFitInputError, match="results.jsonl"):
        read_results(path)
    assert read_results(tmp_path / "none.jsonl") == []


def test_shipped_datasets_and_templates():
    gsm = load_prompts("gsm8k", limit=2)
    assert [p.id for p in gsm] == ["gsm8k-test-0", "gsm8k-test-1"]
    assert gsm[0].text.startswith("Question: Janet") and gsm[0].text.endswith("\nAnswer:")
    assert metrics.gsm8k_reference_answer(gsm[0].reference) == "18"
    cnn = load_prompts("cnndm")
    assert len(cnn) == 100 and cnn[0].id.startswith("dm-test-") and cnn[0].article and cnn[0].reference
    assert "{article}" in cnn[0].text
    sb = load_prompts("spec-bench")
    assert len(sb) == 160 and {p.task for p in sb} == {"gsm8k", "cnndm"}
    assert all(not p.article.startswith("Summarize:") for p in sb if p.task == "cnndm")


@pytest.mark.parametrize("content, rule", [
    ('{"id": 1}\n', "line 1 needs a non-empty 'prompt'"),
    ('["a list"]\n', "line 1 must be a JSON object with a 'prompt'"),
    ('{"prompt": ""}\n', "line 1 needs a non-empty 'prompt'"),
    ('{"prompt": "a", "id": [1]}\n', "line 1: 'id' must be a string or an integer"),
    ('{"prompt": "a", "id": 1}\n{"prompt": "b", "id": 1}\n', "line 2: 'id' 1 appears twice"),
    ('{"prompt": "a", "reference": 3}\n', "line 1: 'reference' must be a string"),
    ('{"prompt": "a"\n', "line 1"),
    ('\n', "holds no prompts"),
])
def test_user_jsonl_validation(tmp_path, content, rule):
    """A bad prompt file is the ``datasets`` field's error (--dataset on the command line); the rule
    names the line and the JSON key."""
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(SpecFitInputError) as exc:
        load_prompts(str(path))
    assert exc.value.field == "datasets" and rule in exc.value.rule


def test_unknown_dataset_and_bad_limit():
    # field names in the API (the command line maps them to --dataset / --limit)
    with pytest.raises(SpecFitInputError, match="^datasets: "):
        load_prompts("mmlu")
    with pytest.raises(SpecFitInputError, match="^datasets: "):
        load_prompts("missing.jsonl")
    with pytest.raises(SpecFitInputError, match="^limit: "):
        load_prompts("gsm8k", limit=0)


def test_task_metric_of_a_mixed_dataset():
    recs = [_rec("ar", str(i), [1], [0], 1.0, 10.0, 1, 1, [1]) for i in range(3)]
    recs[0].score = {"correct": True}
    recs[1].score = {"correct": False}
    recs[2].score = {"rouge1": 0.5, "rouge2": 0.25, "rougeL": 0.4}
    row = summarise(recs, depth=2, temperature=0.0)[0]
    assert row["task"] == {"accuracy": 0.5, "rouge1": 0.5, "rouge2": 0.25, "rougeL": 0.4}
    assert row["task_metric"] == "acc 0.500, R-L 0.400"


def test_ar_lookahead_rows_compare_with_ar_and_never_stand_for_it():
    """``ar+lookahead`` runs the head (its lookahead draft) and verifies nothing drafted: its outputs are
    compared with ar's, in either order of the records, and its speedup is against ar's row; it reports no
    predicted-vs-transferred ratio (it selects nothing)."""
    ar = _rec("ar", "p", [1, 2, 3, 4], [0, 0, 0, 0], 2.0, 400.0, 32, 64, [1, 1, 1, 1])
    for bad_at in (None, 2):
        out = [1, 2, 3, 4] if bad_at is None else [1, 2, 7, 4]
        la = _rec("ar+lookahead", "p", out, [0, 0, 0, 0], 2.0, 320.0, 24, 64, [1, 1, 1, 1])
        for recs in ([ar, la], [la, ar]):
            rows = {r["method"]: r for r in summarise(recs, depth=3, temperature=0.0)}
            assert rows["ar"]["equal_to_ar"] is None
            assert rows["ar+lookahead"]["equal_to_ar"] is (bad_at is None)
            assert rows["ar+lookahead"]["first_divergence"] == ({} if bad_at is None else {"p": bad_at})
            assert rows["ar+lookahead"]["speedup_vs_ar"] == pytest.approx(1.25)
            assert rows["ar+lookahead"]["experts_per_token"] == 6.0 and rows["ar"]["experts_per_token"] == 8.0
            assert rows["ar+lookahead"].predicted_vs_transferred is None
