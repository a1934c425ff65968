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
