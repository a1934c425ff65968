"""The host-price fit: NNLS on per-cycle counts recovers the prices that generated the host ms, and
reports each method's predicted against measured total on the held-out dataset."""

import numpy as np
import pytest

from specfit.core.host_cost import HOST_WORK, host_costs_from_json
from specfit.eval.host_cost_fit import fit


def test_the_fit_recovers_known_prices_and_checks_them_on_the_held_out_set():
    rng = np.random.default_rng(0)
    price = rng.uniform(0.0, 0.5, len(HOST_WORK))
    rows = []
    for d in ("gsm8k", "cnndm"):
        for m in ("ar", "specfit"):
            for _ in range(60):
                c = rng.integers(0, 20, len(HOST_WORK)).astype(float)
                rows.append({"dataset": d, "method": m, "counts": list(c), "host_ms": float(c @ price)})
    res = fit(rows)
    got = np.array([res["host_costs"][k] for k in HOST_WORK])
    assert got == pytest.approx(price, abs=1e-4)
    assert res["train"] == "gsm8k" and res["held_out"] == "cnndm"
    assert res["rel_residual"]["held_out"] < 1e-3
    assert {(r["dataset"], r["method"]) for r in res["per_method"]} == {(d, m) for d in ("gsm8k", "cnndm")
                                                                        for m in ("ar", "specfit")}
    assert all(r["ratio"] == pytest.approx(1.0, abs=1e-3) for r in res["per_method"])
    host_costs_from_json(res["host_costs"])  # a profile file's host_costs as written
