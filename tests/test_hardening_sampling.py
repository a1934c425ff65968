"""Sampling settings and seeds: one rule in the API and on the command line.

``temperature`` is a finite number >= 0 (NaN decoded greedily in the API, refused in the CLI),
``top_p`` a finite number in (0, 1], a seed an integer in [0, 2**63) everywhere (floats and numeric
strings raised torch's RuntimeError; negative seeds passed in the API, failed in the CLI; the
evaluation reduced seeds modulo 2**63 while config.json recorded the original).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.cli import main
from specfit.core.errors import MAX_SEED, SpecFitInputError
from specfit.pipeline import SpecFit
from tests.strategies import NON_FINITE, edge_integers, non_integers, non_numbers

BAD_TEMPERATURES = [*NON_FINITE, -1.0, -1e-300, True, "0.5", None]
BAD_TOP_P = [*NON_FINITE, 0.0, -0.5, 1.0000001, 2, True, "1"]
BAD_SEEDS = [1.5, 7.0, "7", True, -1, MAX_SEED, 2 ** 64, None]


def _decoder_error(**kwargs) -> SpecFitInputError:
    sf = SpecFit(object())  # the settings are checked before the target is touched
    with pytest.raises(SpecFitInputError) as info:
        sf.decoder("ar", **kwargs)
    return info.value


@pytest.mark.parametrize("value", BAD_TEMPERATURES, ids=repr)
def test_api_temperature(value):
    assert _decoder_error(temperature=value).field == "temperature"


@pytest.mark.parametrize("value", BAD_TOP_P, ids=repr)
def test_api_top_p(value):
    assert _decoder_error(top_p=value).field == "top_p"


@settings(max_examples=50, deadline=None)
@given(value=st.one_of(non_integers(), edge_integers(0, MAX_SEED - 1)))
def test_api_seed(value):
    err = _decoder_error(seed=value)
    assert err.field == "seed" and "2**63" in err.rule


@pytest.mark.parametrize("name, values", [("temperature", BAD_TEMPERATURES), ("top_p", BAD_TOP_P),
                                          ("seed", BAD_SEEDS)])
def test_eval_settings_same_rule(tmp_path, name, values):
    from specfit.eval.run import EvalConfig, plan

    for value in values:
        with pytest.raises(SpecFitInputError) as info:
            plan(EvalConfig(methods=("ar",), datasets=("gsm8k",), limit=1, out=str(tmp_path / "o"), **{name: value}))
        assert info.value.field == name, (value, info.value)


@settings(max_examples=20, deadline=None)
@given(value=non_numbers())
def test_generate_api_refuses_what_the_cli_refuses(value):
    """The API's ``temperature`` obeys the CLI's rule: ``generate(temperature=nan)`` decoded greedily."""
    sf = SpecFit(object())
    with pytest.raises(SpecFitInputError) as info:
        sf.decoder("specfit", temperature=value)
    assert info.value.field == "temperature"


def test_largest_seed_accepted_and_recorded_as_given(tmp_path):
    from specfit.eval.run import EvalConfig, plan

    p = plan(EvalConfig(methods=("ar",), datasets=("gsm8k",), limit=1, seed=MAX_SEED - 1, out=str(tmp_path / "o")))
    assert p.identity["seed"] == MAX_SEED - 1


@pytest.mark.parametrize("argv, flag", [
    (["eval", "--temperature", "nan"], "--temperature"),
    (["eval", "--temperature", "inf"], "--temperature"),
    (["eval", "--top-p", "nan"], "--top-p"),
    (["eval", "--seed", "-1"], "--seed"),
    (["eval", "--seed", str(MAX_SEED)], "--seed"),
    (["compare-solvers", "--preset", "small", "--sizes", "4", "--count", "1", "--seed", str(MAX_SEED)], "--seed"),
])
def test_cli_same_rules(tmp_path, capsys, argv, flag):
    rc = main([*argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"error: {flag}: must be" in err, err
    assert not (tmp_path / "o").exists()
