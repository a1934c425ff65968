"""The eval reports calibrated and raw predicted A(S) against τ, the AR-gate share, and a reliability plot."""

from __future__ import annotations

from specfit.eval.records import ResultRecord
from specfit.eval.report import reliability_plot, summarise


def _record(method: str, accept, pred, raw, decisions) -> ResultRecord:
    n = len(accept)
    return ResultRecord(id="p0", dataset="gsm8k", method=method, task="none", prompt_tokens=3, output_ids=[1] * (sum(accept) + n),
                        text="", new_tokens=sum(accept) + n, committed=sum(accept) + n, cycles=n, accept_lengths=accept,
                        nodes_verified=[1] * n, levels=[0] * n, wall_s=1.0, prefill_s=0.0, modeled_ms=100.0,
                        modeled={"compute_ms": 100.0, "transfer_ms": 0.0, "draft_ms": 0.0, "host_ms": 0.0},
                        experts_transferred=0, experts_looked_up=1, measured_ms={"solve": 0.0}, score={},
                        expected_tokens=pred, expected_tokens_raw=raw, decisions=decisions)


def test_summary_reports_predicted_against_committed_and_the_ar_share(tmp_path):
    recs = [_record("ar", [0, 0], [1.0, 1.0], [1.0, 1.0], ["draft", "draft"]),
            _record("specfit", [2, 0, 0, 1], [2.5, 1.5, 1.0, 2.0], [1.5, 1.2, 1.0, 1.4], ["draft", "draft", "ar", "draft"])]
    row = {r.method: r for r in summarise(recs, depth=3, temperature=0.0)}["specfit"]
    assert row.tau == 7 / 4
    assert row.predicted_tau == 7.0 / 4 and row.predicted_tau_raw == 5.1 / 4 and row.ar_share == 0.25
    paths = reliability_plot(recs, tmp_path)
    assert paths["reliability_png"].stat().st_size > 0


def test_old_records_without_predictions_have_no_calibration_columns(tmp_path):
    old = _record("specfit", [1], None, None, None)
    row = summarise([old], depth=3, temperature=0.0)[0]
    assert (row.predicted_tau, row.predicted_tau_raw, row.ar_share) == (None, None, None)
    assert reliability_plot([old], tmp_path) == {}
