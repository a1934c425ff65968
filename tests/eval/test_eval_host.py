"""`specfit eval --offload host`: same outputs as the transfer regime, cycles priced on a host profile."""

import json

import pytest

from specfit.cli import build_parser, main
from specfit.core.cost import get_host_profile
from specfit.engine import CycleRecord
from specfit.eval.modeled import modeled_cycle_ms
from specfit.eval.run import EvalConfig, read_results
from tests.eval.test_eval import eval_args, first_run  # noqa: F401  (a module fixture; tiny is in conftest)


@pytest.fixture(scope="module")
def host_run(tiny, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("eval_host") / "out"
    assert main(eval_args(tiny, out, "--offload", "host")) == 0
    return out


def test_host_run_equals_transfer_run_and_is_priced_on_the_host_profile(first_run, host_run):  # noqa: F811
    transfer = {(r["id"], r["dataset"], r["method"]): r for r in read_results(first_run / "results.jsonl")}
    host = {(r["id"], r["dataset"], r["method"]): r for r in read_results(host_run / "results.jsonl")}
    assert host.keys() == transfer.keys()
    for key, rec in host.items():
        assert rec["output_ids"] == transfer[key]["output_ids"], key
        assert rec["experts_transferred"] == 0 or key[2] == "oracle", key   # nothing copied in host mode
    summary = json.loads((host_run / "summary.json").read_text())
    assert summary["cost"]["regime"] == "host"
    assert "Offload host" in (host_run / "summary.md").read_text()
    ar = [k for k in host if k[2] == "ar"]
    # the host regime's premise: with the same cache size, AR is modeled faster computing misses on the host
    assert sum(host[k]["modeled_ms"] for k in ar) < sum(transfer[k]["modeled_ms"] for k in ar)


def test_offload_is_part_of_the_run_identity(tiny, first_run, capsys):  # noqa: F811
    assert main(eval_args(tiny, first_run, "--offload", "host")) == 2
    assert "offload" in capsys.readouterr().err


def test_bad_offload_and_host_profile_exit_2(tiny, tmp_path, capsys):  # noqa: F811
    with pytest.raises(SystemExit) as exc:
        main(eval_args(tiny, tmp_path / "a", "--offload", "gpu"))
    assert exc.value.code == 2
    assert main(eval_args(tiny, tmp_path / "b", "--host-profile", "nope")) == 2
    assert "host-profile" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_host_cycle_pricing_uses_the_host_counts():
    cost = get_host_profile("qwen3-30b-a3b-pcie4+host-ddr5-5600-2ch").for_layers(2)
    idle = CycleRecord(nodes_verified=1, true_experts=[8, 8], host={"computed": [0, 0], "rows": [0, 0]})
    busy = CycleRecord(nodes_verified=1, true_experts=[8, 8], host={"computed": [8, 4], "rows": [8, 4]})
    # every routed expert resident: the GPU forward plus one read of each (48 / 2 real layers per layer)
    assert modeled_cycle_ms(idle, cost)["total_ms"] == pytest.approx(cost.gpu_ms(1) + 24 * 16 * cost.read_ms)
    parts = modeled_cycle_ms(busy, cost)
    # 0 and 4 experts resident (routed minus host-computed), read on the GPU side
    assert parts["total_ms"] == pytest.approx(cost.cycle_ms(1, [8, 4], [8, 4], None, [0, 4]))
    assert parts["compute_ms"] == pytest.approx(cost.gpu_ms(1)) and parts["transfer_ms"] > 0


def test_cli_offload_defaults_match_the_library():
    args = build_parser().parse_args(["eval"])
    assert (args.offload, args.host_profile) == (EvalConfig().offload, EvalConfig().host_profile)
    assert build_parser().parse_args(["generate", "--model", "m", "--prompt-ids", "1", "--max-new-tokens", "1"]).offload == "transfer"


def test_host_computed_experts_count_as_uncached_in_the_summary(first_run, host_run):  # noqa: F811
    recs = read_results(host_run / "results.jsonl")
    assert all(r["experts_host_computed"] > 0 for r in recs if r["method"] != "oracle")
    assert all(r["experts_host_computed"] == 0 for r in read_results(first_run / "results.jsonl"))
    rows = {(r["dataset"], r["method"]): r for r in json.loads((host_run / "summary.json").read_text())["rows"]}
    assert rows[("gsm8k", "ar")]["experts_per_token"] > 0 and rows[("gsm8k", "ar")]["cache_hit_rate"] < 1


def test_auto_run_equals_transfer_run_and_prices_its_copies(tiny, first_run, tmp_path):  # noqa: F811
    out = tmp_path / "auto"
    assert main(eval_args(tiny, out, "--offload", "auto", "--methods", "ar,specfit")) == 0
    transfer = {(r["id"], r["dataset"], r["method"]): r for r in read_results(first_run / "results.jsonl")}
    auto = read_results(out / "results.jsonl")
    assert auto and all(r["output_ids"] == transfer[(r["id"], r["dataset"], r["method"])]["output_ids"] for r in auto)
    assert all(r["experts_host_computed"] > 0 for r in auto)
    assert "Offload auto" in (out / "summary.md").read_text()
    assert json.loads((out / "summary.json").read_text())["config"]["offload"] == "auto"


def test_auto_cycle_pricing_charges_copies_beside_the_host():
    cost = get_host_profile("qwen3-30b-a3b-pcie4+host-ddr5-5600-2ch").for_layers(2)
    host = CycleRecord(nodes_verified=1, true_experts=[8, 8], host={"computed": [6, 4], "rows": [6, 4]},
                       transferred=[0, 0])
    auto = CycleRecord(nodes_verified=1, true_experts=[8, 8], host={"computed": [5, 4], "rows": [5, 4]},
                       transferred=[1, 0])
    # resident experts (routed minus host-computed minus copied) are read on the GPU side
    assert modeled_cycle_ms(host, cost)["total_ms"] == pytest.approx(cost.cycle_ms(1, [6, 4], [6, 4], None, [2, 4]))
    assert modeled_cycle_ms(auto, cost)["total_ms"] == pytest.approx(cost.cycle_ms(1, [5, 4], [5, 4], [1, 0], [2, 4]))
    assert modeled_cycle_ms(auto, cost)["total_ms"] < modeled_cycle_ms(host, cost)["total_ms"]  # the split pays


def test_offload_summaries_name_the_host_profile_and_the_cache_start(first_run, host_run):  # noqa: F811
    host = json.loads((host_run / "summary.json").read_text())
    assert "host-regime profile" in host["cost_scaling"] and "hot set" in host["cache"]
    md = (host_run / "summary.md").read_text()
    assert "offload host, host-regime profile" in md and "per_expert × transferred" not in md
    transfer = json.loads((first_run / "summary.json").read_text())
    assert "empty expert cache" in transfer["cache"] and "per_expert × transferred" in (first_run / "summary.md").read_text()


def test_a_transfer_profile_other_than_the_host_profiles_gpu_side_is_refused(tiny, tmp_path, capsys):  # noqa: F811
    assert main(eval_args(tiny, tmp_path / "c", "--offload", "auto", "--profile", "qwen3-30b-a3b-h200")) == 2
    err = capsys.readouterr().err
    assert "--profile" in err and "qwen3-30b-a3b-pcie4" in err
    assert not (tmp_path / "c").exists()
