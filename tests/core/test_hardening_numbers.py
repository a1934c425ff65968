"""Numbers at their edges: one rule per kind at every entry point (instance JSON, ``select()``,
the API's keyword arguments, the evaluation's settings).

* a number is finite and inside its documented range (NaN, infinities, ``-0.0``, huge values);
* an integer is an integer: not a float (``2.0`` too), not a bool, not a numeric string;
* ids are unique where a set is meant (a node's experts in one layer, a layer's cache);
* sizes that drive memory have an upper bound (``MAX_EXPERTS``, ``MAX_LAYERS``, ``MAX_NODES``);
* the error names the field and the rule; an accepted instance's selection is strict JSON.
"""

from __future__ import annotations

import copy
import json
import math

import networkx as nx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specfit.core.errors import (MAX_EXPERTS, MAX_MS, MAX_NODES, MAX_SEED, MIN_CYCLE_MS, SpecFitInputError, check_int,
                                 check_number, check_seed)
from specfit.core.instance import Instance
from specfit.solvers import select
from tests.strategies import edge_floats, edge_integers, non_integers, non_numbers

BASE = {"parents": [-1, 0, 0], "path_prob": [1.0, 0.6, 0.3], "num_experts": 4, "tokens": [5, 6, 7],
        "experts": [[[0, 1]], [[1, 2]], [[2, 3]]], "cache": [[0]], "max_nodes": 3, "max_new_experts_per_layer": 4,
        "cost": {"fixed_ms": 5.0, "per_node_ms": 0.3, "per_expert_ms": 0.2}}


def _with(path, value) -> dict:
    obj = copy.deepcopy(BASE)
    *head, last = path
    node = obj
    for key in head:
        node = node[key]
    node[last] = value
    return obj


def _refused(obj, field_prefix: str) -> SpecFitInputError:
    with pytest.raises(SpecFitInputError) as info:
        Instance.from_json(obj)
    assert info.value.field.startswith(field_prefix), (info.value.field, field_prefix)
    return info.value


INT_FIELDS = [(("num_experts",), "num_experts"), (("max_nodes",), "max_nodes"),
              (("max_new_experts_per_layer",), "max_new_experts_per_layer"), (("parents", 1), "parents"),
              (("tokens", 2), "tokens"), (("experts", 1, 0, 0), "experts"), (("cache", 0, 0), "cache[0]")]
NUMBER_FIELDS = [(("path_prob", 1), "path_prob"), (("cost", "fixed_ms"), "cost.fixed_ms"),
                 (("cost", "per_node_ms"), "cost.per_node_ms"), (("cost", "per_expert_ms"), "cost.per_expert_ms")]


@pytest.mark.parametrize("path, field", INT_FIELDS, ids=[f for _, f in INT_FIELDS])
@settings(max_examples=40, deadline=None)
@given(value=non_integers())
def test_integer_fields_take_integers_only(path, field, value):
    """Floats (``0.0`` as a parent too), bools, numeric strings and None are refused where an integer
    goes, naming the field: never converted, never reported as something else (None is "absent" for the
    optional budgets)."""
    assume(not (value is None and field.startswith("max_")))
    err = _refused(_with(path, value), field)
    assert "ragged" not in err.rule or isinstance(value, list)


@pytest.mark.parametrize("path, field", NUMBER_FIELDS, ids=[f for _, f in NUMBER_FIELDS])
@settings(max_examples=30, deadline=None)
@given(value=non_numbers())
def test_number_fields_take_finite_numbers_only(path, field, value):
    _refused(_with(path, value), field)


def test_string_probabilities_refused_in_the_json_as_in_select():
    _refused(_with(("path_prob",), ["1.0", "0.6", "0.3"]), "path_prob")
    g = nx.DiGraph(num_experts=4)
    g.add_node(0, path_prob="1.0", experts=[[0]])
    with pytest.raises(SpecFitInputError):
        select(g, "qwen3-30b-a3b-pcie4")


@settings(max_examples=40, deadline=None)
@given(value=edge_integers(1, MAX_EXPERTS))
def test_num_experts_bounded(value):
    """``num_experts`` of 1e9 was taken and ran for a minute in 8 GB; now refused at once."""
    err = _refused(_with(("num_experts",), value), "num_experts")
    assert str(MAX_EXPERTS) in err.rule


def test_node_count_bounded():
    n = MAX_NODES + 1
    obj = _with(("parents",), [-1] + [0] * (n - 1))
    obj.update(path_prob=[1.0] + [0.5] * (n - 1), tokens=None, experts=[[[0, 1]]] * n)
    obj.pop("tokens")
    assert "MAX_NODES" in _refused(obj, "parents").rule


@pytest.mark.parametrize("path, value, field, words", [
    (("experts", 1, 0), [3, 3], "experts[1][0]", "twice"),
    (("cache", 0), [0, 2, 0], "cache[0]", "twice"),
    (("experts", 0, 0, 1), 10 ** 30, "experts", "int64"),
    (("cost",), {"regime": "disk", "fixed_ms": 1.0, "per_node_ms": 0.1, "per_expert_ms": 0.1}, "cost.regime", "'disk'"),
    (("experts", 1, 0), [], "experts[1][0]", "at least one expert"),
    (("cost",), {"fixed_ms": 1e-320, "per_node_ms": 0.0, "per_expert_ms": 0.0}, "cost.fixed_ms", ">= 1e-06"),
    (("cost", "per_expert_ms"), 1e308, "cost.per_expert_ms", "1e+09"),
])
def test_the_message_names_the_rule_that_broke(path, value, field, words):
    """Duplicates where a set is meant, an id beyond int64 (was "ragged lists"), an unknown regime (was
    "cost.gpu is required"), an empty layer (was "ragged layers"), a cycle of ~0 ms and a huge cost
    (both gave ``Infinity`` in the output)."""
    err = _refused(_with(path, value), field)
    assert err.field == field and words in err.rule, (err.field, err.rule)


def test_select_graph_refuses_repeated_experts():
    g = nx.DiGraph(num_experts=4)
    g.add_node("r", path_prob=1.0, experts=[[0, 1]])
    g.add_node("a", path_prob=0.5, experts=[[2, 2]])
    g.add_edge("r", "a")
    with pytest.raises(SpecFitInputError) as info:
        select(g, "qwen3-30b-a3b-pcie4")
    assert info.value.field == "graph.nodes['a'].experts[0]" and "twice" in info.value.rule


@settings(max_examples=60, deadline=None)
@given(fixed=st.sampled_from([0.0, MIN_CYCLE_MS, 1.0, MAX_MS]), node=st.sampled_from([0.0, MIN_CYCLE_MS, MAX_MS]),
       expert=st.sampled_from([0.0, 5e-324, 1.0, MAX_MS]), rate=st.sampled_from([None, 0.0, 1e9]))
def test_accepted_extremes_give_strict_json(fixed, node, expert, rate):
    """Every instance the rules accept has a selection a strict JSON parser reads (no NaN/Infinity)."""
    obj = _with(("cost",), {"fixed_ms": fixed, "per_node_ms": node, "per_expert_ms": expert})
    try:
        inst = Instance.from_json(obj)
    except SpecFitInputError as exc:
        assert fixed + node < MIN_CYCLE_MS and exc.field == "cost.fixed_ms"
        return
    text = json.dumps(select(inst, rate=rate).to_json(), allow_nan=False)
    assert all(math.isfinite(v) for v in json.loads(text).values() if isinstance(v, float))


@settings(max_examples=60, deadline=None)
@given(value=st.one_of(non_numbers(), edge_floats(0.0, 1e9)))
def test_select_rate_one_rule(value):
    assume(value is not None)  # None: ratio mode
    with pytest.raises(SpecFitInputError) as info:
        select(Instance.from_json(BASE), rate=value)
    assert info.value.field == "rate"


@pytest.mark.parametrize("solver", ["exact", "cpsat"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0, True, "5"])
def test_time_limit_one_rule(solver, value):
    with pytest.raises(SpecFitInputError) as info:
        select(Instance.from_json(BASE), solver=solver, time_limit_s=value)
    assert info.value.field == "time_limit_s"


@pytest.mark.parametrize("value", [2.0, True, "2", -1])
def test_select_budget_overrides_are_integers(value):
    with pytest.raises(SpecFitInputError) as info:
        select(Instance.from_json(BASE), max_nodes=value)
    assert info.value.field == "max_nodes"


@settings(max_examples=80, deadline=None)
@given(value=non_integers())
def test_check_int_refuses_every_non_integer(value):
    with pytest.raises(SpecFitInputError) as info:
        check_int("f", value, 0, 10)
    assert info.value.field == "f" and "integer" in info.value.rule


@settings(max_examples=80, deadline=None)
@given(value=st.one_of(non_numbers(), edge_floats(0.0, 1.0)))
def test_check_number_refuses_every_non_number_and_out_of_range(value):
    with pytest.raises(SpecFitInputError) as info:
        check_number("f", value, 0.0, 1.0)
    assert info.value.field == "f" and "finite number" in info.value.rule


def test_check_number_reads_minus_zero_as_zero():
    assert math.copysign(1.0, check_number("f", -0.0, 0.0)) == 1.0


@settings(max_examples=60, deadline=None)
@given(value=st.one_of(non_integers(), edge_integers(0, MAX_SEED - 1)))
def test_seeds_one_range(value):
    """A seed is an integer in [0, 2**63): floats (1.5), numeric strings ("7"), bools, negatives and
    2**63 are refused with the field's name (they raised torch's RuntimeError or wrapped modulo 2**63)."""
    with pytest.raises(SpecFitInputError) as info:
        check_seed("seed", value)
    assert info.value.field == "seed" and "2**63" in info.value.rule
    assert check_seed("seed", MAX_SEED - 1) == MAX_SEED - 1 and check_seed("seed", 0) == 0
