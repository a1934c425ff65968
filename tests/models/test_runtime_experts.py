"""The host expert store and device expert cache on their own (no model): rounds, eviction, counters."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.models.experts import (LFU, LRU, POLICIES, DeviceExpertCache, HostExpertStore, Lookahead, parse_bytes,
                                   slots_for_budget)
from specfit.core.errors import SpecFitInputError

E, H, I, L = 6, 4, 3, 2


def make_store() -> HostExpertStore:
    """Every weight of expert e in layer l equals 100 * l + e, so a wrong slot is visible."""
    store = HostExpertStore(L, E, H, I, torch.float32)
    for layer in range(L):
        for e in range(E):
            v = float(100 * layer + e)
            store.set_expert(layer, e, torch.full((I, H), v), torch.full((I, H), v + 0.5), torch.full((H, I), -v))
    return store


def assert_mask_matches(cache: DeviceExpertCache) -> None:
    """resident_mask(), kept as experts come and go, says what cached_experts() lists (and is a copy)."""
    mask = cache.resident_mask()
    assert mask.shape == (cache.num_layers, cache.store.num_experts) and mask.dtype == bool
    assert [sorted(map(int, row.nonzero()[0])) for row in mask] == cache.cached_experts()
    mask[:] = ~mask
    assert [sorted(map(int, row.nonzero()[0])) for row in cache.resident_mask()] == cache.cached_experts()


def run_and_check(cache: DeviceExpertCache, layer: int, experts: list[int]) -> list[int]:
    seen = []

    def compute(e, gate_up, down):
        v = 100 * layer + e
        assert torch.all(gate_up[:I] == v) and torch.all(gate_up[I:] == v + 0.5) and torch.all(down == -v), \
            f"slot handed out for expert {e} holds another expert"
        seen.append(e)

    cache.run(layer, experts, compute)
    return seen


class MRU:
    """An adversarial policy: evicts the most recently used candidate (the experts of the current
    call are the most recent, so a cache that offered busy slots as candidates would hand them out)."""

    name = "mru"

    def victim(self, candidates, last_use, uses):
        return max(candidates, key=lambda e: last_use[e])


#: Every policy the cache tests run: the shipped ones, the adversarial MRU, and lookahead over MRU (whose
#: demand ties fall back to evicting the most recent candidate).
TEST_POLICIES = [LRU, LFU, MRU, Lookahead, lambda: Lookahead(LFU()), lambda: Lookahead(MRU())]

#: A lookahead demand (L, E), or None; few distinct values so that ties occur.
demands = st.one_of(st.none(), st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.5]), min_size=E, max_size=E),
                                        min_size=L, max_size=L))


@settings(max_examples=60, deadline=None)
@given(slots=st.sampled_from([0, 1, 2, 3, 5, E]), policy=st.sampled_from(TEST_POLICIES),
       calls=st.lists(st.tuples(st.integers(0, L - 1), st.sets(st.integers(0, E - 1), min_size=1)),
                      min_size=1, max_size=12), demand=demands)
def test_every_call_gets_its_own_weights(slots, policy, calls, demand):
    """Correct for any slot count, including calls that need more distinct experts than slots, under
    every policy (lookahead with and without a demand)."""
    cache = DeviceExpertCache(make_store(), "cpu", slots=slots)
    cache.policy = policy()
    cache.set_lookahead(demand)
    assert_mask_matches(cache)
    hits = misses = 0
    for layer, needed in calls:
        before = set(cache.cached_experts()[layer])
        seen = run_and_check(cache, layer, sorted(needed))
        assert_mask_matches(cache)
        assert sorted(seen) == sorted(needed), "each needed expert runs exactly once"
        hits += len(needed & before)
        misses += len(needed - before)
        assert len(cache.cached_experts()[layer]) <= slots
    total = cache.stats()["total"]
    assert (total["hits"], total["misses"]) == (hits, misses)
    assert total["bytes_moved"] == misses * cache.store.expert_bytes
    if slots == 0:
        assert hits == 0 and cache.cached_experts() == [[], []]
    if slots == E:
        assert misses == 0


@settings(max_examples=60, deadline=None)
@given(slots=st.sampled_from([0, 1, 2, 3, 5, E]), policy=st.sampled_from(TEST_POLICIES),
       calls=st.lists(st.tuples(st.integers(0, L - 1), st.sets(st.integers(0, E - 1), min_size=1)),
                      min_size=1, max_size=12), demand=demands)
def test_rounds_hand_over_their_experts_slots(slots, policy, calls, demand):
    """``run_rounds`` (the runtime's expert rounds): each round names distinct experts in increasing id,
    each in a slot of the layer's tensors that holds that expert's weights; the rounds cover the needed
    experts once each; the counters are those of ``run``."""
    cache, plain = (DeviceExpertCache(make_store(), "cpu", slots=slots) for _ in range(2))
    cache.policy, plain.policy = policy(), policy()
    cache.set_lookahead(demand)
    plain.set_lookahead(demand)
    for layer, needed in calls:
        seen = []

        def compute_round(ids, where, gate_up, down):
            assert ids == sorted(set(ids)) and len(where) == len(ids) == len(set(where))
            assert gate_up.shape[1:] == (2 * I, H) and down.shape[1:] == (H, I) and max(where) < gate_up.shape[0]
            for e, s in zip(ids, where):
                v = 100 * layer + e
                assert torch.all(gate_up[s, :I] == v) and torch.all(gate_up[s, I:] == v + 0.5)
                assert torch.all(down[s] == -v), f"slot {s} handed out for expert {e} holds another expert"
            seen.extend(ids)

        cache.run_rounds(layer, sorted(needed), compute_round)
        run_and_check(plain, layer, sorted(needed))
        assert sorted(seen) == sorted(needed), "each needed expert runs exactly once"
        assert cache.cached_experts() == plain.cached_experts()
    strip = [{k: v for k, v in c.stats()["total"].items() if not k.endswith("_ms")} for c in (cache, plain)]
    assert strip[0] == strip[1]


def test_host_compute_cache_has_no_rounds():
    """A host-computed expert has no device slot: the runtime must call ``run`` (``grouped`` is False)."""
    from specfit.models.host_compute import HostComputeCache

    cache = HostComputeCache(make_store(), "cpu", slots=2)
    assert cache.grouped is False and DeviceExpertCache.grouped is True
    with pytest.raises(NotImplementedError, match="run_rounds"):
        cache.run_rounds(0, [1], lambda *a: None)


def test_lru_and_lfu_victims():
    lru = DeviceExpertCache(make_store(), "cpu", slots=2, policy="lru")
    for needed in ([0], [0], [1], [2]):
        run_and_check(lru, 0, needed)
    assert lru.cached_experts()[0] == [1, 2]           # 0 was used longest ago
    lfu = DeviceExpertCache(make_store(), "cpu", slots=2, policy="lfu")
    for needed in ([0], [0], [1], [2]):
        run_and_check(lfu, 0, needed)
    assert lfu.cached_experts()[0] == [0, 2]           # 1 was used least often
    assert lfu.cached_experts()[1] == []


def test_lookahead_evicts_least_demand_then_base_policy():
    """The victim has the least demand; among equal demand, LRU's (``lookahead``) or LFU's
    (``lookahead-lfu``) victim."""
    for name, kept in [("lookahead", [0, 2, 3]), ("lookahead-lfu", [0, 1, 3])]:
        cache = DeviceExpertCache(make_store(), "cpu", slots=3, policy=name)
        assert cache.stats()["policy"] == name
        for needed in ([0], [1], [1], [2]):
            run_and_check(cache, 0, needed)
        demand = [[5.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0] * E]   # 0 is wanted next; 1 and 2 tie at 0
        cache.set_lookahead(demand)
        run_and_check(cache, 0, [3])
        assert cache.cached_experts()[0] == kept       # LRU ties: 1 (used before 2); LFU ties: 2 (used once)
    cache = DeviceExpertCache(make_store(), "cpu", slots=2, policy="lookahead")
    run_and_check(cache, 0, [0])
    run_and_check(cache, 0, [1])
    cache.set_lookahead([[0.0, 0.25, 0.0, 0.0, 0.0, 0.0], [0.0] * E])
    run_and_check(cache, 0, [2])
    assert cache.cached_experts()[0] == [1, 2]          # 0 goes (least demand, and LRU alike)
    run_and_check(cache, 0, [3])
    assert cache.cached_experts()[0] == [1, 3]          # 2 (most recent, no demand) goes before 1 (demand 0.25)
    cache.set_lookahead(None)
    run_and_check(cache, 0, [4])
    assert cache.cached_experts()[0] == [3, 4]          # cleared: plain LRU evicts 1


@settings(max_examples=40, deadline=None)
@given(slots=st.sampled_from([1, 2, 3, 5]), base=st.sampled_from(["lru", "lfu"]),
       calls=st.lists(st.tuples(st.integers(0, L - 1), st.sets(st.integers(0, E - 1), min_size=1)),
                      min_size=1, max_size=16))
def test_lookahead_without_demand_is_its_base_policy(slots, base, calls):
    """With no demand set (or a demand that ties every expert), lookahead evicts exactly as its base policy:
    the same residents after every call and the same counters."""
    name = "lookahead" if base == "lru" else "lookahead-lfu"
    plain, look, flat = (DeviceExpertCache(make_store(), "cpu", slots=slots, policy=p) for p in (base, name, name))
    flat.set_lookahead([[1.5] * E] * L)
    plain.set_lookahead([[float(e) for e in range(E)]] * L)       # ignored by lru/lfu
    for layer, needed in calls:
        for cache in (plain, look, flat):
            run_and_check(cache, layer, sorted(needed))
        assert look.cached_experts() == plain.cached_experts() == flat.cached_experts()
    strip = [{k: v for k, v in c.stats()["total"].items() if not k.endswith("_ms")} for c in (plain, look, flat)]
    assert strip[0] == strip[1] == strip[2]


def test_bad_lookahead_demand():
    cache = DeviceExpertCache(make_store(), "cpu", slots=2, policy="lookahead")
    for bad in ([[0.0] * E], [[0.0] * (E - 1)] * L, [[-1.0] * E] * L, [[float("nan")] * E] * L, "much"):
        with pytest.raises(SpecFitInputError, match="demand"):
            cache.set_lookahead(bad)
    assert sorted(POLICIES) == ["lfu", "lookahead", "lookahead-lfu", "lru"]
    with pytest.raises(SpecFitInputError, match="eviction"):
        DeviceExpertCache(make_store(), "cpu", slots=2, policy="belady")


def test_rounds_keep_hits_and_count_per_layer():
    cache = DeviceExpertCache(make_store(), "cpu", slots=2)
    run_and_check(cache, 1, [4, 5])
    cache.reset_stats()
    run_and_check(cache, 1, [0, 1, 2, 4, 5])           # 2 hits, then 3 misses in 2 rounds
    layers = cache.stats()["layers"]
    assert (layers[1]["hits"], layers[1]["misses"]) == (2, 3)
    assert layers[0] == {"hits": 0, "misses": 0, "rejected_misses": 0, "prefetched": 0, "bytes_moved": 0,
                         "transfer_ms": 0.0}
    assert layers[1]["bytes_moved"] == 3 * 3 * H * I * 4 and layers[1]["transfer_ms"] > 0


def test_prefetch_turns_misses_into_hits():
    cache = DeviceExpertCache(make_store(), "cpu", slots=3)
    assert cache.prefetch(0, [5, 1, 5, 2, 3]) == [5, 1, 2]     # deduplicated, at most 3 slots
    assert cache.cached_experts()[0] == [1, 2, 5]
    assert_mask_matches(cache)
    assert cache.prefetch(0, [1]) == []
    run_and_check(cache, 0, [1, 2, 5])
    st0 = cache.stats()["layers"][0]
    assert (st0["hits"], st0["misses"], st0["prefetched"]) == (3, 0, 3)
    assert st0["bytes_moved"] == 3 * cache.store.expert_bytes
    assert DeviceExpertCache(make_store(), "cpu", slots=0).prefetch(0, [1]) == []
    with pytest.raises(SpecFitInputError, match="expert_ids"):
        cache.prefetch(0, [E])
    with pytest.raises(SpecFitInputError, match="layer"):
        cache.prefetch(L, [0])


def test_all_resident_moves_nothing():
    cache = DeviceExpertCache(make_store(), "cpu", slots="all")
    assert cache.cached_experts() == [list(range(E))] * L
    run_and_check(cache, 0, list(range(E)))
    total = cache.stats()["total"]
    assert (total["hits"], total["misses"], total["bytes_moved"], total["hit_rate"]) == (E, 0, 0, 1.0)


@pytest.mark.parametrize("slots", [-1, E + 1, "many", 1.5, True])
def test_bad_slots(slots):
    with pytest.raises(SpecFitInputError, match="cache_slots"):
        DeviceExpertCache(make_store(), "cpu", slots=slots)


def test_parse_bytes_and_budget():
    assert parse_bytes("20GiB") == 20 * 2**30
    assert parse_bytes("1.5 kb") == 1500
    assert parse_bytes(123) == 123
    for bad in ("", "12 parsecs", "-3GB", None):
        with pytest.raises(SpecFitInputError, match="gpu_memory"):
            parse_bytes(bad)
    assert slots_for_budget(1000, 100, num_layers=3, num_experts=8, expert_bytes=100) == 3
    assert slots_for_budget(10**9, 100, num_layers=3, num_experts=8, expert_bytes=100) == 8
    with pytest.raises(SpecFitInputError, match="gpu_memory"):
        slots_for_budget(50, 100, num_layers=3, num_experts=8, expert_bytes=100)


def verify_then_settle(cache: DeviceExpertCache, layer: int, touched: list[int], accepted: list[int]) -> None:
    """A tentative (verify) forward touching ``touched``, then the accepted path's experts."""
    cache.begin_tentative()
    run_and_check(cache, layer, touched)
    cache.end_tentative()
    cache.settle([accepted if i == layer else [] for i in range(L)])


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_experts_of_rejected_nodes_are_evicted_first(policy):
    """Cache-aware verification (``admission="accepted"``): an expert transferred only for rejected draft nodes is
    the next victim, and a resident one used only by rejected nodes keeps its old rank; with
    admission='all' both count as used, as in plain LRU/LFU."""
    aware = DeviceExpertCache(make_store(), "cpu", slots=3, policy=policy, admission="accepted")
    plain = DeviceExpertCache(make_store(), "cpu", slots=3, policy=policy)           # the default, "all"
    for cache in (aware, plain):
        run_and_check(cache, 0, [0])
        run_and_check(cache, 0, [1])
        verify_then_settle(cache, 0, [0, 1, 2], accepted=[1])     # 0 and 2 served only rejected nodes
        run_and_check(cache, 0, [3])                               # one victim
    assert aware.cached_experts()[0] == [0, 1, 3]                  # 2 (copied for a rejected node) went
    assert plain.cached_experts()[0] == ([1, 2, 3] if policy == "lru" else [0, 1, 3])
    run_and_check(aware, 0, [4])
    assert aware.cached_experts()[0] == [1, 3, 4]                  # then 0: its rejected use was undone
    assert_mask_matches(aware)
    assert (aware.stats()["admission"], plain.stats()["admission"]) == ("accepted", "all")
    for cache in (aware, plain):      # 2 was the one transfer paid only for rejected nodes
        assert cache.stats()["layers"][0]["rejected_misses"] == 1


def test_settle_without_record_and_demotion_ends_on_use():
    cache = DeviceExpertCache(make_store(), "cpu", slots=2, admission="accepted")
    cache.settle([[0]] * L)                                        # nothing recorded: no effect
    verify_then_settle(cache, 0, [0, 1], accepted=[0])             # 1 demoted
    run_and_check(cache, 0, [1])                                   # used again: no longer demoted
    run_and_check(cache, 0, [0])
    run_and_check(cache, 0, [2])
    assert cache.cached_experts()[0] == [0, 2]                     # plain LRU order again
    cache.begin_tentative()
    run_and_check(cache, 0, [3])
    cache.end_tentative()
    cache.settle(None)                                             # abandoned verify: no ranking
    run_and_check(cache, 0, [4])
    assert cache.cached_experts()[0] == [3, 4]


def test_bad_admission():
    with pytest.raises(SpecFitInputError, match="admission"):
        DeviceExpertCache(make_store(), "cpu", slots=2, admission="some")


@pytest.mark.parametrize("slots", [0, 3, "all"])
def test_clear_gives_the_state_of_a_new_cache(slots):
    """After use, :meth:`DeviceExpertCache.clear` leaves what a new cache of the same settings holds: the same
    residents, counters, recency and slot tables; the same copies and evictions after it (every expert of
    "all" stays in its slot, nothing is copied again)."""
    store = make_store()
    used = DeviceExpertCache(store, "cpu", slots, "lookahead")
    slot_tensors = used.gate_up + used.down
    for layer in range(L):
        used.run(layer, [0, 4, 5], lambda e, gu, dn: None)
        used.slot_table(layer)
    used.set_lookahead([[1.0] * E for _ in range(L)])
    used.clear()
    assert all(a is b for a, b in zip(used.gate_up + used.down, slot_tensors))  # nothing allocated again
    fresh = DeviceExpertCache(store, "cpu", slots, "lookahead")
    assert used.stats() == fresh.stats() and used.cached_experts() == fresh.cached_experts()
    for c in (used, fresh):
        for layer in range(L):
            run_and_check(c, layer, [1, 4, 2, 3, 5])
            run_and_check(c, layer, [0, 2])
    assert used.cached_experts() == fresh.cached_experts()
    assert {k: v for k, v in used.stats()["total"].items() if not k.endswith("_ms")} == \
        {k: v for k, v in fresh.stats()["total"].items() if not k.endswith("_ms")}
    assert all((a == b).all() for a, b in zip(used.recency(), fresh.recency()))
    assert all(torch.equal(used.slot_table(layer), fresh.slot_table(layer)) for layer in range(L))
