"""The expert-cache lookahead simulation (eval/lookahead.py): the real cache's semantics, Belady optimal."""

from __future__ import annotations

from functools import lru_cache
from itertools import combinations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit.core.errors import SpecFitInputError
from specfit.core.lookahead import expert_demand
from specfit.eval.lookahead import (DEFAULT_TRACE, CacheSim, belady_misses, demand_series, main, next_use,
                                    predicted_experts, simulate)
from specfit.models.experts import DeviceExpertCache, HostExpertStore
from specfit.models.traces import RoutingTrace


def routings(max_layers=2, max_experts=6, max_tokens=10):
    """(routing (T, L, k), E): k distinct experts per token and layer."""
    @st.composite
    def draw(d):
        L, E = d(st.integers(1, max_layers)), d(st.integers(2, max_experts))
        k, T = d(st.integers(1, min(3, E - 1))), d(st.integers(1, max_tokens))
        rng = np.random.default_rng(d(st.integers(0, 2**32 - 1)))
        return np.array([[rng.permutation(E)[:k] for _ in range(L)] for _ in range(T)], dtype=np.int64), E
    return draw()


def real_cache_misses(routing, E, slots, policy, demand=None):
    """Misses per layer of DeviceExpertCache fed one forward per token (each layer's experts in id order),
    with ``demand[t]`` set before forward t; and the residents at the end."""
    T, L, _ = routing.shape
    cache = DeviceExpertCache(HostExpertStore(L, E, 1, 1, torch.float32), "cpu", slots=slots, policy=policy)
    for t in range(T):
        if demand is not None:
            cache.set_lookahead(demand[t])
        for layer in range(L):
            cache.run(layer, sorted(routing[t, layer].tolist()), lambda e, gu, dn: None)
    return np.array([s["misses"] for s in cache.stats()["layers"]]), cache.cached_experts()


def sim_residents(sim: CacheSim) -> list[list[int]]:
    return [sorted(np.flatnonzero(row).tolist()) for row in sim.resident]


@settings(max_examples=80, deadline=None)
@given(routings(), st.data(), st.sampled_from(["lru", "lfu"]), st.booleans())
def test_simulation_is_the_real_cache(case, data, base, with_demand):
    """Miss for miss and resident for resident, CacheSim is DeviceExpertCache (lru/lfu, or lookahead over
    them with a demand per forward) for one-token forwards with at least k slots."""
    routing, E = case
    T, L, k = routing.shape
    slots = data.draw(st.integers(k, E))
    demand = None
    if with_demand:
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        demand = rng.integers(0, 3, (T, L, E)).astype(np.float64)
    policy = base if demand is None else ("lookahead" if base == "lru" else "lookahead-lfu")
    want, residents = real_cache_misses(routing, E, slots, policy, demand)
    sim = CacheSim(L, E, slots, base)
    got = sim.replay(routing[: T // 2], None if demand is None else demand[: T // 2])  # in two parts: state carries
    got = got + sim.replay(routing[T // 2:], None if demand is None else demand[T // 2:])
    assert got.tolist() == want.tolist()
    assert sim_residents(sim) == residents


def test_simulation_is_the_real_cache_on_the_shipped_trace():
    """On the shipped routing trace's first prompts, 16 slots: LRU and lookahead with the true next 4 tokens'
    demand miss exactly as DeviceExpertCache does."""
    trace = RoutingTrace.load(DEFAULT_TRACE).subset([0, 1])
    routing, E = trace.routing, trace.num_experts
    demand = demand_series(routing, 4, E)
    for policy, prio in (("lru", None), ("lookahead", demand)):
        want, residents = real_cache_misses(routing, E, 16, policy, prio)
        sim = CacheSim(trace.num_layers, E, 16)
        assert sim.replay(routing, prio).tolist() == want.tolist()
        assert sim_residents(sim) == residents
    assert want.sum() > 0


def brute_force_misses(seq: list[frozenset], slots: int, start: frozenset = frozenset()) -> int:
    """Fewest misses over every eviction choice (one layer, from the resident set ``start``; a forward's
    experts are resident together, evictions only when the slots are full)."""
    @lru_cache(maxsize=None)
    def best(t: int, resident: frozenset) -> int:
        if t == len(seq):
            return 0
        need = seq[t]
        union = resident | need
        cost = len(need - resident)
        over = len(union) - slots
        if over <= 0:
            return cost + best(t + 1, union)
        return cost + min(best(t + 1, union - frozenset(out)) for out in combinations(sorted(resident - need), over))
    return best(0, start)


@settings(max_examples=150, deadline=None)
@given(routings(max_layers=2, max_experts=6, max_tokens=8), st.data())
def test_belady_is_optimal(case, data):
    """Belady (evict the farthest next use) equals brute force over every eviction sequence, per layer."""
    routing, E = case
    slots = data.draw(st.integers(routing.shape[2], E))
    got = belady_misses(routing, E, slots)
    for layer in range(routing.shape[1]):
        start = frozenset(range(E)) if slots == E else frozenset()  # as the cache starts
        assert got[layer] == brute_force_misses([frozenset(r.tolist()) for r in routing[:, layer]], slots, start)
    lru = CacheSim(routing.shape[1], E, slots).replay(routing)
    assert (got <= lru).all()


@settings(max_examples=40, deadline=None)
@given(routings(max_tokens=12), st.integers(1, 5), st.sampled_from([1.0, 0.5, 0.9]))
def test_demand_series_counts_the_next_tokens(case, horizon, decay):
    """Demand during forward t: token t+j's experts weighted decay**j, j = 1..horizon."""
    routing, E = case
    T, L, _ = routing.shape
    got = demand_series(routing, horizon, E, decay)
    for t in range(T):
        want = np.zeros((L, E))
        for j in range(t + 1, min(T, t + 1 + horizon)):
            for layer in range(L):
                want[layer, routing[j, layer]] += decay ** (j - t)
        np.testing.assert_allclose(got[t], want, rtol=1e-12)
    nu = next_use(routing, E)
    for t in range(T):  # next_use: the first later step using the expert, T when none
        for layer in range(L):
            for e in range(E):
                later = [j for j in range(t + 1, T) if e in routing[j, layer]]
                assert nu[t, layer, e] == (later[0] if later else T)


def test_predicted_experts_are_the_predictor_out_of_fold():
    """Step t's rows are the frequency predictor's experts of tokens t+1..t+h after observing tokens <= t,
    built without the prompt's fold; rows past the prompt's end are -1."""
    from specfit.models.predictors import build_frequency

    trace = RoutingTrace.load(DEFAULT_TRACE).subset(range(4))
    pred = predicted_experts(trace, 3)
    tokens, routing, _ = list(trace.prompts())[1]
    T = len(tokens)
    assert pred[1].shape == (T, 3, trace.num_layers, trace.top_k)
    assert (pred[1][T - 1] == -1).all() and (pred[1][T - 2, 1:] == -1).all() and (pred[1][: T - 3] >= 0).all()
    ref = build_frequency(trace.subset([0, 2]))
    ref.reset()
    for t in range(6):
        ref.observe(tokens[t:t + 1], routing[t:t + 1])
        np.testing.assert_array_equal(pred[1][t], ref.predict(tokens[t + 1:t + 4]))
    d = demand_series(pred[1], 2, trace.num_experts)
    np.testing.assert_array_equal(d[0], expert_demand([1.0, 1.0], pred[1][0, :2], trace.num_experts))
    assert (d[T - 1] == 0).all()


def test_table_orders_and_command(capsys):
    """Belady bounds every policy; the command prints one row per size."""
    trace = RoutingTrace.load(DEFAULT_TRACE).subset(range(4))
    res = simulate(trace, [16, 32], (1, 3), predicted_experts(trace, 3), (1.0, 0.5))
    assert list(res) == ["LRU", "LRU + true next 1", "LRU + true next 3", "LRU + true next 1, weight 0.5^j",
                         "LRU + true next 3, weight 0.5^j", "LRU + predicted next 1", "LRU + predicted next 3",
                         "LRU + predicted next 1, weight 0.5^j", "LRU + predicted next 3, weight 0.5^j", "Belady"]
    for s in (16, 32):
        assert res["Belady"][s] <= min(row[s] for row in res.values())
        assert res["LRU + true next 3"][s] < res["LRU"][s]
        # one token ahead, every weight ranks alike
        assert res["LRU + true next 1"][s] == res["LRU + true next 1, weight 0.5^j"][s]
    fresh = simulate(trace, [16], (2,), None, (1.0,), fresh=True)
    by_prompt = [simulate(trace.subset([p]), [16], (2,)) for p in range(4)]  # one prompt each: fresh caches
    n = [len(trace.subset([p])) for p in range(4)]
    for name in fresh:
        assert fresh[name][16] == pytest.approx(np.dot([r[name][16] for r in by_prompt], n) / sum(n))
    assert main(["--prompts", "3", "--slots", "16,32", "--horizons", "2"]) == 0
    out = capsys.readouterr().out
    assert "| eviction | 16 slots | 32 slots |" in out and "| LRU + predicted next 2 | " in out and "| Belady | " in out


def test_bad_input():
    with pytest.raises(SpecFitInputError, match="slots"):
        CacheSim(1, 4, 5)
    with pytest.raises(SpecFitInputError, match="base"):
        CacheSim(1, 4, 2, "mru")
    with pytest.raises(SpecFitInputError, match="routing"):
        CacheSim(1, 4, 1).replay(np.array([[[0, 1]]]))
    with pytest.raises(SpecFitInputError, match="priority"):
        CacheSim(1, 4, 2).replay(np.array([[[0, 1]]]), np.zeros((1, 1, 3)))
    with pytest.raises(SpecFitInputError, match="--prompts"):
        main(["--prompts", "1"])
    with pytest.raises(SpecFitInputError, match="--decays"):
        main(["--decays", "0"])
