"""Every file SpecFit reads, broken in every ordinary way: one line naming the file, exit 2, nothing written.

The shipped proxy pair is cloned into a temporary folder by symbolic links, and the one file under
test is replaced by a truncated, textual or otherwise broken copy; through the API the error is a
:class:`SpecFitInputError` naming the file, through ``specfit eval`` / ``specfit generate`` /
``specfit solve`` / ``specfit compare-solvers`` it is one stderr line, exit 2, and ``--out`` is not
created.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specfit.cli import main
from specfit.core.errors import SpecFitInputError
from specfit.models.proxy import paths as proxy_paths

TRUNCATED = "truncated"
TEXT = "text"


def _broken(data: bytes, how: str) -> bytes:
    return data[: len(data) // 2] if how == TRUNCATED else b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n"


def clone(src: Path, dst: Path, broken: dict[str, str] | None = None) -> Path:
    """``dst`` with a link to every file of ``src`` except the ``broken`` ones ({name: how}), which
    are written broken (half of the bytes, or text)."""
    dst.mkdir(parents=True)
    broken = broken or {}
    for f in src.iterdir():
        if f.name in broken:
            (dst / f.name).write_bytes(_broken(f.read_bytes(), broken[f.name]))
        else:
            (dst / f.name).symlink_to(f.resolve())
    return dst


def run_cli(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, err


def assert_one_line(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def eval_argv(tmp_path, target, head, *extra) -> list[str]:
    return ["eval", "--model", str(target), "--draft", str(head), "--dataset", "gsm8k", "--limit", "1",
            "--max-new-tokens", "2", "--out", str(tmp_path / "out"), "--no-progress", *extra]


# --- the target and head checkpoints ------------------------------------------------------------
@pytest.mark.parametrize("how", [TRUNCATED, TEXT])
def test_unreadable_target_safetensors(tmp_path, capsys, how):
    from specfit.models.qwen3_moe import CheckpointError, OffloadedQwen3Moe

    src = proxy_paths()
    target = clone(src["target"], tmp_path / "target", {"model.safetensors": how})
    with pytest.raises(CheckpointError) as info:
        OffloadedQwen3Moe.from_pretrained(target)
    assert str(target / "model.safetensors") in str(info.value) and "not a readable safetensors file" in str(info.value)
    rc, err = run_cli(capsys, eval_argv(tmp_path, target, src["eagle3"], "--methods", "ar"))
    assert_one_line(rc, err, "specfit eval: error: ", str(target / "model.safetensors"), "safetensors")
    assert not (tmp_path / "out").exists()
    rc, err = run_cli(capsys, ["generate", "--model", str(target), "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    assert_one_line(rc, err, "specfit generate: error: ", str(target / "model.safetensors"))


@pytest.mark.parametrize("how", [TRUNCATED, TEXT])
def test_unreadable_head_safetensors(tmp_path, capsys, how):
    from specfit.models.eagle3 import load_eagle3

    src = proxy_paths()
    head = clone(src["eagle3"], tmp_path / "head", {"model.safetensors": how})
    with pytest.raises(SpecFitInputError) as info:
        load_eagle3(head)
    assert info.value.field == str(head / "model.safetensors")
    rc, err = run_cli(capsys, eval_argv(tmp_path, src["target"], head, "--methods", "eagle3"))
    assert_one_line(rc, err, str(head / "model.safetensors"), "not a readable weight file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("which", ["target", "eagle3"])
def test_config_json_that_is_not_json(tmp_path, capsys, which):
    src = proxy_paths()
    dirs = {"target": src["target"], "eagle3": src["eagle3"]}
    dirs[which] = clone(src[which], tmp_path / which, {"config.json": TRUNCATED})
    rc, err = run_cli(capsys, eval_argv(tmp_path, dirs["target"], dirs["eagle3"], "--methods", "eagle3"))
    assert_one_line(rc, err, str(dirs[which] / "config.json"), "not valid JSON")
    assert not (tmp_path / "out").exists()


def test_index_names_a_missing_shard(tmp_path, capsys):
    src = proxy_paths()
    target = clone(src["target"], tmp_path / "target")
    (target / "model.safetensors").unlink()
    (target / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    rc, err = run_cli(capsys, eval_argv(tmp_path, target, src["eagle3"], "--methods", "ar"))
    assert_one_line(rc, err, "model-00001-of-00002.safetensors", "missing")
    assert not (tmp_path / "out").exists()
    rc, err = run_cli(capsys, ["generate", "--model", str(target), "--prompt-ids", "1", "--max-new-tokens", "1"])
    assert_one_line(rc, err, "model-00001-of-00002.safetensors", "missing")


def test_broken_tokenizer(tmp_path, capsys):
    src = proxy_paths()
    target = clone(src["target"], tmp_path / "target", {"tokenizer.json": TRUNCATED})
    rc, err = run_cli(capsys, eval_argv(tmp_path, target, src["eagle3"], "--methods", "ar"))
    assert_one_line(rc, err, str(target), "tokenizer files cannot be loaded")
    assert not (tmp_path / "out").exists()


# --- routing traces, datasets -------------------------------------------------------------------
def test_truncated_routing_trace(tmp_path, capsys):
    from specfit.models.traces import RoutingTrace

    src = proxy_paths()
    trace = tmp_path / "trace.npz"
    trace.write_bytes(_broken((src["target"] / "routing_trace.npz").read_bytes(), TRUNCATED))
    with pytest.raises(SpecFitInputError, match="not a complete .npz archive") as info:
        RoutingTrace.load(trace)
    assert str(trace) in str(info.value)
    rc, err = run_cli(capsys, eval_argv(tmp_path, src["target"], src["eagle3"], "--methods", "specfit",
                                        "--predictor-trace", str(trace)))
    assert_one_line(rc, err, str(trace), "not a complete .npz archive")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary", None], ids=["binary", "folder"])
def test_unreadable_dataset(tmp_path, capsys, content):
    src = proxy_paths()
    data = tmp_path / "mine.jsonl"
    if content is None:
        data.mkdir()
    else:
        data.write_bytes(content)
    rc, err = run_cli(capsys, eval_argv(tmp_path, src["target"], src["eagle3"], "--methods", "ar",
                                        "--dataset", str(data)))  # the last --dataset wins
    assert_one_line(rc, err, "--dataset: ", str(data))
    assert not (tmp_path / "out").exists()


# --- instances ----------------------------------------------------------------------------------
def test_instance_file_that_is_a_folder_or_binary(tmp_path, capsys):
    folder = tmp_path / "inst.json"
    folder.mkdir()
    rc, err = run_cli(capsys, ["solve", str(folder)])
    assert_one_line(rc, err, "instance: cannot read", str(folder), "folder")
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\x89PNG\xff\xfe")
    rc, err = run_cli(capsys, ["solve", str(binary)])
    assert_one_line(rc, err, "instance: cannot read", str(binary), "UTF-8")


def test_compare_solvers_names_the_bad_instance_file(tmp_path, capsys):
    from specfit.eval.compare import load_folder

    folder = tmp_path / "instances"
    folder.mkdir()
    good = {"parents": [-1, 0], "path_prob": [1.0, 0.5], "num_experts": 2, "experts": [[[0]], [[1]]],
            "cost": {"fixed_ms": 1.0, "per_node_ms": 0.1, "per_expert_ms": 0.2}}
    (folder / "a.json").write_text(json.dumps(good))
    (folder / "b.json").write_text(json.dumps({**good, "path_prob": [1.0, 1.5]}))
    with pytest.raises(SpecFitInputError) as info:
        load_folder(folder)
    assert info.value.field == "instances" and str(folder / "b.json") in info.value.rule
    assert "path_prob[1]" in info.value.rule
    rc, err = run_cli(capsys, ["compare-solvers", "--instances", str(folder), "--solvers", "exact",
                               "--out", str(tmp_path / "out"), "--no-progress"])
    assert_one_line(rc, err, "--instances: ", str(folder / "b.json"), "path_prob[1]")
    assert not (tmp_path / "out").exists()


# --- the readers themselves ---------------------------------------------------------------------
def test_readers_name_the_file(tmp_path):
    from specfit.core.readers import read_json, read_npz, read_text

    missing = tmp_path / "nope.json"
    with pytest.raises(SpecFitInputError, match=f"^cfg: cannot read {missing}: no such file$"):
        read_json(missing, "cfg")
    with pytest.raises(SpecFitInputError) as info:
        read_text(missing)
    assert info.value.field == str(missing)
    lst = tmp_path / "list.json"
    lst.write_text("[1]")
    with pytest.raises(SpecFitInputError, match="top level must be a JSON object"):
        read_json(lst)
    assert read_json(lst, kind=None) == [1]
    npy = tmp_path / "a.npy"
    np.save(npy, np.zeros(2))
    with pytest.raises(SpecFitInputError, match="not a complete .npz archive"):
        read_npz(npy)
    npz = tmp_path / "a.npz"
    np.savez(npz, x=np.zeros(2))
    assert read_npz(npz, required=("x",))["x"].shape == (2,)
    with pytest.raises(SpecFitInputError, match="'y' is missing"):
        read_npz(npz, required=("y",))


def test_unreadable_config_of_a_previous_run(tmp_path, capsys):
    src = proxy_paths()
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_bytes(b"\xff\xfe not text")
    rc, err = run_cli(capsys, ["eval", "--model", str(src["target"]), "--methods", "ar", "--dataset", "gsm8k",
                               "--limit", "1", "--out", str(out)])
    assert_one_line(rc, err, "--out: ", str(out / "config.json"), "not UTF-8", "use another out folder")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
