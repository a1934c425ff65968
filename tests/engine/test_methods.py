"""Methods are configurations; what each needs is read from its properties, never from its name."""

from types import SimpleNamespace

import pytest

from specfit.core.cost import get_profile
from specfit.core.errors import SpecFitInputError
from specfit.engine import METHODS, Method, SpecDecoder


@pytest.mark.parametrize("name, drafts, cost_aware, needs_predictor, needs_reference", [
    ("ar", False, False, False, False),
    ("ar+lookahead", False, False, True, False),
    ("eagle3-vanilla", True, False, False, False),
    ("eagle3", True, False, False, False),
    ("eagle3-scan", True, True, True, False),
    ("specfit", True, True, True, False),
    ("oracle", True, True, False, True),
])
def test_method_properties(name, drafts, cost_aware, needs_predictor, needs_reference):
    m = METHODS[name]
    assert (m.drafts, m.cost_aware, m.needs_predictor, m.needs_reference) == (
        drafts, cost_aware, needs_predictor, needs_reference)
    assert m.needs_experts == (drafts and cost_aware)
    assert m.needs_drafter == (drafts or m.lookahead_levels > 0)


def test_a_new_method_is_described_by_its_solver_not_its_name():
    m = Method("my-greedy", drafts=True, selector="greedy")
    assert m.cost_aware and m.needs_predictor  # greedy prices experts (Solver.cost_aware)


@pytest.mark.parametrize("method, kwargs, field", [
    ("specfit", dict(drafter=object(), cost=get_profile("qwen3-30b-a3b-pcie4")), "predictor"),
    ("eagle3-scan", dict(drafter=object(), predictor=object()), "cost"),
    ("oracle", dict(drafter=object(), cost=get_profile("qwen3-30b-a3b-pcie4")), "reference"),
    ("eagle3", dict(), "drafter"),
    ("ar+lookahead", dict(predictor=object()), "drafter"),
    ("ar+lookahead", dict(drafter=object()), "predictor"),
])
def test_decoder_asks_for_what_the_method_needs(method, kwargs, field):
    target = SimpleNamespace(spec=SimpleNamespace(num_experts=8, top_k=2))
    with pytest.raises(SpecFitInputError) as err:
        SpecDecoder(target, method=method, **kwargs)
    assert err.value.field == field


def test_oracle_needs_no_predictor():
    target = SimpleNamespace(spec=SimpleNamespace(num_experts=8, top_k=2))
    dec = SpecDecoder(target, object(), "oracle", cost=get_profile("qwen3-30b-a3b-pcie4"), reference=target)
    assert dec.solver.name == "exact"
