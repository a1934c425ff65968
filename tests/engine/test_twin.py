"""The AR twin replays the engine's expert cache under plain AR decoding, miss for miss."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from specfit.core.errors import SpecFitInputError
from specfit.engine.twin import ARTwinCache
from specfit.models.experts import DeviceExpertCache, HostExpertStore


def _cache(L, E, slots, policy):
    store = HostExpertStore(L, E, 2, 2, torch.float32)
    return DeviceExpertCache(store, "cpu", slots=slots, policy=policy)


def _forward(cache, experts):
    """One AR forward through the runtime's cache: its misses per layer."""
    before = [s["misses"] for s in cache.stats()["layers"]]
    for layer, ids in enumerate(experts):
        cache.run(layer, sorted(int(e) for e in ids), lambda e, gu, dn: None)
    return np.array([s["misses"] for s in cache.stats()["layers"]]) - np.array(before)


@settings(max_examples=40, deadline=None)
@given(st.data(), st.integers(2, 3), st.integers(8, 16), st.integers(2, 4),
       st.sampled_from(["lru", "lfu", "lookahead", "lookahead-lfu"]))
def test_twin_equals_the_runtime_cache(data, L, E, k, policy):
    """Miss for miss and slot for slot, with a lookahead policy's demand changed (often tied) between forwards."""
    slots = data.draw(st.integers(k, E))
    steps = data.draw(st.integers(1, 30))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    skew = rng.dirichlet(np.ones(E) * 0.5)  # a few hot experts, as a router has
    cache, twin = _cache(L, E, slots, policy), ARTwinCache(L, E, slots, policy)
    warm = data.draw(st.integers(0, steps))  # the engine syncs after a prefill: part of the history before
    for t in range(steps):
        experts = np.stack([rng.choice(E, size=k, replace=False, p=skew) for _ in range(L)])
        if t == warm:
            twin.sync(*cache.recency())
        if policy.startswith("lookahead") and rng.random() < 0.7:
            demand = None if rng.random() < 0.2 else rng.integers(0, 3, size=(L, E)) * 0.5
            cache.set_lookahead(demand)
            twin.set_lookahead(demand)
        real = _forward(cache, experts)
        mine = twin.step(experts)
        if t >= warm:
            assert mine.tolist() == real.tolist()
            assert (twin.resident == cache.recency()[0]).all()


def test_twin_all_resident_and_nothing_kept():
    experts = np.array([[0, 1], [2, 3]])
    all_ = ARTwinCache(2, 4, 4)
    assert all_.step(experts).tolist() == [0, 0]
    none = ARTwinCache(2, 4, 0)
    assert none.step(experts).tolist() == [2, 2] and none.step(experts).tolist() == [2, 2]
    with pytest.raises(SpecFitInputError, match="slots"):
        ARTwinCache(2, 4, 5)
    with pytest.raises(SpecFitInputError, match="policy"):
        ARTwinCache(2, 4, 2, "fifo")
    with pytest.raises(SpecFitInputError, match="demand"):
        ARTwinCache(2, 4, 2, "lookahead").set_lookahead(np.zeros((2, 3)))


def test_sync_without_recency_evicts_in_id_order():
    """Synced from a resident mask alone, every resident expert is equally recent and unused: the first
    eviction takes the lowest id not in the forward."""
    twin = ARTwinCache(1, 6, 3)
    twin.sync(np.array([[False, True, True, True, False, False]]))
    assert twin.step([[2, 4]]).tolist() == [1]  # 4 misses; 1 (lowest id, not used now) is evicted
    assert np.flatnonzero(twin.resident[0]).tolist() == [2, 3, 4]
    assert twin.step([[1, 3]]).tolist() == [1]  # 1 misses; 2 and 4 used alike: 2, admitted first, goes
    assert np.flatnonzero(twin.resident[0]).tolist() == [1, 3, 4]
