"""The engine's per-level drafted-tree step: the compiled calibrated path against the numpy steps it replaces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.acceptance import AcceptanceCalibrator
from specfit.core.errors import SpecFitInputError
from specfit.engine.decoder import _Drafted
from specfit.solvers.stop import selectable, selectable_threshold

probs = st.floats(0, 1)


def _calibrator(data) -> AcceptanceCalibrator:
    cal = AcceptanceCalibrator(max_depth=4, rank_classes=data.draw(st.sampled_from([1, 2])))
    m = data.draw(st.integers(0, 60))
    cal.update(data.draw(st.lists(probs, min_size=m, max_size=m)),
               data.draw(st.lists(st.integers(1, 6), min_size=m, max_size=m)),
               data.draw(st.lists(st.booleans(), min_size=m, max_size=m)))
    k = data.draw(st.integers(0, 6))
    cal.observe_paths(data.draw(st.lists(probs, min_size=k, max_size=k)),
                      data.draw(st.lists(st.integers(1, 6), min_size=k, max_size=k)), data.draw(st.integers(0, 6)))
    return cal


def _drafted(data) -> _Drafted:
    """A drafted tree of n nodes: random depths, head, calibrated and objective probabilities, and
    which of them are priced (the root always), in buffers that may be too small for the next level."""
    n = data.draw(st.integers(1, 8))
    d = _Drafted.of_root(7, data.draw(st.integers(1, 12)))
    d._reserve(n)
    d.n = n
    for name in ("raw", "cal", "pp"):
        getattr(d, name)[1:n] = data.draw(st.lists(probs, min_size=n - 1, max_size=n - 1))
    d.depth[1:n] = data.draw(st.lists(st.integers(1, 5), min_size=n - 1, max_size=n - 1))
    priced = [0] + [i for i in range(1, n) if data.draw(st.booleans())]
    d.tree_ids[:n] = -1
    d.tree_ids[priced] = np.arange(len(priced))
    d.full_ids = np.asarray(priced, dtype=np.int64)
    return d


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_add_calibrated_equals_the_numpy_steps(data):
    """add_calibrated (one compiled call) writes and returns, bit for bit, what the numpy steps give:
    the head's P kept non-increasing, q, depth, level_probs' P̂ / P / rank, selectable's keep, the
    kept nodes' priced ids, and the running sum and maximum of the kept P."""
    cal, d = _calibrator(data), _drafted(data)
    n = d.n
    m = data.draw(st.integers(1, 16))
    par = np.asarray(data.draw(st.lists(st.integers(0, n - 1), min_size=m, max_size=m)), dtype=np.int64)
    tok = np.asarray(data.draw(st.lists(st.integers(0, 1000), min_size=m, max_size=m)), dtype=np.int64)
    head = np.asarray(data.draw(st.lists(probs, min_size=m, max_size=m)))
    prune = data.draw(st.booleans())
    node_ms, rate_lo = data.draw(st.floats(0, 5)), data.draw(st.floats(0, 2000))
    threshold = selectable_threshold(node_ms, rate_lo) if prune else -np.inf
    first, pp_sum = int(d.tree_ids[:n].max()) + 1, data.draw(st.floats(1, 5))

    up = d.raw[par].copy()
    raw = np.minimum(head, up)
    q = raw / np.maximum(up, 1e-300)
    depth = d.depth[par] + 1
    p_hat, pp, rank = cal.level_probs(d.cal[:n].copy(), d.pp[:n].copy(), par, q, depth)
    keep = d.tree_ids[par] >= 0
    if prune and data.draw(st.booleans()):  # a node exactly at the threshold is kept
        threshold = float(pp[data.draw(st.integers(0, m - 1))])
        keep &= pp >= threshold
    elif prune:
        keep &= selectable(pp, node_ms, rate_lo)
    kept = keep.nonzero()[0]
    kept_parents = d.tree_ids[par[kept]].copy()
    full_before = d.full_ids.tolist()

    got = d.add_calibrated(cal, par, tok, head, threshold, first, pp_sum)
    assert got[0].tolist() == kept.tolist() and got[1].tolist() == kept_parents.tolist()
    np.testing.assert_array_equal(got[2], pp[kept])
    assert got[3] == sum(pp[kept].tolist(), pp_sum) and got[4] == max(pp[kept].tolist(), default=0.0)
    assert d.n == n + m
    new = slice(n, n + m)
    assert d.parents[new].tolist() == par.tolist() and d.tokens[new].tolist() == tok.tolist()
    assert d.depth[new].tolist() == depth.tolist()
    assert d.rank[new].tolist() == (np.zeros(m, int) if rank is None else rank).tolist()
    for name, ref in (("raw", raw), ("q", q), ("cal", p_hat), ("pp", pp)):
        np.testing.assert_array_equal(getattr(d, name)[new], ref, err_msg=name)
    expected_ids = np.full(m, -1)
    expected_ids[kept] = np.arange(first, first + kept.size)
    assert d.tree_ids[new].tolist() == expected_ids.tolist()
    assert d.full_ids.tolist() == full_before + (n + kept).tolist()


@pytest.mark.parametrize("bad", [np.nan, -0.25])
def test_add_calibrated_refuses_a_bad_head_probability_and_writes_nothing(bad):
    d = _Drafted.of_root(3, 4)
    with pytest.raises(SpecFitInputError, match="path_prob"):
        d.add_calibrated(AcceptanceCalibrator(max_depth=2), np.zeros(2, np.int64), np.ones(2, np.int64),
                         np.array([0.5, bad]), -np.inf, 1, 1.0)
    assert d.n == 1 and d.full_ids.tolist() == [0] and d.raw[1] == 1.0
