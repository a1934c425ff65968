"""The engine's host prices: every kind stated with a source, and a profile file's ``host_costs``
refused with one error naming the field when a price is negative, NaN, infinite, missing or unknown."""

import json
import math

import pytest

from specfit.core.cost import PROFILES, get_host_costs, get_profile, profile_from_json
from specfit.core.errors import SpecFitInputError
from specfit.core.host_cost import HOST_COSTS, HOST_WORK, HostCosts, host_costs_from_json

BASE = {"fixed_ms": 6.0, "per_node_ms": 0.1, "per_expert_ms": 0.39, "read_ms": 0.0094}
GOOD = {k: 0.01 for k in HOST_WORK}


def test_the_shipped_prices_state_every_kind_and_their_source():
    d = HOST_COSTS.to_json()
    assert set(d) == set(HOST_WORK) | {"source"} and d["source"]
    assert all(math.isfinite(d[k]) and d[k] >= 0 for k in HOST_WORK)
    assert sum(d[k] for k in HOST_WORK) > 0  # a fit, not a placeholder of zeros
    assert all(get_host_costs(name) is HOST_COSTS for name in PROFILES)


def test_prices_round_trip_through_json():
    c = host_costs_from_json({**GOOD, "solve": 0.2, "source": "fit"})
    assert c.solve == 0.2 and c.ms("solve", 3) == pytest.approx(0.6)
    assert host_costs_from_json(c.to_json()) == c


@pytest.mark.parametrize("value", [-0.001, float("nan"), float("inf"), "1", True, None])
def test_a_bad_price_is_refused_naming_the_field(value):
    with pytest.raises(SpecFitInputError) as e:
        host_costs_from_json({**GOOD, "predict": value})
    assert e.value.field == "profile.host_costs.predict"
    with pytest.raises(SpecFitInputError) as e:
        HostCosts(**{**GOOD, "predict": value})
    assert e.value.field == "host_costs.predict"


def test_a_missing_or_unknown_kind_is_refused_naming_it():
    missing = {k: v for k, v in GOOD.items() if k != "learn_node"}
    with pytest.raises(SpecFitInputError) as e:
        host_costs_from_json(missing)
    assert e.value.field == "profile.host_costs.learn_node" and "required" in e.value.rule
    with pytest.raises(SpecFitInputError) as e:
        host_costs_from_json({**GOOD, "gate": 0.1})
    assert e.value.field == "profile.host_costs.gate"
    with pytest.raises(SpecFitInputError) as e:
        host_costs_from_json([0.1])
    assert e.value.field == "profile.host_costs"


def test_a_profile_file_carries_its_host_prices(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**BASE, "draft_level_ms": 0.5, "host_costs": {**GOOD, "cycle": 0.5}}))
    assert get_profile(str(path)).fixed_ms == 6.0
    assert get_host_costs(str(path)).cycle == 0.5
    path.write_text(json.dumps({**BASE, "draft_level_ms": 0.5}))  # none stated: the shipped ones
    assert get_host_costs(str(path)) is HOST_COSTS


def test_a_profile_file_with_a_bad_host_price_is_refused_when_read(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**BASE, "host_costs": {**GOOD, "solve_node": -1}}))
    for read in (get_profile, get_host_costs):
        with pytest.raises(SpecFitInputError) as e:
            read(str(path))
        assert e.value.field == "profile.host_costs.solve_node"
    with pytest.raises(SpecFitInputError) as e:
        profile_from_json({**BASE, "host_costs": {**GOOD, "level": float("nan")}})
    assert e.value.field == "profile.host_costs.level"
