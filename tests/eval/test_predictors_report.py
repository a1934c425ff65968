"""The recall@k report script (eval.predictors) end to end on a tiny random checkpoint."""

from __future__ import annotations

import json

import pytest

from specfit.eval.predictors import VARIANTS, main
from specfit.models.traces import RoutingTrace
from specfit.core.errors import SpecFitInputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, tiny_checkpoint):
    path = tmp_path_factory.mktemp("tiny_ckpt")
    tiny_checkpoint(path, vocab_size=256)
    return path


def test_report_writes_json_and_table(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["--model", str(tiny_ckpt), "--train-prompts", "3", "--eval-prompts", "2", "--max-tokens", "24",
                 "--probe-epochs", "2", "--out", str(out), "--save-traces", str(tmp_path / "traces")]) == 0
    report = json.loads(out.read_text())
    assert report["hidden_source"] == "target-aux"  # no head beside the checkpoint: the labelled stand-in
    assert (report["num_layers"], report["num_experts"], report["top_k"]) == (4, 8, 2)
    assert (report["train_prompts"], report["eval_prompts"]) == (3, 2)
    assert report["eval_tokens_scored"] == 2 * (24 - 2)
    assert set(report["predictors"]) == set(VARIANTS)
    for row in report["predictors"].values():
        assert len(row["recall_per_layer"]) == 4
        assert all(0.0 <= x <= 1.0 for x in row["recall_per_layer"])
    table = capsys.readouterr().out
    assert all(f"| {label} |" in table for label in VARIANTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "traces"]
    build = RoutingTrace.load(tmp_path / "traces" / "build.npz")
    assert build.num_prompts == 3 and build.hidden_source == "target-aux"
    assert RoutingTrace.load(tmp_path / "traces" / "held_out.npz").num_prompts == 2


def test_report_bad_input(tiny_ckpt, tmp_path):
    with pytest.raises(SpecFitInputError) as e:
        main(["--model", str(tiny_ckpt), "--train-prompts", "0", "--out", str(tmp_path / "r.json")])
    assert e.value.field == "--train-prompts"
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("depth", [1, 3])
def test_replay_observes_only_tokens_before_the_root(depth):
    """Token j is predicted as a depth-d node: exactly the tokens < j - d have been observed."""
    import numpy as np

    from specfit.eval.predictors import SKIP, replay

    class Spy:
        name = "spy"

        def reset(self):
            self.seen = []

        def observe(self, tokens, routing, draft_hidden):
            self.seen += tokens.tolist()

        def predict(self, tokens, draft_hidden):
            log.append((int(tokens[0]), list(self.seen)))
            return np.array([[[0, 1]]])

    log = []
    trace = RoutingTrace(4)
    trace.add(np.arange(10), np.tile([[[0, 1]]], (10, 1, 1)))
    recall, times = replay(Spy(), trace, online=True, depth=depth)
    assert recall.tolist() == [1.0] and len(times) == 10 - SKIP
    assert log == [(j, list(range(max(j - depth, 0)))) for j in range(SKIP, 10)]
