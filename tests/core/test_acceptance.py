"""Calibrated acceptance: learns observed acceptance, keeps path probabilities non-increasing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.acceptance import AcceptanceCalibrator, greedy_trials, verify_trials
from specfit.core.errors import SpecFitInputError
from specfit.core.tree import DraftTree


def test_prior_is_the_draft_probability():
    cal = AcceptanceCalibrator()
    q = np.array([0.01, 0.3, 0.77, 1.0])
    assert np.allclose(cal.conditional(q, [1, 2, 3, 9]), q)


def test_learns_an_understating_draft():
    cal = AcceptanceCalibrator(prior_strength=4.0)
    q = np.full(400, 0.35)
    cal.update(q, np.ones(400, dtype=int), np.arange(400) < 280)  # accepted 70% of the time
    c = float(cal.conditional([0.35], [1])[0])
    assert c == pytest.approx((4.0 * 0.35 + 280) / 404)
    assert float(cal.conditional([0.35], [2])[0]) == pytest.approx(0.35)  # other depths untouched


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_calibrated_path_probabilities_are_a_valid_draft_tree(data):
    cal = AcceptanceCalibrator(max_depth=4)
    m = data.draw(st.integers(1, 200))
    cal.update(data.draw(st.lists(st.floats(0, 1), min_size=m, max_size=m)),
               data.draw(st.lists(st.integers(1, 6), min_size=m, max_size=m)),
               data.draw(st.lists(st.booleans(), min_size=m, max_size=m)))
    pp, parents = np.array([1.0]), [-1]
    for depth in range(1, 5):
        prev = [v for v in range(len(parents)) if (depth == 1 and v == 0) or (v and v >= len(parents) - 16)]
        par = np.array(data.draw(st.lists(st.sampled_from(prev), min_size=1, max_size=8)))
        q = np.array(data.draw(st.lists(st.floats(0, 1), min_size=len(par), max_size=len(par))))
        new = cal.level_path_prob(pp, par, q, np.full(len(par), depth))
        sums = np.zeros(len(pp))
        np.add.at(sums, par, new / np.where(pp[par] > 0, pp[par], 1.0))
        assert np.all(sums <= 1.0 + 1e-9)  # one node's children: mutually exclusive acceptance
        pp = np.concatenate([pp, new])
        parents += par.tolist()
    DraftTree(parents, path_prob=pp)  # validates P in [0, 1] and non-increasing along paths
    for j in range(1, 5):  # the gate's bound holds every node
        assert cal.max_conditional(j) >= cal.conditional(np.linspace(0, 1, 101), np.full(101, j)).max() - 1e-12


class ReferenceCalibrator(AcceptanceCalibrator):
    """The module docstring's formulas with plain np.clip and np.add.at (no shortcuts)."""

    def conditional(self, q, depth):
        q = np.clip(np.asarray(q, dtype=np.float64), 0.0, 1.0)
        d = np.clip(np.asarray(depth, dtype=np.int64), 1, self.max_depth) - 1
        b = np.searchsorted(self.edges, q, side="left")
        s = self.prior_strength
        return (s * q + self.accepted[d, b]) / (s + self.trials[d, b])

    def level_path_prob(self, parent_cal, parents, q, depth):
        par = np.asarray(parents, dtype=np.int64)
        c = self.conditional(q, depth)
        total = np.zeros(len(parent_cal))
        np.add.at(total, par, c)
        scale = np.where(total > 1.0, 1.0 / np.maximum(total, 1e-300), 1.0)
        return np.asarray(parent_cal)[par] * np.minimum(c * scale[par], 1.0)

    def update(self, q, depth, accepted):
        q = np.clip(np.asarray(q, dtype=np.float64), 0.0, 1.0)
        if q.size == 0:
            return
        d = np.clip(np.asarray(depth, dtype=np.int64), 1, self.max_depth) - 1
        b = np.searchsorted(self.edges, q, side="left")
        np.add.at(self.trials, (d, b), 1.0)
        np.add.at(self.accepted, (d, b), np.asarray(accepted, dtype=np.float64))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_calibration_equals_the_reference_bit_for_bit(data):
    """bincount / flat add.at / min-max clipping give the very bits of np.add.at and np.clip, with
    sibling sums above 1, q outside [0, 1], depths beyond max_depth and empty levels."""
    max_depth = data.draw(st.integers(1, 5))
    fast, ref = AcceptanceCalibrator(max_depth=max_depth), ReferenceCalibrator(max_depth=max_depth)
    qs = st.floats(-0.5, 1.5, allow_nan=False)
    for _ in range(data.draw(st.integers(1, 4))):
        m = data.draw(st.integers(0, 30))
        q = data.draw(st.lists(qs, min_size=m, max_size=m))
        depth = data.draw(st.lists(st.integers(0, 8), min_size=m, max_size=m))
        ok = data.draw(st.lists(st.booleans(), min_size=m, max_size=m))
        fast.update(q, depth, ok)
        ref.update(q, depth, ok)
        np.testing.assert_array_equal(fast.trials, ref.trials)
        np.testing.assert_array_equal(fast.accepted, ref.accepted)
        n = data.draw(st.integers(1, 6))
        parent_cal = np.asarray(data.draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)))
        m = data.draw(st.integers(0, 24))
        par = data.draw(st.lists(st.integers(0, n - 1), min_size=m, max_size=m))  # many siblings: sums > 1
        q = data.draw(st.lists(qs, min_size=m, max_size=m))
        depth = data.draw(st.lists(st.integers(0, 8), min_size=m, max_size=m))
        np.testing.assert_array_equal(fast.conditional(q, depth), ref.conditional(q, depth))
        np.testing.assert_array_equal(fast.level_path_prob(parent_cal, par, q, depth),
                                      ref.level_path_prob(parent_cal, par, q, depth))


def test_update_records_into_tables_a_caller_replaced():
    """update adds into flat views; a non-contiguous table assigned from outside must still count."""
    cal = AcceptanceCalibrator(max_depth=3)
    cal.trials = np.zeros((cal.trials.shape[1], 3)).T  # same shape, not C-contiguous
    cal.accepted = np.zeros((cal.trials.shape[1], 3)).T
    cal.update([0.5, 0.5, 0.01], [1, 1, 3], [True, False, True])
    assert cal.trials.sum() == 3 and cal.accepted.sum() == 2
    assert cal.conditional([0.5], [1])[0] == pytest.approx((4.0 * 0.5 + 1) / (4.0 + 2))


def test_verify_trials_are_children_of_the_accepted_path():
    # 0 -> 1 -> 3, 0 -> 2, 1 -> 4, 3 -> 5; accepted path 0, 1, 3
    nodes, ok = verify_trials([-1, 0, 0, 1, 1, 3], [0, 1, 3])
    assert nodes.tolist() == [1, 2, 3, 4, 5] and ok.tolist() == [True, False, True, False, False]
    nodes, ok = verify_trials([-1, 0, 1], [0])
    assert nodes.tolist() == [1] and ok.tolist() == [False]  # node 2's parent was rejected: no trial


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_greedy_trials_of_a_fully_verified_tree_are_its_verify_trials(data):
    n = data.draw(st.integers(2, 12))
    parents = [-1] + [data.draw(st.integers(0, v - 1)) for v in range(1, n)]
    tokens = [0] + [data.draw(st.integers(0, 3)) for _ in range(1, n)]  # few tokens: equal siblings happen
    target_next = [data.draw(st.integers(0, 3)) for _ in range(n)]  # the target's greedy token after each node
    path = [0]  # greedy verification: follow the first child carrying the target's token
    while True:
        kids = [c for c in range(n) if parents[c] == path[-1] and tokens[c] == target_next[path[-1]]]
        if not kids:
            break
        path.append(kids[0])
    g_nodes, g_ok = greedy_trials(parents, tokens, path, target_next[path[-1]])
    v_nodes, v_ok = verify_trials(parents, path)
    assert g_nodes.tolist() == v_nodes.tolist() and g_ok.tolist() == v_ok.tolist()


def test_greedy_trials_count_unverified_children_of_accepted_nodes():
    # drafted: 0 -> 1 -> 3, 0 -> 2, 1 -> 4; verified {0, 1}; the target's token after 1 is 40 (node 4's)
    parents, tokens = [-1, 0, 0, 1, 1], [7, 10, 20, 30, 40]
    nodes, ok = greedy_trials(parents, tokens, [0, 1], bonus_token=40)
    assert nodes.tolist() == [1, 2, 3, 4] and ok.tolist() == [True, False, False, True]


@pytest.mark.parametrize("kwargs,field", [({"max_depth": 0}, "max_depth"), ({"prior_strength": 0.0}, "prior_strength"),
                                          ({"edges": (0.5, 0.2)}, "edges")])
def test_bad_settings_are_refused(kwargs, field):
    with pytest.raises(SpecFitInputError, match=field):
        AcceptanceCalibrator(**kwargs)
