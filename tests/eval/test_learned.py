"""What the engine learned, saved with a run: an interrupted and resumed `specfit eval` writes the
records an uninterrupted one does (decisions included), and a warm start from a saved file is
restored exactly or refused with one line naming the differing field.

The engine runs on :class:`specfit.engine.clock.FrozenClock` here: with measured host CPU time its
decisions differ from run to run whether or not a run is interrupted."""

import json
import shutil

import pytest

from specfit.core.errors import SpecFitInputError
from specfit.engine.clock import FrozenClock
from specfit.eval import run as eval_run
from specfit.eval.run import evaluate, read_results
from specfit.pipeline import SpecFit

TIMING = ("wall_s", "prefill_s", "measured_ms")


@pytest.fixture
def frozen(monkeypatch):
    """Every run's engine reads a FrozenClock."""
    load = eval_run.load_models

    def load_frozen(p):
        models = load(p)
        models.clock = FrozenClock()
        return models

    monkeypatch.setattr(eval_run, "load_models", load_frozen)


def opts(tiny, out, **kw):
    return {**dict(model=str(tiny / "target"), draft=str(tiny / "head"), out=str(out), datasets="gsm8k,cnndm", limit=3,
                   methods="ar,specfit", max_new_tokens=24, cache_slots=4, total_tokens=6, depth=3, top_k=2), **kw}


def records(out):
    return [{k: v for k, v in r.to_json().items() if k not in TIMING} for r in read_results(out / "results.jsonl")]


class Killed(Exception):
    pass


def run_killed(monkeypatch, tiny, out, after, where):
    """Run into ``out`` and stop it after ``after`` finished generations: with ``where="append"`` after
    the record and its learned state were written, with ``"save"`` between the two writes."""
    calls = {"n": 0}
    real = eval_run._save_learned if where == "save" else eval_run.append_result

    def stop(*a, **kw):
        calls["n"] += 1
        if where == "save" and calls["n"] > after:
            raise Killed
        real(*a, **kw)
        if where == "append" and calls["n"] >= after:
            raise Killed

    monkeypatch.setattr(eval_run, "_save_learned" if where == "save" else "append_result", stop)
    with pytest.raises(Killed):
        evaluate(**opts(tiny, out))
    monkeypatch.setattr(eval_run, "_save_learned" if where == "save" else "append_result", real)


@pytest.fixture(scope="module")
def whole(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "out"
    with pytest.MonkeyPatch.context() as mp:
        load = eval_run.load_models
        mp.setattr(eval_run, "load_models", lambda p: _frozen(load(p)))
        evaluate(**opts(tiny, out))
    return out


def _frozen(models):
    models.clock = FrozenClock()
    return models


@pytest.mark.parametrize("after,where", [(1, "append"), (3, "append"), (4, "append"), (8, "append"), (3, "save"),
                                         (5, "save")])
def test_a_resumed_run_writes_the_records_of_an_uninterrupted_one(tiny, whole, tmp_path, monkeypatch, frozen,
                                                                   after, where):
    out = tmp_path / "out"
    run_killed(monkeypatch, tiny, out, after, where)
    evaluate(**opts(tiny, out))
    got, want = records(out), records(whole)
    key = lambda r: (r["dataset"], r["id"], r["method"])  # noqa: E731
    assert sorted(got, key=key) == sorted(want, key=key)
    assert len(got) == 12


def test_the_comparison_sees_what_the_learning_changes(tiny, whole, tmp_path, monkeypatch, frozen):
    """Resuming without learned.json (each resumed dataset starting afresh) changes later records'
    decisions: the resume test above can fail."""
    out = tmp_path / "out"
    run_killed(monkeypatch, tiny, out, 3, "append")  # gsm8k: prompt 1 (ar, specfit), prompt 2 (ar)
    (out / "learned.json").unlink()
    evaluate(**opts(tiny, out))
    key = lambda r: (r["dataset"], r["id"], r["method"])  # noqa: E731
    assert sorted(records(out), key=key) != sorted(records(whole), key=key)


def test_learned_json_holds_each_dataset_and_the_prompts_it_covers(whole):
    doc = json.loads((whole / "learned.json").read_text())
    assert doc["format"] == 1 and set(doc["sets"]) == {"gsm8k", "cnndm"}
    assert set(doc["identity"]) == {"target", "head", "profile", "offload", "admission", "predictor", "device", "clock"}
    assert doc["identity"]["clock"] == "counted"  # specfit eval on the CPU
    for d, items in doc["sets"].items():
        assert [e["key"]["method"] for e in items] == ["specfit"]
        ids = [r["id"] for r in read_results(whole / "results.jsonl") if r["dataset"] == d and r["method"] == "specfit"]
        assert items[0]["covers"] == ids and len(ids) == 3


# -- warm start ------------------------------------------------------------------------------------
def test_a_warm_start_starts_each_dataset_from_the_saved_state(tiny, whole, tmp_path, monkeypatch, frozen):
    """The first specfit decoder of each dataset starts from the warm file's model of that dataset."""
    from specfit.engine.online import OnlineModel

    started = []
    decoder = SpecFit.decoder

    def spy(self, method="specfit", **kw):
        dec = decoder(self, method, **kw)
        if dec.online is not None:
            started.append(json.dumps(dec.online.to_json(), sort_keys=True))
        return dec

    monkeypatch.setattr(SpecFit, "decoder", spy)
    evaluate(**opts(tiny, tmp_path / "warm", limit=1, warm_start=str(whole)))
    doc = json.loads((whole / "learned.json").read_text())
    for d, i in (("gsm8k", 1), ("cnndm", 2)):  # started[0] is the untimed warm-up
        want = OnlineModel.from_json(doc["sets"][d][0]["online"]).to_json()
        assert started[i] == json.dumps(want, sort_keys=True)


@pytest.mark.parametrize("change,field", [
    (dict(cache_slots=8), "cache_slots"),
    (dict(eviction="lfu"), "eviction"),
    (dict(depth=4), "depth"),
    (dict(top_k=3), "top_k"),
    (dict(total_tokens=7), "total_tokens"),
    (dict(profile="qwen3-30b-a3b-h200"), "profile"),
    (dict(admission="accepted"), "admission"),
    (dict(predictor="recency"), "predictor"),
    (dict(methods="ar,specfit,oracle"), "method"),
    (dict(draft="HEAD2"), "head"),
    (dict(temperature=0.5), "temperature"),
    (dict(clock="measured"), "clock"),  # host ms learned on the counted clock
])
def test_a_warm_start_of_other_settings_is_refused_naming_the_field(tiny, whole, tmp_path, change, field):
    if change.get("draft") == "HEAD2":
        head2 = tmp_path / "head2"
        shutil.copytree(tiny / "head", head2)
        cfg = json.loads((head2 / "config.json").read_text())
        cfg["rope_theta"] = float(cfg.get("rope_theta", 10000.0)) + 1.0
        (head2 / "config.json").write_text(json.dumps(cfg))
        change = dict(draft=str(head2))
    with pytest.raises(SpecFitInputError) as exc:
        evaluate(**{**opts(tiny, tmp_path / "o", limit=1, warm_start=str(whole)), **change})
    assert exc.value.field == "warm_start"
    assert f"learned with {field}=" in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "o" / "results.jsonl").exists()


def test_a_warm_start_from_a_missing_or_bad_file_is_refused(tiny, tmp_path):
    (tmp_path / "bad.json").write_text("{\"format\": 7}")
    for path in (tmp_path / "none", tmp_path / "bad.json"):
        with pytest.raises(SpecFitInputError) as exc:
            evaluate(**opts(tiny, tmp_path / "o", limit=1, warm_start=str(path)))
        assert exc.value.field == "warm_start"


def test_the_api_round_trips_what_it_learned(tiny, tmp_path):
    sf = SpecFit.from_pretrained(tiny / "target", tiny / "head", cache_slots=4, predictor="frequency")
    sf.clock = FrozenClock()
    ids = list(range(200, 230))
    first = sf.generate(ids, method="specfit", max_new_tokens=16)
    assert first.cycles
    sf.save_learned(tmp_path / "learned.json")
    warm = SpecFit.from_pretrained(tiny / "target", tiny / "head", cache_slots=4, predictor="frequency",
                                   warm_start=tmp_path / "learned.json")
    warm.clock = FrozenClock()
    assert {k: m.to_json() for k, m in warm.online.items()} == {k: m.to_json() for k, m in sf.online.items()}
    # the restored object decides as the original does on the next prompt
    nxt = list(range(300, 330))
    a, b = sf.generate(nxt, max_new_tokens=16), warm.generate(nxt, max_new_tokens=16)
    assert [c.decision for c in a.cycles] == [c.decision for c in b.cycles]
    assert a.output_ids == b.output_ids
    with pytest.raises(SpecFitInputError, match="learned with cache_slots=4, this run has cache_slots=8"):
        SpecFit.from_pretrained(tiny / "target", tiny / "head", cache_slots=8, predictor="frequency",
                                warm_start=tmp_path)
    with pytest.raises(SpecFitInputError, match="learned with target="):
        SpecFit(sf.target, sf.drafter, cache_slots=4, identity={**sf.identity, "target": "other:0"},
                warm_start=tmp_path / "learned.json")


def test_generate_starts_from_a_saved_state_or_refuses_it(tiny, tmp_path, capsys):
    from specfit.cli import main

    sf = SpecFit.from_pretrained(tiny / "target", tiny / "head", cache_slots=4)
    sf.generate(list(range(200, 230)), max_new_tokens=8)
    sf.save_learned(tmp_path / "learned.json")
    base = ["generate", "--model", str(tiny / "target"), "--draft", str(tiny / "head"), "--prompt-ids",
            ",".join(map(str, range(300, 320))), "--max-new-tokens", "8", "--warm-start", str(tmp_path / "learned.json")]
    assert main([*base, "--cache-slots", "4"]) == 0
    capsys.readouterr()
    for extra, field in ((["--cache-slots", "8"], "cache_slots"), (["--cache-slots", "4", "--method", "oracle"], "method"),
                         (["--cache-slots", "4", "--profile", "qwen3-30b-a3b-h200"], "profile")):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert f"learned with {field}=" in err and err.count("\n") == 1, err


def test_generate_saves_what_it_learned_for_a_later_warm_start(tiny, tmp_path, capsys, monkeypatch):
    from specfit.cli import main

    load = SpecFit.from_pretrained

    def frozen_load(*args, **kw):
        sf = load(*args, **kw)
        sf.clock = FrozenClock()
        return sf

    monkeypatch.setattr(SpecFit, "from_pretrained", staticmethod(frozen_load))
    ids = list(range(200, 230))
    out = tmp_path / "saved.json"
    base = ["generate", "--model", str(tiny / "target"), "--draft", str(tiny / "head"), "--max-new-tokens", "8",
            "--cache-slots", "4"]
    assert main([*base, "--prompt-ids", ",".join(map(str, ids)), "--save-learned", str(out)]) == 0
    # the file holds what the API learns from the same generation
    sf = frozen_load(tiny / "target", tiny / "head", cache_slots=4)
    sf.generate(ids, max_new_tokens=8)
    sf.save_learned(tmp_path / "api.json")
    assert json.loads(out.read_text()) == json.loads((tmp_path / "api.json").read_text())
    assert [e["key"]["method"] for e in json.loads(out.read_text())["sets"]["default"]] == ["specfit"]
    # a later generate starts from it and saves the state it reached over its own generation
    nxt = ",".join(map(str, range(300, 320)))
    assert main([*base, "--prompt-ids", nxt, "--warm-start", str(out), "--save-learned", str(out)]) == 0
    sf.generate(list(range(300, 320)), max_new_tokens=8)
    sf.save_learned(tmp_path / "api.json")
    assert json.loads(out.read_text()) == json.loads((tmp_path / "api.json").read_text())
    capsys.readouterr()
    for extra, rule in ((["--save-learned", str(tmp_path)], "is a folder"),
                        (["--save-learned", str(tmp_path / "no" / "l.json")], "does not exist"),
                        (["--save-learned", str(tmp_path / "e.json"), "--method", "eagle3"], "learns nothing")):
        assert main([*base, "--prompt-ids", nxt, *extra]) == 2
        err = capsys.readouterr().err
        assert "--save-learned" in err and rule in err and err.count("\n") == 1, err
    assert main(["generate", "--prompt-ids", nxt, "--max-new-tokens", "4", "--save-learned", str(tmp_path / "a.json")]) == 2
    assert "it needs --draft" in capsys.readouterr().err
    assert not (tmp_path / "e.json").exists() and not (tmp_path / "a.json").exists()


def test_a_head_of_the_same_shape_with_other_weights_is_another_head(tiny, whole, tmp_path):
    """The same config and weight files of the same names and sizes, other bytes (a retrained head), under the
    same folder name: its identity differs, so a warm start from the first head is refused; a copy keeps it."""
    import torch
    from safetensors.torch import load_file

    from specfit.pipeline import _checkpoint_id

    copy, retrained = tmp_path / "copy" / "head", tmp_path / "retrained" / "head"
    shutil.copytree(tiny / "head", copy)
    shutil.copytree(tiny / "head", retrained)
    for f in retrained.glob("*.safetensors"):  # every float weight byte's lowest bit flipped, the header kept
        raw = bytearray(f.read_bytes())
        start = 8 + int.from_bytes(raw[:8], "little")
        for name, t in json.loads(raw[8:start]).items():
            if name != "__metadata__" and t["dtype"] in ("F32", "F16", "BF16"):
                a, b = (start + o for o in t["data_offsets"])
                raw[a:b] = bytes(x ^ 1 for x in raw[a:b])
        f.write_bytes(bytes(raw))
        assert all(torch.isfinite(t).all() for t in load_file(f).values() if t.is_floating_point())
    assert [f.stat().st_size for f in sorted(retrained.iterdir())] == [f.stat().st_size for f in sorted(copy.iterdir())]
    assert _checkpoint_id(copy) == _checkpoint_id(tiny / "head") != _checkpoint_id(retrained)
    with pytest.raises(SpecFitInputError, match="learned with head='head:[0-9a-f]{8}', this run has head='head:.*"
                                                "--draft lite is eagle3-lite"):
        evaluate(**{**opts(tiny, tmp_path / "o", limit=1, warm_start=str(whole)), "draft": str(retrained)})
