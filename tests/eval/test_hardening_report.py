"""The acceptance plot keeps methods with identical values visible (eagle3 and eagle3-vanilla draft the
same trees, so their acceptance curves coincide)."""

from __future__ import annotations

import numpy as np

from specfit.eval import report


def test_identical_acceptance_curves_do_not_hide_each_other(tmp_path, monkeypatch):
    figures = {}

    def keep(fig, path):
        figures[path.name] = fig

    monkeypatch.setattr(report, "save_figure", keep)
    same = [0.9, 0.6, 0.3]
    from dataclasses import fields

    from specfit.eval.records import SummaryRow

    blank = {f.name: None for f in fields(SummaryRow)}
    rows = [SummaryRow(**{**blank, "dataset": "gsm8k", "method": m, "mean_nodes_verified": 3.0,
                          "modeled_tokens_per_s": 10.0, "experts_per_token": 1.0,
                          "acceptance_by_depth": [] if m == "ar" else same})
            for m in ("ar", "eagle3-vanilla", "eagle3", "specfit")]
    report.plot(rows, tmp_path)
    lines = figures["acceptance_by_depth.png"].axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == ["eagle3-vanilla", "eagle3", "specfit"]
    points = [np.column_stack(ln.get_data()) for ln in lines]
    for i in range(len(points)):
        for j in range(i + 1, len(points)):
            assert not np.allclose(points[i], points[j]), "two curves drawn on the same points"
    assert len({ln.get_marker() for ln in lines}) == len(lines)
    for ln in lines:  # the shift stays well inside one depth step
        assert np.all(np.abs(ln.get_data()[0] - np.arange(1, 4)) < 0.2)
