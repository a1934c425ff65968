"""The cycle-time model's fit against runtime measurements (eval/cost_fit.py), on synthetic forwards."""

import numpy as np
import pytest

from specfit.core.errors import SpecFitInputError
from specfit.eval.cost_fit import fit_forms, profile_from_fit, profile_json
from specfit.core.cost import profile_from_json


def _forwards(rng, sizes, read=0.5, copy=2.0, noise=0.0):
    rows = []
    for L in (1, 2):
        for n in sizes:
            u = min(8 * n, 128) * L  # routed experts, every layer
            for m in (0, u // 2, u):  # all resident, half, none
                ms = 10 + 3 * L + (0.2 + 0.1 * L) * n + read * u + copy * m
                rows.append((L, n, u, m, ms * (1 + noise * rng.standard_normal())))
    return np.array(rows)


def test_new_form_recovers_the_read_term_the_three_term_form_cannot_express():
    rng = np.random.default_rng(0)
    fit = fit_forms(_forwards(rng, (1, 2, 4, 8, 16, 32, 64)), _forwards(rng, (3, 12, 48)))
    new, old = fit["new"], fit["three_term"]
    assert new["rel_residual"] < 1e-9 and new["held_out_max_rel_err"] < 1e-9
    assert new["coef"]["read_ms"] == pytest.approx(0.5) and new["coef"]["per_expert_ms"] == pytest.approx(2.0)
    assert old["rel_residual"] > 0.05  # resident reads left out: the misfit the new term removes
    cost = profile_from_fit(fit, name="t", expert_bytes=1_000_000, reference_layers=48)
    assert cost.fixed_ms == pytest.approx(10 + 3 * 48) and cost.per_node_ms == pytest.approx(0.2 + 0.1 * 48)
    assert cost.memory_gb_per_s == pytest.approx(1e6 / 0.5e6)  # effective: bytes / ms
    assert profile_from_json(profile_json(cost, source="test")) == cost  # the file round-trips


def test_noise_floor_and_bad_rows():
    rng = np.random.default_rng(1)
    fit = fit_forms(_forwards(rng, (1, 4, 16, 64), noise=0.02), noise_rows=[(10.0, 10.0), (11.0, 10.0)])
    assert fit["noise_floor"] == pytest.approx(1 / np.hypot(10, 11))
    assert fit["new"]["rel_residual"] < 0.05
    with pytest.raises(SpecFitInputError) as err:
        fit_forms([[1, 1, 8, 0, float("nan")]] * 8)
    assert err.value.field == "rows"
    with pytest.raises(SpecFitInputError):
        fit_forms([[1, 1, 8, 0, 1.0]] * 2)


def test_relative_weighting_minimises_relative_error_and_absolute_the_ms_residual():
    # a concave per-node cost (steep for the first nodes, as a CPU's few-row matmuls): no linear form fits it,
    # so the two weightings trade the small forwards' relative error against the large forwards' ms
    rows = []
    for n in (1, 2, 3, 4, 8, 16, 32, 64):
        u = min(7 * n + 1, 122)
        for m in (0, u // 2, u):
            rows.append((1, n, u, m, 5 + 6 * min(n, 3) + 3 * max(n - 3, 0) + 1.2 * u + 2.2 * m))
    rel, ab = fit_forms(rows, weighting="relative"), fit_forms(rows, weighting="absolute")
    assert rel["weighting"] == "relative" and ab["weighting"] == "absolute"
    for form in ("new", "three_term"):
        assert rel[form]["rms_rel_err"] < ab[form]["rms_rel_err"]
        assert ab[form]["rel_residual"] < rel[form]["rel_residual"]
        assert rel[form]["max_rel_err"] >= rel[form]["rms_rel_err"] > 0
    small = [i for i, r in enumerate(rows) if r[1] <= 4]
    a = np.array(rows, float)
    for fit in (rel, ab):  # the reported per-row error is the fitted coefficients' own
        x = np.array(list(fit["new"]["coef"].values()))
        pred = x[0] + x[1] * a[:, 1] + x[2] * a[:, 2] + x[3] * a[:, 3]
        assert fit["new"]["max_rel_err"] == pytest.approx(np.max(np.abs(pred / a[:, 4] - 1)))
    err = lambda f: max(abs(f["new"]["coef"]["a_ms"] + f["new"]["coef"]["c_ms_per_node"] * a[i, 1]
                            + f["new"]["coef"]["read_ms"] * a[i, 2] + f["new"]["coef"]["per_expert_ms"] * a[i, 3]
                            - a[i, 4]) / a[i, 4] for i in small)
    assert err(rel) < err(ab)  # the small forwards are what relative weighting buys


def test_held_out_errors_are_signed_and_bad_weighting_or_zero_ms_is_refused():
    rng = np.random.default_rng(2)
    fit = fit_forms(_forwards(rng, (1, 2, 4, 8, 16, 32, 64)), [(1, 3, 24, 0, 1000.0)], weighting="relative")
    assert fit["new"]["held_out_rel_err"][0] < 0  # predicted far below 1000 ms: a negative (pred - y) / y
    assert fit["new"]["held_out_max_rel_err"] == pytest.approx(-fit["new"]["held_out_rel_err"][0])
    with pytest.raises(SpecFitInputError) as err:
        fit_forms(_forwards(rng, (1, 2, 4, 8)), weighting="log")
    assert err.value.field == "weighting"
    with pytest.raises(SpecFitInputError) as err:
        fit_forms([[1, n, 8, 0, 0.0 if n == 1 else 1.0] for n in range(1, 9)])
    assert err.value.field == "rows"


class _Spec:
    vocab_size, num_experts, moe_layers = 64, 8, [0]


class _Cache:
    def __init__(self):
        self.hits = self.misses = 0

    def stats(self):
        return {"layers": [{"hits": self.hits, "misses": self.misses}]}


class _FakeModel:
    """Counts like a runtime's; a tree size's first verify reads one expert more (a first-call effect)."""

    spec = _Spec()

    def __init__(self):
        import torch

        self.device, self.cache, self.log, self.state, self.seen = torch.device("cpu"), _Cache(), [], None, set()

    def reset_cache(self, slots):
        self.state = slots

    def reset(self):
        pass

    def prefill(self, ids):
        pass

    def verify(self, tokens, parents):
        n = len(parents)
        if n == 16 and self.state == 4:  # the "part" state's warming tree
            return
        self.log.append((self.state, n))
        extra = 0 if (self.state, n) in self.seen else 1
        self.seen.add((self.state, n))
        if self.state == "all":
            self.cache.hits += n + extra
        else:
            self.cache.misses += n + extra


def test_measure_runs_rounds_and_records_no_warm_up_forward():
    from specfit.eval.cost_fit import measure

    model = _FakeModel()
    recs = measure(model, sizes=(1, 3, 2), repeats=3, warmup=1, log=lambda msg: None)
    configs = [(s, n) for s in ("all" if s == "all" else 4 if s == "part" else 0 for s in (0, "part", "all"))
               for n in (1, 3, 2)]
    assert model.log == configs * 4  # one warm-up round, then 3 rounds of every configuration in order
    assert len(recs) == 9  # the warm-up's extra expert never reaches a record (else its u, m differ: dropped)
    for r in recs:
        assert len(r["ms"]) == 3 and r["u"] == r["n"] and r["m"] == (0 if r["slots"] == "all" else r["n"])
        assert r["median_ms"] == sorted(r["ms"])[1] and r["spread"] >= 0
    nowarm = measure(_FakeModel(), sizes=(1, 2), repeats=2, warmup=0, log=lambda msg: None)
    assert nowarm == []  # without the warm-up round every first call is recorded: no configuration's counts agree
    with pytest.raises(SpecFitInputError):
        measure(_FakeModel(), sizes=(1,), repeats=0, log=lambda msg: None)


def test_dense_rows_ms_times_each_row_count_and_the_report_prints_them():
    import types

    import torch

    from specfit.eval.cost_fit import dense_rows_ms, format_report

    spec = types.SimpleNamespace(hidden_size=32, head_dim=8, num_heads=4, num_kv_heads=2, vocab_size=64)
    dense = dense_rows_ms(spec, torch.device("cpu"), torch.float32, rows=(1, 3), repeats=2)
    assert set(dense) == {"layer_qkv_o_proj", "lm_head"}
    assert all(list(v) == ["1", "3"] and all(ms >= 0 for ms in v.values()) for v in dense.values())
    rng = np.random.default_rng(3)
    rows = _forwards(rng, (1, 2, 4, 8, 16, 32, 64))
    recs = [{"L": int(r[0]), "n": int(r[1]), "slots": 0, "u": int(r[2]), "m": int(r[3]), "median_ms": r[4]} for r in rows]
    text = format_report(fit_forms(rows, weighting="relative"), recs, dense)
    assert "dense matmuls by rows" in text and "relative weighting" in text
    with pytest.raises(SpecFitInputError):
        dense_rows_ms(spec, torch.device("cpu"), torch.float32, repeats=0)


def test_command_refuses_bad_rounds_before_any_work(capsys):
    from specfit.eval.cost_fit import main

    assert main(["--synthetic", "tiny", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err
    assert main(["--synthetic", "tiny", "--warmup", "-1"]) == 2
    assert "--warmup" in capsys.readouterr().err


def test_in_memory_fit_writes_a_profile_from_eager_forwards(tmp_path, monkeypatch, capsys):
    """``--in-memory`` builds the synthetic model without a checkpoint; the forwards are eager at every cache size
    even where the runtime's default would be static forwards (CUDA graphs on CUDA), which a full cache would
    otherwise build inside timed forwards."""
    import specfit.eval.runtime_bench as runtime_bench
    from specfit.core.cost import load_profile
    from specfit.eval.cost_fit import main
    from specfit.models.qwen3_moe import decode_graph

    built = runtime_bench.synthetic_model

    def static_by_default(*args, **kwargs):
        model = built(*args, **kwargs)
        model.decode_graph = "static"  # what a CUDA model starts with ("cuda-graph"), uncaptured
        return model

    def refuse(*args, **kwargs):
        raise AssertionError("a static forward was built inside the fit")

    monkeypatch.setattr(runtime_bench, "synthetic_model", static_by_default)
    monkeypatch.setattr(decode_graph.StaticForward, "__init__", refuse)
    out = tmp_path / "profile.json"
    assert main(["--synthetic", "tiny", "--in-memory", "--layers", "1,2", "--repeats", "1", "--like", "auto",
                 "--json", str(out)]) == 0
    assert "| new" in capsys.readouterr().out
    fitted = load_profile(str(out))
    assert fitted.per_expert_ms > 0
    assert fitted.draft_level_ms == 0.25  # --like auto off CUDA: the h200 profile's
    assert main(["--model", str(tmp_path), "--in-memory"]) == 2
    assert "--in-memory: needs --synthetic" in capsys.readouterr().err
