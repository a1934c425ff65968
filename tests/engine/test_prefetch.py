"""Prefetch while the head drafts (``SpecDecoder(prefetch=True)``, ``--prefetch``): the engine copies the root's
predicted experts before a drafted cycle's first head forward. Outputs equal plain AR's; the copies are priced by
the overlap model of :mod:`specfit.core.prefetch` (free within the head forwards before the verify, the excess
charged, shared with the shadow window); the cache never evicts the root's predicted experts for it."""

import numpy as np
import pytest
import torch

from specfit.core.cost import CostModel, get_profile
from specfit.core.errors import SpecFitInputError
from specfit.core.prefetch import overlap_ms, prefetch_budget
from specfit.engine.decoder import CycleRecord
from specfit.eval.modeled import modeled_cycle_ms
from specfit.models.experts import DeviceExpertCache, HostExpertStore

#: A 2-layer cost: 2 ms per copied expert, 0.5 ms per draft level, no reads (numbers that are easy to follow).
COST = CostModel(5.0, 0.1, 2.0, name="toy", draft_level_ms=0.5)


# -- the overlap model --------------------------------------------------------------------------------
def test_budget_issues_the_copies_that_start_inside_the_window():
    assert prefetch_budget(COST, [0, 0, 1, 1], 2, 0.0) == 0  # no window, no prefetch
    assert prefetch_budget(COST, [0, 0, 1, 1], 2, 1.0) == 1  # the first starts at 0 and overruns
    assert prefetch_budget(COST, [0, 0, 1, 1], 2, 4.0) == 2  # the third would start at 4: not inside
    assert prefetch_budget(COST, [0, 0, 1, 1], 2, 4.5) == 3
    assert prefetch_budget(COST, [0, 1], 2, 100.0) == 2
    with pytest.raises(SpecFitInputError, match="window_ms"):
        prefetch_budget(COST, [0], 2, -1.0)
    with pytest.raises(SpecFitInputError, match="layers"):
        prefetch_budget(COST, [2], 2, 1.0)


def test_copies_inside_the_serial_window_are_free_and_the_excess_is_charged():
    # 4 levels before the verify: a 2 ms window; one prefetched expert (2 ms) fits, two (4 ms) exceed it by 2 ms
    assert overlap_ms(COST, [1, 0], [3, 0], 4, 0) == (0.0, 2.0)
    assert overlap_ms(COST, [1, 1], [3, 0], 4, 0) == (2.0, 2.0)
    assert overlap_ms(COST, [1, 0], [3, 0], 1, 0) == (1.5, 0.5)  # a 0.5 ms window: 1.5 ms charged
    assert overlap_ms(COST, [], [3, 0], 4, 0) == (0.0, 2.0)  # nothing prefetched: the head forwards alone


def test_the_shadow_window_is_shared_with_the_steps_own_copies():
    # an AR step with 6 head forwards (3 ms) beside its copies: without prefetch it hides 2 ms of copies (1 expert)
    assert overlap_ms(COST, [], [1, 0], 0, 6) == (0.0, 1.0)
    # one prefetched expert: no serial window, so its 2 ms are charged and the head's 3 ms hide both copies
    assert overlap_ms(COST, [1, 0], [0, 0], 0, 6) == (2.0, 1.0)
    # the step's copy and the prefetch together exceed the head forwards: they are on the critical path
    assert overlap_ms(COST, [1, 0], [1, 0], 0, 6) == (2.0, 0.0)


def _record(**kw):
    base = dict(levels=4, nodes_verified=3, transferred=[3, 0], true_experts=[3, 2], committed=2)
    return CycleRecord(**{**base, **kw})


def test_modeled_cycle_charges_only_the_prefetch_beyond_the_window():
    cost = CostModel(5.0, 0.1, 2.0, name="toy", draft_level_ms=0.5)
    plain = modeled_cycle_ms(_record(), cost)
    fits = modeled_cycle_ms(_record(prefetch={"experts": [1, 0], "used": [1, 0]}), cost)
    over = modeled_cycle_ms(_record(prefetch={"experts": [1, 1], "used": [1, 0]}), cost)
    assert fits == plain  # 2 ms of copies inside the 2 ms of head forwards: free
    assert over["total_ms"] == pytest.approx(plain["total_ms"] + 2.0)  # the second copy is beyond the window
    assert over["transfer_ms"] == pytest.approx(plain["transfer_ms"] + 2.0) and over["draft_ms"] == plain["draft_ms"]
    # the same prefetched expert as a verify miss instead: the prefetch saved its copy (2 ms) inside the window
    missed = modeled_cycle_ms(_record(transferred=[4, 0]), cost)
    assert missed["total_ms"] - fits["total_ms"] == pytest.approx(2.0)


def test_a_record_without_prefetch_keeps_its_json_shape():
    assert "prefetch" not in CycleRecord().to_json()
    assert CycleRecord(prefetch={"experts": [1], "used": [0]}).to_json()["prefetch"] == {"experts": [1], "used": [0]}


def test_the_summary_counts_prefetched_copies_as_transfers():
    from specfit.eval.records import ResultRecord
    from specfit.eval.report import summarise

    def rec(method, prefetched, used):
        return ResultRecord(id="p", dataset="d", method=method, task="none", prompt_tokens=3, output_ids=[1, 2, 3, 4],
                            text="", new_tokens=4, committed=4, cycles=4, accept_lengths=[0] * 4, nodes_verified=[1] * 4,
                            levels=[0] * 4, wall_s=1.0, prefill_s=0.0, modeled_ms=100.0,
                            modeled={"compute_ms": 50.0, "transfer_ms": 50.0, "draft_ms": 0.0, "host_ms": 0.0},
                            experts_transferred=8, experts_looked_up=16, measured_ms={"solve": 0.0, "predict": 0.0, "tree": 0.0},
                            score={}, experts_prefetched=prefetched, experts_prefetch_used=used)

    rows = {r.method: r for r in summarise([rec("ar", 0, 0), rec("eagle3", 4, 3)], depth=3, temperature=0.0)}
    assert rows["ar"].experts_per_token == 2.0 and rows["ar"].prefetched_per_token is None
    assert rows["eagle3"].experts_per_token == 3.0 and rows["eagle3"].prefetched_per_token == 1.0
    assert rows["eagle3"].prefetch_used_share == 0.75 and rows["eagle3"].cache_hit_rate == 0.5  # the verify's misses


# -- the expert cache ---------------------------------------------------------------------------------
def _cache(slots=3, policy="lru"):
    store = HostExpertStore(1, 6, 4, 2, torch.float32)
    for e in range(6):
        store.set_expert(0, e, torch.full((2, 4), float(e)), torch.full((2, 4), float(e)), torch.full((4, 2), float(e)))
    return DeviceExpertCache(store, "cpu", slots=slots, policy=policy)


def _use(cache, experts):
    cache.run(0, experts, lambda e, gu, dn: None)


def test_prefetch_never_evicts_a_protected_expert():
    cache = _cache()
    _use(cache, [0])
    _use(cache, [1])
    _use(cache, [2])  # LRU order 0, 1, 2
    assert cache.prefetch(0, [3], protect=[0]) == [3]
    assert cache.cached_experts() == [[0, 2, 3]]  # the LRU victim 0 was protected: 1 went
    # every other slot protected or wanted: nothing can be loaded
    assert cache.prefetch(0, [4, 5], protect=[0, 2, 3]) == []
    assert cache.cached_experts() == [[0, 2, 3]]
    assert cache.prefetch(0, [4, 5], protect=[0, 2]) == [4]  # one evictable slot: one load, in priority order
    assert cache.cached_experts() == [[0, 2, 4]]
    assert cache.stats()["total"]["prefetched"] == 2
    with pytest.raises(SpecFitInputError, match="protect"):
        cache.prefetch_layers([[1]], protect=[])
    with pytest.raises(SpecFitInputError, match="expert_ids"):
        cache.prefetch(0, [1], protect=[9])


def test_a_prefetched_expert_the_forward_uses_is_a_hit():
    cache = _cache()
    cache.prefetch_layers([[4]], protect=[[4, 5]])
    _use(cache, [4])
    total = cache.stats()["total"]
    assert (total["hits"], total["misses"], total["prefetched"]) == (1, 0, 1)


# -- the engine ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lite(one_torch_thread):
    from specfit import SpecFit
    from specfit.models.proxy import head_dir, paths

    return SpecFit.from_pretrained(paths()["target"], head_dir("lite"), cache_slots=16, eviction="lookahead",
                                   dtype="float32")


PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def test_outputs_equal_ar_with_prefetch_and_the_drafted_cycles_prefetch(lite):
    ar = lite.generate(PROMPT, method="ar", max_new_tokens=10).output_ids
    cost = get_profile("qwen3-30b-a3b-pcie4").for_layers(len(lite.target.spec.moe_layers))
    for method in ("ar+lookahead", "eagle3", "eagle3-scan", "specfit"):
        out = lite.generate(PROMPT, method=method, max_new_tokens=10, prefetch=True)
        assert out.output_ids == ar, method
        pre = [c for c in out.cycles if c.prefetch]
        drafted = [c for c in out.cycles if c.levels + c.levels_ahead + c.shadow_levels > 0]
        assert len(pre) <= len(drafted), method  # only a cycle with head forwards has an idle window
        for c in pre:
            assert len(c.prefetch["experts"]) == len(c.transferred)
            assert all(0 <= u <= e for u, e in zip(c.prefetch["used"], c.prefetch["experts"]))
            window = (c.levels + c.levels_ahead) * cost.draft_level_ms
            excess, _ = overlap_ms(cost, c.prefetch["experts"], c.transferred, c.levels + c.levels_ahead, c.shadow_levels)
            copies = float(cost.per_expert_array(len(c.transferred)) @ c.prefetch["experts"])
            assert excess == pytest.approx(max(0.0, copies - window))
        if method in ("eagle3", "eagle3-scan"):  # every cycle drafts six levels: each one prefetches
            assert pre and sum(sum(c.prefetch["experts"]) for c in pre) > 0, method
        if method == "ar+lookahead":  # its head forwards hide its own copies: no idle window
            assert not pre
    # off by default: no prefetch, no record field
    out = lite.generate(PROMPT, method="eagle3-scan", max_new_tokens=10)
    assert not any(c.prefetch for c in out.cycles) and out.output_ids == ar
    with pytest.raises(SpecFitInputError, match="prefetch"):
        lite.decoder("eagle3", prefetch="yes")


def test_prefetch_changes_no_decision_of_a_cost_blind_method(lite):
    """eagle3 verifies the same fixed-size subtrees with and without prefetch (timing only): its records differ in
    the verify's copies, never in the nodes verified or the tokens committed; a used prefetch is a hit."""
    off = lite.generate(PROMPT, method="eagle3", max_new_tokens=10).cycles
    on = lite.generate(PROMPT, method="eagle3", max_new_tokens=10, prefetch=True).cycles
    assert [(c.nodes_verified, c.committed) for c in off] == [(c.nodes_verified, c.committed) for c in on]
    first_off, first_on = off[0], on[0]  # the same cache before the first cycle: its used prefetches are not misses
    used = sum(first_on.prefetch["used"])
    assert sum(first_on.transferred) == sum(first_off.transferred) - used
