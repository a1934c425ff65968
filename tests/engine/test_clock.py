"""The engine's clocks: a counted clock's host time is the sum of the prices of the work charged, a
function of the counts alone; the measured and frozen clocks ignore charges."""

import math

import pytest

from specfit.core.errors import SpecFitInputError
from specfit.core.host_cost import HOST_WORK, HostCosts
from specfit.engine.clock import CLOCKS, CountedClock, FrozenClock, MeasuredClock, make_clock

PRICES = HostCosts(**{k: 0.01 * (i + 1) for i, k in enumerate(HOST_WORK)})


def test_a_counted_clock_sums_the_prices_of_the_work_charged():
    clock = CountedClock(PRICES)
    assert clock.cpu() == 0.0
    clock.charge("cycle")
    clock.charge("predict_node", 7)
    clock.charge("solve_node", 2.5)
    want_ms = PRICES.cycle + 7 * PRICES.predict_node + 2.5 * PRICES.solve_node
    assert math.isclose(clock.cpu(), want_ms / 1e3, rel_tol=1e-12)
    assert clock.counts["cycle"] == 1 and clock.counts["predict_node"] == 7 and clock.counts["solve"] == 0


def test_a_counted_interval_does_not_depend_on_the_work_done_between_reads():
    """Host time read as an interval (c0 = cpu(); work; cpu() - c0) is the priced counts, however long
    the work really ran."""
    clock = CountedClock(PRICES)
    c0 = clock.cpu()
    sum(i * i for i in range(200_000))  # real CPU work, not charged
    assert clock.cpu() - c0 == 0.0
    clock.charge("level", 3)
    assert math.isclose((clock.cpu() - c0) * 1e3, 3 * PRICES.level, rel_tol=1e-12)


def test_a_counted_clock_still_reads_the_machines_thread_and_wall_time():
    clock = CountedClock(PRICES)
    t0, w0 = clock.thread(), clock.wall()
    sum(i * i for i in range(300_000))
    assert clock.thread() > t0 and clock.wall() > w0


def test_an_unknown_kind_of_host_work_is_refused_naming_the_field():
    with pytest.raises(SpecFitInputError) as e:
        CountedClock(PRICES).charge("gate")
    assert e.value.field == "kind"


def test_the_measured_and_frozen_clocks_ignore_charges():
    m, f = MeasuredClock(), FrozenClock()
    m.charge("cycle", 1e9)
    f.charge("cycle", 1e9)
    assert f.cpu() == f.wall() == f.thread() == 0.0
    assert m.cpu() < 1e6  # a charge adds nothing to the measured thread time


def test_make_clock_names_the_clocks():
    assert set(CLOCKS) == {"counted", "measured"}
    assert isinstance(make_clock("counted", PRICES), CountedClock)
    assert isinstance(make_clock("measured"), MeasuredClock)
    for bad, field in ((("frozen", PRICES), "clock"), (("counted", None), "host_costs")):
        with pytest.raises(SpecFitInputError) as e:
            make_clock(*bad)
        assert e.value.field == field
