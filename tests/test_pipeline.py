"""specfit.pipeline on the shipped proxy: SpecFit.from_pretrained / generate, every method equal to AR,
the expert cache each method starts with, the GPU memory budget, EOS, bad input; the target's
reset_cache and embed_weight."""

import json
from dataclasses import replace

import pytest
import torch

from specfit.core.cost import get_profile
from specfit.core.errors import SpecFitInputError
from specfit.engine import METHODS, TreeSettings
from specfit.models.proxy import paths
from specfit.pipeline import SpecFit, kv_tokens_needed, max_tree_nodes

PROMPT = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"
TREE = TreeSettings(8, 3, 2)


@pytest.fixture(scope="module")
def sf(device):
    torch.set_num_threads(1)
    d = paths()
    return SpecFit.from_pretrained(d["target"], d["eagle3"], cache_slots=16, max_len=256, device=device)


@pytest.mark.slow
def test_every_method_equals_ar_and_reports_cycles(sf):
    ar = sf.generate(PROMPT, method="ar", max_new_tokens=8)
    assert ar.method == "ar" and len(ar.output_ids) == 8 and len(ar.cycles) == 8 and ar.tau == 1.0
    assert ar.text == sf.tokenizer.decode(ar.output_ids, skip_special_tokens=True) and ar.text
    assert ar.prompt_ids == sf.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    for name in METHODS:
        out = sf.generate(ar.prompt_ids, method=name, max_new_tokens=8, tree=TREE)
        assert out.output_ids == ar.output_ids, name
        assert sum(c.committed for c in out.cycles) >= 8 and out.stats["total"]["misses"] > 0
        assert json.loads(json.dumps(out.to_json()))["cycles"][0]["committed"] == out.cycles[0].committed
        # every generation starts from an empty cache with the method's slots
        assert sf.target.cache.slots == (0 if name == "eagle3-vanilla" else 16), name


def test_sampling_is_seeded(sf):
    a, b = (sf.generate(PROMPT, method="specfit", max_new_tokens=6, temperature=1.0, seed=3, tree=TREE)
            for _ in range(2))
    assert a.output_ids == b.output_ids


def test_generation_stops_at_the_config_eos(sf):
    ids = sf.generate(PROMPT, method="ar", max_new_tokens=6).output_ids
    old = sf.target.spec
    sf.target.spec = replace(old, eos_token_id=(ids[2],))
    try:
        assert sf.eos_token_id == ids[2]
        for method in ("ar", "specfit"):
            assert sf.generate(PROMPT, method=method, max_new_tokens=6, tree=TREE).output_ids == ids[:3]
    finally:
        sf.target.spec = old


def test_selection_cost_is_the_profile_scaled_to_the_target(sf):
    assert sf.cost == get_profile("qwen3-30b-a3b-pcie4").for_layers(len(sf.target.spec.moe_layers))
    assert sf.predictor is not None and sf.drafter is not None


def test_gpu_memory_budget_becomes_slots_per_layer(sf):
    d = paths()
    mem = sf.target.memory()
    head_bytes = sum(t.nbytes for t in sf.drafter.head.state_dict().values())
    per_slot = len(sf.target.spec.moe_layers) * sf.target.store.expert_bytes
    budget = mem["dense_bytes"] + mem["kv_bytes"] + head_bytes + 5 * per_slot + per_slot // 2
    small = SpecFit.from_pretrained(d["target"], d["eagle3"], gpu_memory_bytes=budget, max_len=256,
                                    device=str(sf.target.device))
    assert small.cache_slots == 5 and small.target.cache.slots == 5
    assert small.target.memory()["device_bytes"] + head_bytes <= budget
    assert sf.target.slots_for(budget, reserved_bytes=head_bytes) == 5
    with pytest.raises(SpecFitInputError, match="gpu_memory_bytes"):
        SpecFit.from_pretrained(d["target"], gpu_memory_bytes="1GiB", cache_slots=4)
    with pytest.raises(SpecFitInputError, match="gpu_memory"):
        SpecFit.from_pretrained(d["target"], gpu_memory_bytes=1000)


def test_kv_capacity():
    assert max_tree_nodes(TreeSettings(32, 6, 4)) == 4 + 5 * 16
    assert kv_tokens_needed(10, 5, None) == 17 and kv_tokens_needed(10, 5, TREE) == 17 + 2 + 2 * 4


@pytest.mark.parametrize("kwargs,field", [
    (dict(method="nope"), "method"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=250), "max_new_tokens"),  # past max_len=256 with the prompt and a tree
    (dict(prompt=[]), "prompt"),
    (dict(prompt=["a"]), "prompt"),
])
def test_generate_rejects_bad_input(sf, kwargs, field):
    kwargs = {"prompt": PROMPT, **kwargs}
    with pytest.raises(SpecFitInputError, match=field):
        sf.generate(kwargs.pop("prompt"), **kwargs)


def test_text_needs_a_tokenizer_and_draft_methods_need_a_head(sf):
    bare = SpecFit(sf.target, tokenizer=None, cost=sf.cost, cache_slots=2)
    with pytest.raises(SpecFitInputError, match="prompt: the model directory has no tokenizer"):
        bare.generate(PROMPT, method="ar", max_new_tokens=2)
    assert bare.generate([5, 6, 7], method="ar", max_new_tokens=2).text is None
    with pytest.raises(SpecFitInputError, match="drafter"):
        bare.generate([5, 6, 7], method="specfit", max_new_tokens=2)


@pytest.mark.parametrize("kwargs,field", [
    (dict(dtype="int8"), "dtype"),
    (dict(profile="nope"), "profile"),
    (dict(eviction="fifo"), "eviction"),
    (dict(cache_slots=999), "cache_slots"),
    (dict(predictor="nope"), "predictor"),
    (dict(predictor_trace="MISSING"), "predictor_trace"),
    (dict(draft_dir="MISSING"), "draft_dir"),
])
def test_from_pretrained_rejects_bad_input(kwargs, field, tmp_path):
    d = paths()
    kwargs = {"draft_dir": d["eagle3"], **kwargs}
    for k, v in kwargs.items():
        if v == "MISSING":
            kwargs[k] = tmp_path / "missing"
    with pytest.raises(SpecFitInputError, match=field):
        SpecFit.from_pretrained(d["target"], max_len=64, **kwargs)


def test_reset_cache_and_embed_weight(sf):
    target = sf.target
    assert target.embed_weight is target.w["model.embed_tokens.weight"]
    target.reset_cache(3, "lfu")
    assert target.cache.slots == 3 and target.cache.policy.name == "lfu"
    target.prefill([5, 6, 7])
    assert target.cache.stats()["total"]["misses"] > 0
    old = target.cache
    with pytest.raises(SpecFitInputError, match="cache_slots"):
        target.reset_cache(10_000)
    assert target.cache is old  # a bad request leaves the working cache in place
    target.reset_cache("all")
    assert target.cache.slots == target.spec.num_experts and target.cache.stats()["total"]["misses"] == 0
    target.reset_cache(0)
    assert target.cache.slots == 0 and target.cache.policy.name == "lfu"  # the policy is kept


def test_prompt_ids_as_one_sequence_of_any_form_and_batches_refused(sf):
    import numpy as np

    ids = [5, 9, 13, 7]
    want = sf.generate(ids, method="ar", max_new_tokens=3).output_ids
    for form in (torch.tensor(ids), torch.tensor([ids]), np.asarray([ids]), [ids]):
        assert sf.generate(form, method="ar", max_new_tokens=3).output_ids == want
    for batch in (torch.tensor([ids, ids]), np.asarray([ids, ids]), [ids, ids]):
        with pytest.raises(SpecFitInputError, match="batch size 1 only") as info:
            sf.generate(batch, method="ar", max_new_tokens=3)
        assert info.value.field == "prompt"


def test_the_draft_policy_is_one_argument(sf):
    s = SpecFit(sf.target, sf.drafter, tokenizer=sf.tokenizer, predictor=sf.predictor, cost=sf.cost, cache_slots=16)
    ar = s.generate(PROMPT, method="ar", max_new_tokens=6).output_ids
    never = s.generate(PROMPT, method="specfit", max_new_tokens=6, tree=TREE, policy="never")
    assert never.output_ids == ar and {c.decision for c in never.cycles} == {"ar"}
    assert all(c.levels == 0 for c in never.cycles)
    with pytest.raises(SpecFitInputError, match="policy: .*'never' policy"):  # its setting's online model says never
        s.decoder("specfit", tree=TREE, policy="always")
    s.online.clear()
    always = s.generate(PROMPT, method="specfit", max_new_tokens=6, tree=TREE, policy="always")
    assert always.output_ids == ar and {c.decision for c in always.cycles} == {"draft"}
    assert s.decoder("specfit", tree=TREE).policy.name == "always"  # the setting keeps its policy
    assert s.decoder("specfit", tree=TreeSettings(8, 2, 2)).policy.name == "gate"  # a new setting: the default
    assert s.decoder("eagle3", tree=TREE, policy="never").policy.name == "never"
    assert s.decoder("eagle3", tree=TREE).policy.name == "always"
    for method, policy in (("eagle3", "gate"), ("specfit", "sometimes")):
        with pytest.raises(SpecFitInputError, match="policy"):
            s.decoder(method, tree=TREE, policy=policy)


def test_repeated_generations_reuse_the_loaded_expert_cache(sf):
    """A second generation with the same cache settings clears the target's cache in place (no new slots, no
    second copy of the experts) and gives what a new cache gives: the same tokens, counters and eviction order."""
    first = sf.generate(PROMPT, method="ar", max_new_tokens=5)
    cache = sf.target.cache
    again = sf.generate(PROMPT, method="ar", max_new_tokens=5)
    assert sf.target.cache is cache
    def counts(out):  # the counters, times left out
        return [{k: v for k, v in layer.items() if not k.endswith("_ms")} for layer in out.stats["layers"]]

    assert again.output_ids == first.output_ids and counts(again) == counts(first)
    sf.target.reset_cache(3)                          # other settings: a new cache, as before
    assert sf.target.cache is not cache and sf.target.cache.slots == 3
