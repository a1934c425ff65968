"""Calibrated acceptance: learns observed acceptance, keeps path probabilities non-increasing."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.acceptance import AcceptanceCalibrator, greedy_trials, sibling_rank, verify_trials
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
    # another depth has no trials: its prior is the same rank class and bin pooled over the other depths
    assert float(cal.conditional([0.35], [2])[0]) == pytest.approx(c)
    assert float(cal.conditional([0.35], [1], [1])[0]) == pytest.approx(c)  # one rank class: ranks ignored
    two = AcceptanceCalibrator(prior_strength=4.0, rank_classes=2)
    two.update(q, np.ones(400, dtype=int), np.arange(400) < 280)
    assert float(two.conditional([0.35], [1])[0]) == pytest.approx(c)
    assert float(two.conditional([0.35], [1], [1])[0]) == pytest.approx(0.35)  # the other rank class untouched


def test_the_most_likely_sibling_and_the_others_are_calibrated_apart():
    cal = AcceptanceCalibrator(rank_classes=2)
    rank = np.tile([0, 1, 1, 1], 100)  # the most likely child accepted 90% of the time, the others 4 of 300
    ok = np.where(rank == 0, np.arange(400) % 40 < 36, np.arange(400) % 50 == 0)
    cal.update(np.full(400, 0.25), np.ones(400, dtype=int), ok, rank)
    top, other = cal.conditional([0.25, 0.25], [1, 1], [0, 1])
    assert top == pytest.approx((4 * 0.25 + 90) / 104) and other == pytest.approx((4 * 0.25 + 4) / 304)
    # one parent's children: the most likely keeps its calibrated value, the others share what it leaves
    pp, rk = cal.level(np.array([1.0]), [0, 0, 0, 0], [0.3, 0.25, 0.25, 0.2], [1, 1, 1, 1])
    assert rk.tolist() == [0, 1, 1, 1] and pp[0] == pytest.approx(float(cal.conditional([0.3], [1], [0])[0]))
    assert pp.sum() <= 1.0 + 1e-12 and np.all(pp[1:] <= cal.conditional([0.25, 0.25, 0.2], [1, 1, 1], [1, 1, 1]) + 1e-12)


def test_sibling_rank_marks_the_most_likely_children():
    assert sibling_rank([0, 0, 1, 0, 1, 2], [0.1, 0.5, 0.3, 0.5, 0.9, 0.2]).tolist() == [1, 0, 1, 0, 0, 0]
    assert sibling_rank([], []).tolist() == []


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_calibrated_path_probabilities_are_a_valid_draft_tree(data):
    cal = AcceptanceCalibrator(max_depth=4, rank_classes=data.draw(st.sampled_from([1, 2])))
    m = data.draw(st.integers(1, 200))
    cal.update(data.draw(st.lists(st.floats(0, 1), min_size=m, max_size=m)),
               data.draw(st.lists(st.integers(1, 6), min_size=m, max_size=m)),
               data.draw(st.lists(st.booleans(), min_size=m, max_size=m)),
               data.draw(st.lists(st.integers(0, 3), min_size=m, max_size=m)))
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
    for j in range(1, 5):  # the gate's bound holds every node, of either rank class
        for r in range(2):
            c = cal.conditional(np.linspace(0, 1, 101), np.full(101, j), np.full(101, r))
            assert cal.max_conditional(j) >= c.max() - 1e-12


class ReferenceCalibrator(AcceptanceCalibrator):
    """The module docstring's formulas with plain loops over nodes and cells (no shortcuts)."""

    def _cell3(self, q, depth, rank):
        d = min(max(int(depth), 1), self.max_depth) - 1
        return d, min(int(rank), self.rank_classes - 1), int(np.searchsorted(self.edges, q, side="left"))

    def conditional(self, q, depth, rank=None):
        q = np.clip(np.asarray(q, dtype=np.float64), 0.0, 1.0)
        rank = np.zeros(q.size, dtype=int) if rank is None else rank
        s, out = self.prior_strength, np.empty(q.size)
        for i in range(q.size):
            d, r, b = self._cell3(q[i], depth[i], rank[i])
            n, a = self.trials[d, r, b], self.accepted[d, r, b]
            on, oa = self.trials[:, r, b].sum() - n, self.accepted[:, r, b].sum() - a
            prior = (s * q[i] + oa) / (s + on)
            out[i] = (s * prior + a) / (s + n)
        return out

    def level_path_prob(self, parent_cal, parents, q, depth):
        q = np.clip(np.asarray(q, dtype=np.float64), 0.0, 1.0)
        par = [int(p) for p in parents]
        rank = [int(any(q[j] > q[i] for j in range(len(par)) if par[j] == par[i])) for i in range(len(par))]
        c = np.minimum(self.conditional(q, depth, rank), 1.0)
        out = np.empty(len(par))
        for i, p in enumerate(par):
            top = sum(c[j] for j in range(len(par)) if par[j] == p and rank[j] == 0)
            rest = sum(c[j] for j in range(len(par)) if par[j] == p and rank[j] == 1)
            scale = 1.0
            if top + rest > 1.0:
                top_scale = min(1.0, 1.0 / max(top, 1e-300))
                scale = top_scale if rank[i] == 0 else min(1.0, (1.0 - top * top_scale) / max(rest, 1e-300))
            out[i] = parent_cal[p] * c[i] * scale
        return out

    def update(self, q, depth, accepted, rank=None):
        q = np.clip(np.asarray(q, dtype=np.float64), 0.0, 1.0)
        rank = np.zeros(q.size, dtype=int) if rank is None else rank
        for i in range(q.size):
            cell = self._cell3(q[i], depth[i], rank[i])
            self.trials[cell] += 1.0
            self.accepted[cell] += float(accepted[i])


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_calibration_equals_the_reference(data):
    """The vectorised calibrator against plain loops over the module docstring's formulas, with sibling
    sums above 1, tied most likely siblings, q outside [0, 1], depths beyond max_depth and empty levels."""
    max_depth = data.draw(st.integers(1, 5))
    k = data.draw(st.sampled_from([1, 2]))
    fast, ref = AcceptanceCalibrator(max_depth=max_depth, rank_classes=k), ReferenceCalibrator(max_depth=max_depth, rank_classes=k)
    qs = st.one_of(st.floats(-0.5, 1.5, allow_nan=False), st.sampled_from([0.25, 0.5]))  # ties happen
    for _ in range(data.draw(st.integers(1, 4))):
        m = data.draw(st.integers(0, 30))
        q = data.draw(st.lists(qs, min_size=m, max_size=m))
        depth = data.draw(st.lists(st.integers(0, 8), min_size=m, max_size=m))
        ok = data.draw(st.lists(st.booleans(), min_size=m, max_size=m))
        rank = data.draw(st.lists(st.integers(0, 3), min_size=m, max_size=m))
        fast.update(q, depth, ok, rank)
        ref.update(q, depth, ok, rank)
        np.testing.assert_array_equal(fast.trials, ref.trials)
        np.testing.assert_array_equal(fast.accepted, ref.accepted)
        n = data.draw(st.integers(1, 6))
        parent_cal = np.asarray(data.draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)))
        m = data.draw(st.integers(0, 24))
        par = data.draw(st.lists(st.integers(0, n - 1), min_size=m, max_size=m))  # many siblings: sums > 1
        q = data.draw(st.lists(qs, min_size=m, max_size=m))
        depth = data.draw(st.lists(st.integers(0, 8), min_size=m, max_size=m))
        rank = data.draw(st.lists(st.integers(0, 1), min_size=m, max_size=m))
        np.testing.assert_allclose(fast.conditional(q, depth, rank), ref.conditional(q, depth, rank), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(fast.level_path_prob(parent_cal, par, q, depth),
                                   ref.level_path_prob(parent_cal, par, q, depth), rtol=1e-12, atol=1e-15)


def test_update_records_into_tables_a_caller_replaced():
    """update adds into flat views; a non-contiguous table assigned from outside must still count."""
    cal = AcceptanceCalibrator(max_depth=3)
    cal.trials = np.zeros(cal.trials.shape[::-1]).T  # same shape, not C-contiguous
    cal.accepted = np.zeros(cal.accepted.shape[::-1]).T
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
                                          ({"edges": (0.5, 0.2)}, "edges"), ({"rank_classes": 3}, "rank_classes")])
def test_bad_settings_are_refused(kwargs, field):
    with pytest.raises(SpecFitInputError, match=field):
        AcceptanceCalibrator(**kwargs)


def test_path_correction_learns_the_committed_depths():
    """f_d = (verifies that accepted a node at depth d + s) / (summed P̂ of the verified nodes there + s)."""
    cal = AcceptanceCalibrator(max_depth=3, prior_strength=4.0)
    assert cal.path_factor.tolist() == [1.0, 1.0, 1.0, 1.0]
    for _ in range(10):  # depth 1 and 2 nodes at P̂ 0.5 and 0.25; each verify accepted both
        cal.observe_paths([0.5, 0.25], [1, 2], accepted=2)
    assert cal.path_factor[1] == pytest.approx((10 + 4) / (5 + 4))
    assert cal.path_factor[2] == pytest.approx((10 + 4) / (2.5 + 4))
    assert cal.path_factor[3] == pytest.approx(1.0)  # nothing verified there
    cal.observe_paths([0.1], [7], accepted=5)  # depths past max_depth share the last one's counts
    assert cal.path_factor[3] == pytest.approx((3 + 4) / (0.1 + 4))
    cal.observe_paths([], [], accepted=0)  # nothing verified: no change
    assert cal.path_factor[3] == pytest.approx((3 + 4) / (0.1 + 4))


def test_path_correction_keeps_a_valid_draft_tree():
    cal = AcceptanceCalibrator(max_depth=2)
    cal.path_factor[:] = [1.0, 1.6, 3.0]  # an under-counting product at both depths
    parent_pp = np.array([1.0])
    pp = cal.path_prob(parent_pp, [0, 0, 0], [0.5, 0.2, 0.1], [1, 1, 1])
    assert pp.tolist() == pytest.approx([0.5 / 0.8 * 1.0, 0.2 / 0.8, 0.1 / 0.8])  # 1.6 * 0.8 > 1: scaled to sum 1
    pp1 = np.array([1.0, 0.3, 0.1])
    pp2 = cal.path_prob(pp1, [1, 2, 2], [0.05, 0.05, 0.02], [2, 2, 2])
    # node 1's child: 3 * 0.05 <= 0.3 stays; node 2's: 0.15 + 0.06 > 0.1, scaled to sum to 0.1
    assert pp2.tolist() == pytest.approx([0.15, 0.15 * 0.1 / 0.21, 0.06 * 0.1 / 0.21])
    DraftTree([-1, 0, 0, 1, 2, 2], path_prob=np.concatenate([pp1, pp2]))  # non-increasing along paths
    assert cal.path_prob(parent_pp, [], [], []).size == 0


@given(st.lists(st.floats(0, 1), min_size=1, max_size=20), st.integers(1, 6))
def test_one_rank_class_cells_match_cell_index(q, max_depth):
    """level/level_probs' one-rank-class cell index (depth offset + q bin) is _cell's, at every depth."""
    cal = AcceptanceCalibrator(max_depth=max_depth)
    q = np.asarray(q)
    for d in range(1, max_depth + 1):
        fast = cal._depth_offset[d] + np.searchsorted(cal.edges, q, side="left")
        assert fast.tolist() == cal._cell(q, np.full(q.size, d), None).tolist()


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_level_probs_equals_level_and_path_prob(data):
    """The engine's one-call path (level_probs, q already in [0, 1], one depth as an int or per node)
    against level + path_prob, with learned factors and caps that bind."""
    cal = AcceptanceCalibrator(max_depth=4, rank_classes=data.draw(st.sampled_from([1, 2])))
    m = data.draw(st.integers(0, 60))
    cal.update(data.draw(st.lists(st.floats(0, 1), min_size=m, max_size=m)),
               data.draw(st.lists(st.integers(1, 6), min_size=m, max_size=m)),
               data.draw(st.lists(st.booleans(), min_size=m, max_size=m)))
    k = data.draw(st.integers(0, 6))
    cal.observe_paths(data.draw(st.lists(st.floats(0, 1), min_size=k, max_size=k)),
                      data.draw(st.lists(st.integers(1, 6), min_size=k, max_size=k)), data.draw(st.integers(0, 6)))
    n = data.draw(st.integers(1, 6))
    parent_cal = np.asarray(data.draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)))
    parent_pp = np.asarray(data.draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)))
    m = data.draw(st.integers(1, 20))
    par = np.asarray(data.draw(st.lists(st.integers(0, n - 1), min_size=m, max_size=m)), dtype=np.int64)
    q = np.asarray(data.draw(st.lists(st.floats(0, 1), min_size=m, max_size=m)))
    one = data.draw(st.booleans())
    depth = data.draw(st.integers(1, 6)) if one else np.asarray(data.draw(st.lists(st.integers(1, 6), min_size=m, max_size=m)))
    per_node = np.full(m, depth) if one else depth
    p_hat, pp, rank = cal.level_probs(parent_cal, parent_pp, par, q, depth)
    ref_hat, ref_rank = cal.level(parent_cal, par, q, per_node)
    # the compiled kernel does the numpy methods' operations in their order: the same floats, bit for bit
    np.testing.assert_array_equal(p_hat, ref_hat)
    np.testing.assert_array_equal(pp, cal.path_prob(parent_pp, par, ref_hat, per_node))
    if rank is not None:
        assert rank.tolist() == ref_rank.tolist()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_mass_bound_holds_every_tree_the_calibrator_builds(data):
    """The AR gate's per-depth mass bound (mass_bound) against trees grown with level_probs, any q,
    learned cells and path factors above and below 1."""
    cal = AcceptanceCalibrator(max_depth=3)
    m = data.draw(st.integers(0, 80))
    cal.update(data.draw(st.lists(st.floats(0, 1), min_size=m, max_size=m)),
               data.draw(st.lists(st.integers(1, 4), min_size=m, max_size=m)),
               data.draw(st.lists(st.booleans(), min_size=m, max_size=m)))
    cal.path_factor[1:] = data.draw(st.lists(st.floats(0.2, 3.0), min_size=3, max_size=3))
    widths = [3, 9, 9, 9]
    bound = cal.mass_bound(widths)
    p_cal, pp, frontier = np.array([1.0]), np.array([1.0]), [0]
    for j, w in enumerate(widths, start=1):
        par = np.repeat(np.asarray(frontier, dtype=np.int64), 3)[:w]
        q = np.asarray(data.draw(st.lists(st.floats(0, 1), min_size=par.size, max_size=par.size)))
        p_hat, new, _ = cal.level_probs(p_cal, pp, par, q, j)
        assert new.sum() <= bound[j - 1] + 1e-9
        frontier = list(range(pp.size, pp.size + 3))  # expand three nodes of this level
        p_cal, pp = np.concatenate([p_cal, p_hat]), np.concatenate([pp, new])
    assert all(x >= y for x, y in zip(bound, bound[1:]))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_mass_bound_is_recomputed_whenever_the_tables_change(data):
    """mass_bound keeps its last answer for the AR gate; after any update, observed path, refresh, path-factor
    or bin-edge change it equals a fresh computation."""
    cal = AcceptanceCalibrator(max_depth=3, rank_classes=2)
    widths = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=4))  # small: the bounds stay below 1
    for _ in range(data.draw(st.integers(1, 8))):
        step = data.draw(st.sampled_from(["update", "paths", "factor", "cells", "edges", "none"]))
        if step == "update":
            m = data.draw(st.integers(1, 20))
            cal.update(data.draw(st.lists(st.floats(0, 1), min_size=m, max_size=m)),
                       data.draw(st.lists(st.integers(1, 4), min_size=m, max_size=m)),
                       data.draw(st.lists(st.booleans(), min_size=m, max_size=m)),
                       data.draw(st.lists(st.integers(0, 1), min_size=m, max_size=m)))
        elif step == "paths":
            cal.observe_paths([0.5, 0.25], [1, 2], data.draw(st.integers(0, 2)))
        elif step == "factor":  # in place
            cal.path_factor[1] = data.draw(st.floats(0.1, 0.9))
        elif step == "edges":  # the bins' edges, in place
            cal.edges *= data.draw(st.floats(0.3, 0.99))
        elif step == "cells":  # the tables changed directly, then refresh (its contract)
            cal.trials += 5.0  # five more rejections in every cell
            cal.refresh()
        fresh = copy.deepcopy(cal)
        fresh.__dict__.pop("_mass_memo", None)
        assert cal.mass_bound(widths) == fresh.mass_bound(widths)
        assert cal.mass_bound(widths) == fresh.mass_bound(widths)  # the kept answer


def test_path_correction_refuses_bad_input_by_field():
    cal = AcceptanceCalibrator(max_depth=3)
    bad = [
        (lambda: cal.path_prob([1.0], [1], [0.5], [1]), "parents"),  # no node 1
        (lambda: cal.path_prob([1.0], [-1], [0.5], [1]), "parents"),
        (lambda: cal.path_prob([1.0], [0, 0], [0.5], [1, 1]), "cal"),  # lengths differ
        (lambda: cal.path_prob([1.0], [0], [-0.5], [1]), "cal"),
        (lambda: cal.path_prob([1.0], [0], [0.5], [0]), "depth"),  # the root's depth
        (lambda: cal.path_prob([float("nan")], [0], [0.5], [1]), "parent_pp"),
        (lambda: cal.observe_paths([float("nan")], [1], 1), "cal"),
        (lambda: cal.observe_paths([0.5], [1, 2], 1), "depth"),
        (lambda: cal.observe_paths([0.5], [-1], 1), "depth"),
        (lambda: cal.observe_paths([0.5], [1], -1), "accepted"),
        (lambda: cal.mass_bound([-1, 4]), r"widths\[0\]"),
    ]
    for call, field in bad:
        with pytest.raises(SpecFitInputError, match=field):
            call()
    assert cal.path_factor.tolist() == [1.0] * 4  # nothing was recorded


def test_update_counts_each_trial_once_and_broadcasts_one_outcome():
    """Repeated cells count every trial (the tables are sums over trials); one outcome applies to all."""
    one, each = AcceptanceCalibrator(max_depth=3), AcceptanceCalibrator(max_depth=3)
    q, depth = [0.5, 0.5, 0.9, 0.1], [1, 1, 2, 1]
    one.update(q, depth, True)
    each.update(q, depth, [True] * 4)
    assert np.array_equal(one.trials, each.trials) and np.array_equal(one.accepted, each.accepted)
    assert one.trials.sum() == 4 and one.trials.max() == 2  # the two equal trials share a cell
    each.update(q, depth, [False, True, False, False])
    assert each.trials.sum() == 8 and each.accepted.sum() == 5


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_learn_verify_equals_update_then_observe_paths(data):
    """The engine's one-call learning of a verify (learn_verify, compiled) leaves every table, bit for bit,
    as update then _observe_paths do, over several verifies: q outside [0, 1] or NaN, depths past
    max_depth, either rank-class count, no trial or no verified node."""
    import copy

    k = data.draw(st.sampled_from([1, 2]))
    fast = AcceptanceCalibrator(max_depth=data.draw(st.integers(1, 5)), rank_classes=k,
                                prior_strength=data.draw(st.floats(0.5, 8)))
    ref = copy.deepcopy(fast)
    for _ in range(data.draw(st.integers(1, 4))):
        m = data.draw(st.integers(0, 30))
        q = np.asarray(data.draw(st.lists(st.one_of(st.floats(-0.5, 1.5), st.just(float("nan"))), min_size=m, max_size=m)))
        depth = np.asarray(data.draw(st.lists(st.integers(1, 8), min_size=m, max_size=m)), dtype=np.int64)
        ok = np.asarray(data.draw(st.lists(st.booleans(), min_size=m, max_size=m)), dtype=bool)
        rank = np.asarray(data.draw(st.lists(st.integers(0, 1), min_size=m, max_size=m)), dtype=np.int64)
        p = data.draw(st.integers(0, 8))
        cal = np.asarray(data.draw(st.lists(st.floats(0, 1), min_size=p, max_size=p)))
        cal_depth = np.asarray(data.draw(st.lists(st.integers(1, 8), min_size=p, max_size=p)), dtype=np.int64)
        accepted = data.draw(st.integers(0, 9))
        fast.learn_verify(q, depth, ok, rank, cal, cal_depth, accepted)
        ref.update(q, depth, ok, rank)
        ref._observe_paths(cal, cal_depth, accepted)
        for name in ("trials", "accepted", "_alpha", "_beta", "path_predicted", "path_accepted", "path_factor"):
            np.testing.assert_array_equal(getattr(fast, name), getattr(ref, name), err_msg=name)
