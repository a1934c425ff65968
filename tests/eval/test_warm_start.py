"""The warm-start grid (``python -m specfit.eval.warm_start``) hands ``--clock`` to every run it starts."""

import pytest

from specfit.eval import warm_start


@pytest.mark.parametrize("clock", [None, "measured", "counted"])
def test_the_grid_passes_the_clock_to_every_run(tmp_path, monkeypatch, capsys, clock):
    calls = []
    row = {"modeled_tokens_per_s": 10.0, "tau": 1.0}
    monkeypatch.setattr(warm_start, "_other_prompts", lambda path, start, count: None)
    monkeypatch.setattr(warm_start, "_eval", calls.append)
    monkeypatch.setattr(warm_start, "_rows", lambda out: {m: row for m in (*warm_start.BASELINES, "specfit")})
    monkeypatch.setattr(warm_start, "_decisions", lambda out: {"ar": 3})
    argv = ["--out", str(tmp_path), "--profiles", "qwen3-30b-a3b-h200", "--slots", "16"]
    assert warm_start.main(argv + (["--clock", clock] if clock else [])) == 0
    assert len(calls) == 3  # learn, cold, warm
    for args in calls:
        assert ("--clock" in args) == (clock is not None)
        if clock:
            assert args[args.index("--clock") + 1] == clock
    assert "| qwen3-30b-a3b-h200 | 16 |" in capsys.readouterr().out
