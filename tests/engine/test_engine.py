"""The decoding engine: every method's greedy output equals greedy AR; records add up; KV and drafter
state after a cycle equal a fresh prefill; shapes fuzzed through the whole loop."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from specfit.models.qwen3_moe import OffloadedQwen3Moe
from specfit.core.cost import CostModel
from specfit.engine import METHODS, SpecDecoder, TreeSettings, get_method
from specfit.engine.clock import MeasuredClock
from specfit.engine.decoder import _Drafted
import specfit.engine.decoder as decoder_module
from specfit.core.errors import SpecFitInputError
from specfit.core.tree import DraftTree

VOCAB, LAYERS, EXPERTS, TOP_K = 96, 3, 16, 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_checkpoint):
    path = tmp_path_factory.mktemp("engine") / "target"
    tiny_checkpoint(path, vocab_size=VOCAB, layers=LAYERS, experts=EXPERTS, top_k=TOP_K, intermediate_size=64,
                    max_position_embeddings=512, tie_word_embeddings=False, sharpen=8.0)
    return path


def load(ckpt, slots=4):
    return OffloadedQwen3Moe.from_pretrained(ckpt, cache_slots=slots, max_len=512)


class SelfDrafter:
    """Drafts with a noisy copy of the target itself (EAGLE-2 dynamic expansion), so that long
    paths get accepted; the target's argmax child is placed *last* among its siblings so accepted
    paths are rarely the leftmost."""

    def __init__(self, ckpt, noise=1.0, seed=0):
        self.model = load(ckpt, slots="all")
        self.noise, self.gen = noise, torch.Generator().manual_seed(seed)
        self.committed: list[int] = []

    def prefill(self, tokens, aux):
        self.committed = []
        self.model.reset()
        self.commit(tokens, aux)

    def commit(self, tokens, aux):
        self.committed += [int(t) for t in tokens]
        self.model.prefill(torch.as_tensor(tokens))

    def draft_levels(self, root, top_k, depth):
        tokens, parents, pp = [int(root)], [-1], [1.0]
        frontier = [0]
        for d in range(1, depth + 1):
            logits = self.model.verify(torch.tensor(tokens), parents).logits
            logits = logits + self.noise * torch.randn(logits.shape, generator=self.gen)
            new_par, new_tok, new_pp = [], [], []
            for f in frontier:
                q, ids = torch.softmax(logits[f], -1).topk(top_k)
                for qi, ti in reversed(list(zip(q.tolist(), ids.tolist()))):
                    new_par.append(f)
                    new_tok.append(ti)
                    new_pp.append(pp[f] * qi)
            start = len(tokens)
            tokens += new_tok
            parents += new_par
            pp += new_pp
            yield SimpleNamespace(parents=torch.tensor(new_par), tokens=torch.tensor(new_tok),
                                  path_prob=torch.tensor(new_pp, dtype=torch.float64), hidden=None)
            order = sorted(range(len(new_pp)), key=lambda i: -new_pp[i])[:top_k]
            frontier = [start + i for i in sorted(order)]


class FixedPredictor:
    """Predicts each token's experts from a fixed random table (deterministic, imperfect)."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.table = np.stack([np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(LAYERS)])
                               for _ in range(VOCAB)])

    def reset(self):
        pass

    def observe(self, tokens, routing, hidden):
        assert routing.shape == (len(tokens), LAYERS, TOP_K)

    def predict(self, tokens, hidden):
        return self.table[np.asarray(tokens)]


class CountingPredictor(FixedPredictor):
    """FixedPredictor that records how many tokens each call predicts (``sizes``)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def predict(self, tokens, hidden):
        self.sizes.append(len(tokens))
        return super().predict(tokens, hidden)


COST = CostModel(6.0, 0.1, 0.05)  # cheap experts: the cost-aware methods verify real trees
PROMPTS = [[5, 17, 33, 2], [60, 61, 62, 63, 1, 9], [7]]


def decoder(ckpt, method, drafter, **kw):
    m = get_method(method)
    target = load(ckpt, slots=4 if m.uses_cache else 0)
    ref = load(ckpt, slots="all") if m.needs_reference else None
    kw.setdefault("shadows", False)  # these tests drive real drafted cycles; tests/engine/test_shadow.py the shadows
    return SpecDecoder(target, drafter, m, cost=COST, predictor=FixedPredictor(), reference=ref, **kw)


@pytest.fixture(scope="module")
def ar_outputs(ckpt):
    dec = decoder(ckpt, "ar", None)
    return [dec.generate(p, 16).output_ids for p in PROMPTS]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_output_of_every_method_equals_ar(ckpt, ar_outputs, method):
    dec = decoder(ckpt, method, SelfDrafter(ckpt), tree=TreeSettings(total_tokens=8, depth=3, top_k=3))
    taus, cycles = [], []
    for prompt, expected in zip(PROMPTS, ar_outputs):
        gen = dec.generate(prompt, 16)
        assert gen.output_ids == expected
        taus.append(gen.tau)
        cycles += gen.cycles
    if get_method(method).calibrated:  # the AR gate may stop drafting once it measured that drafting loses
        drafted = [c for c in cycles if c.decision != "ar"]
        assert len(drafted) >= dec.online.policy.MIN_DRAFTED and sum(c.accepted for c in drafted) >= 1
    elif get_method(method).drafts:  # (ar+lookahead drafts a lookahead chain, never verified: tau 1)
        assert max(taus) > 1.2  # the self drafter makes speculation accept tokens


def test_records_add_up_and_match_runtime_counters(ckpt):
    dec = decoder(ckpt, "specfit", SelfDrafter(ckpt), tree=TreeSettings(10, 4, 3))
    dec.target.cache.reset_stats()
    gen = dec.generate(PROMPTS[1], 30)
    committed = sum(c.committed for c in gen.cycles)
    assert committed >= len(gen.output_ids) and committed - gen.cycles[-1].committed < 30
    assert all(c.committed == c.accepted + 1 and c.nodes_verified >= c.accepted + 1 for c in gen.cycles)
    stats = dec.target.cache.stats()  # the prefill's misses are counted there too
    transferred = np.sum([c.transferred for c in gen.cycles], axis=0)
    assert transferred.shape == (LAYERS,)
    assert int(transferred.sum()) <= stats["total"]["misses"]
    assert gen.tau == pytest.approx(committed / len(gen.cycles))


def test_transferred_equals_miss_counters_without_prefill(ckpt):
    dec = decoder(ckpt, "eagle3", SelfDrafter(ckpt), tree=TreeSettings(8, 3, 2))
    dec.target.cache.reset_stats()
    gen = dec.generate([PROMPTS[2][0]], 12)  # one-token prompt: no prefill forward
    transferred = np.sum([c.transferred for c in gen.cycles], axis=0)
    assert transferred.tolist() == [s["misses"] for s in dec.target.cache.stats()["layers"]]


def test_state_after_generation_equals_fresh_prefill(ckpt):
    dec = decoder(ckpt, "specfit", SelfDrafter(ckpt), tree=TreeSettings(10, 4, 3))
    prompt = PROMPTS[0]
    gen = dec.generate(prompt, 20)
    committed = prompt + gen.output_ids
    kv = dec.target.kv_len
    # everything committed except the cycles' last bonus token (the next root) is in the KV cache
    fresh = load(ckpt, slots="all")
    fresh.prefill(torch.tensor(committed[:kv]))
    assert torch.allclose(dec.target.k_cache[:, :, :kv], fresh.k_cache[:, :, :kv], atol=1e-5)
    assert torch.allclose(dec.target.v_cache[:, :, :kv], fresh.v_cache[:, :, :kv], atol=1e-5)
    assert dec.drafter.committed == committed[:kv]


@pytest.mark.parametrize("top_k,depth", [(1, 1), (1, 8), (2, 5), (4, 3)])
def test_shape_fuzz_through_the_loop(ckpt, ar_outputs, top_k, depth):
    for method in ("eagle3", "specfit"):
        dec = decoder(ckpt, method, SelfDrafter(ckpt, noise=2.0, seed=top_k),
                      tree=TreeSettings(total_tokens=top_k * depth, depth=depth, top_k=top_k))
        assert dec.generate(PROMPTS[1], 16).output_ids == ar_outputs[1]


def test_root_only_selections_are_plain_ar_steps(ckpt, ar_outputs):
    expensive = CostModel(1.0, 1000.0, 0.0)  # every extra node costs more than it can bring
    target = load(ckpt)
    dec = SpecDecoder(target, SelfDrafter(ckpt), "specfit", cost=expensive, predictor=FixedPredictor(),
                      tree=TreeSettings(10, 4, 3))
    gen = dec.generate(PROMPTS[0], 28)
    assert gen.output_ids[:16] == ar_outputs[0]
    assert all(c.nodes_verified == 1 and c.committed == 1 for c in gen.cycles)
    assert gen.tau == 1.0
    # the stop rule ends drafting after the first level; once drafting is measured slower than AR (after
    # UtilityGate.WARMUP + MIN_DRAFTED drafted cycles, here shadow cycles: AR steps that draft a tree they do
    # not verify) the AR gate skips drafting altogether
    assert all(c.levels + c.shadow_levels == (0 if c.decision == "ar" else 1) for c in gen.cycles)
    assert {c.decision for c in gen.cycles} == {"shadow", "ar"}
    assert [c.decision for c in gen.cycles][dec.online.policy.WARMUP + dec.online.policy.MIN_DRAFTED] == "ar"


def test_rate_mode_is_lossless(ckpt, ar_outputs):
    dec = decoder(ckpt, "specfit", SelfDrafter(ckpt), tree=TreeSettings(10, 4, 3), rate_mode=True)
    assert dec.generate(PROMPTS[1], 16).output_ids == ar_outputs[1]


def test_sampling_runs_and_is_reproducible(ckpt):
    outs = []
    for _ in range(2):
        dec = decoder(ckpt, "specfit", SelfDrafter(ckpt), tree=TreeSettings(10, 3, 3), temperature=0.8, seed=7)
        outs.append(dec.generate(PROMPTS[0], 16).output_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 16


def test_configuration_errors(ckpt):
    target = load(ckpt)
    with pytest.raises(SpecFitInputError, match="method"):
        get_method("medusa")
    with pytest.raises(SpecFitInputError, match="drafter"):
        SpecDecoder(target, None, "eagle3")
    with pytest.raises(SpecFitInputError, match="predictor"):
        SpecDecoder(target, object(), "specfit", cost=COST)
    with pytest.raises(SpecFitInputError, match="reference"):
        SpecDecoder(target, object(), "oracle", cost=COST)
    dec = SpecDecoder(target, None, "ar")
    with pytest.raises(SpecFitInputError, match="max_new_tokens"):
        dec.generate([1, 2], 0)
    with pytest.raises(SpecFitInputError, match="prompt_ids"):
        dec.generate([], 4)
    with pytest.raises(SpecFitInputError, match="total_tokens"):
        TreeSettings(total_tokens=0)


def test_ar_gate_takes_the_ar_step_when_drafting_does_not_pay_and_explores(ckpt, ar_outputs):
    dec = decoder(ckpt, "specfit", SelfDrafter(ckpt), tree=TreeSettings(8, 3, 3))
    dec.acceptance.trials[:] = 1e4  # learned: nothing the draft proposes is ever accepted
    dec.acceptance.refresh()
    online = dec.online
    gen = dec.generate(PROMPTS[1], 48)
    assert gen.output_ids == decoder(ckpt, "ar", None).generate(PROMPTS[1], 48).output_ids
    decisions = "".join(c.decision[0] for c in gen.cycles)  # d(raft) / e(xplore) / a(r)
    warm = online.policy.WARMUP + online.policy.MIN_DRAFTED
    assert decisions[:warm] == "d" * warm  # learning, then Ŝ not trusted before MIN_DRAFTED measured cycles
    gaps = [len(r) for r in decisions[warm:].split("e")]
    assert len(gaps) >= 3 and "d" not in decisions[warm:]
    first = online.policy.EXPLORE_FIRST
    assert gaps[:-1] == [min(first * 2 ** i, online.policy.EXPLORE_MAX) for i in range(len(gaps) - 1)]  # doubling
    assert online.policy.state.explorations == len(gaps) - 1
    for c in gen.cycles:
        if c.decision == "ar":
            assert (c.levels, c.nodes_verified, c.committed, c.expected_tokens) == (0, 1, 1, 1.0)
            assert c.predicted_ms == COST.cycle_ms(1, c.transferred)  # T(AR) of its counts, the rate mode's λ
            assert c.speedup_estimate is not None and c.speedup_estimate <= 1.0
        else:
            assert c.ar_step_ms >= COST.fixed_ms + COST.per_node_ms  # the counterfactual AR step is known


def test_the_sound_gate_runs_behind_the_first_level_while_it_last_said_draft(ckpt, ar_outputs):
    """Where Ŝ > 1 asks the sound bound, a cycle whose bound last said a draft can beat the AR step
    launches its first draft level before predicting the root and asking the bound (both run behind the
    head forward); when the bound now says no, the cycle takes the AR step and pays the level it launched
    (``levels_ahead``, no level used). The next cycle, the bound having said no, asks it before launching
    anything. Output equal to AR's throughout."""
    dec = decoder(ckpt, "specfit", SelfDrafter(ckpt), tree=TreeSettings(8, 3, 3))
    online, answers, launched = dec.online, iter([True, False, False]), []
    online.policy.state.drafted, online.policy.state.gain_ms, online.policy.state.spent_ms = online.policy.WARMUP + online.policy.MIN_DRAFTED, 2.0, 1.0  # Ŝ = 2
    draft_levels = dec.drafter.draft_levels

    def counted_levels(*args):
        launched.append(len(asked))
        return draft_levels(*args)

    asked = []

    def gate(root, cache):
        asked.append(len(launched))
        return next(answers, True)

    dec.drafter.draft_levels, dec._sound_gate = counted_levels, gate
    online.observe = lambda **kw: None  # Ŝ stays 2: the bound decides
    gen = dec.generate(PROMPTS[0], 3)
    assert gen.output_ids == ar_outputs[0][:len(gen.output_ids)]
    c0, c1, c2 = gen.cycles[:3]
    assert asked[:3] == [1, 2, 2]  # asked after the launch, after the launch, then before any launch
    assert (c0.decision, c1.decision, c2.decision) == ("draft", "ar", "ar")
    assert c0.levels >= 1 and c0.hidden_host_ms > 0.0
    assert (c1.levels, c1.levels_ahead, c1.nodes_verified) == (0, 1, 1) and c1.draft_ms > 0.0
    assert (c2.levels, c2.levels_ahead, c2.draft_ms) == (0, 0, 0.0)
    assert not online.policy.state.sound_said_draft


def test_online_state_carries_across_generations(ckpt, ar_outputs):
    """A decoder built with another's OnlineModel starts from what that one learned."""
    first = decoder(ckpt, "specfit", SelfDrafter(ckpt), tree=TreeSettings(8, 3, 3))
    first.acceptance.trials[:] = 1e4
    first.generate(PROMPTS[1], 32)
    learned = first.online.policy.state.drafted
    assert learned >= first.online.policy.WARMUP + first.online.policy.MIN_DRAFTED
    second = SpecDecoder(load(ckpt), SelfDrafter(ckpt), "specfit", shadows=False, tree=TreeSettings(8, 3, 3), cost=COST,
                         predictor=FixedPredictor(), online=first.online)
    gen = second.generate(PROMPTS[1], 8)
    assert gen.output_ids == ar_outputs[1][:8]
    assert gen.cycles[0].decision == "ar"  # learned: drafting does not pay here
    assert second.acceptance is first.online.acceptance


def test_calibrated_method_learns_from_its_verifies(ckpt, ar_outputs):
    dec = decoder(ckpt, "specfit", SelfDrafter(ckpt), tree=TreeSettings(8, 3, 3))
    gen = dec.generate(PROMPTS[0], 16)
    assert gen.output_ids == ar_outputs[0]
    drafted = [c for c in gen.cycles if c.nodes_verified > 1]
    assert drafted and dec.acceptance.trials.sum() >= sum(c.nodes_verified - 1 for c in drafted[:1])
    # one success per accepted node, and one more where the bonus token is a drafted child of the last
    # accepted node that the selection did not verify (greedy_trials: such a child would have been accepted)
    accepted = sum(c.accepted for c in gen.cycles)
    assert accepted <= dec.acceptance.accepted.sum() <= accepted + sum(c.levels > 0 for c in gen.cycles)
    # the per-depth path correction counts, per depth, the verifies that accepted a node there
    cal = dec.acceptance
    assert cal.path_accepted.sum() == sum(c.accepted for c in drafted)
    assert cal.path_accepted[1] == sum(c.accepted >= 1 for c in drafted)
    assert cal.path_predicted[1:].sum() > 0 and not np.allclose(cal.path_factor, 1.0)


def test_oracle_with_every_expert_resident_keeps_its_reference_in_step(ckpt):
    """With every expert cached the oracle needs no true routing, so its reference target has not verified
    the drafted tree: it must mirror the verify of the selected subtree (its node ids, not the tree's)."""
    target, ref = load(ckpt, slots="all"), load(ckpt, slots="all")
    dec = SpecDecoder(target, SelfDrafter(ckpt), "oracle", shadows=False, cost=COST, reference=ref, tree=TreeSettings(8, 3, 3))
    expected = decoder(ckpt, "ar", None).generate(PROMPTS[1], 24).output_ids
    dec.generate(PROMPTS[0], 24)  # warms the cache
    from specfit.engine.decoder import _cache_mask
    assert _cache_mask(target, EXPERTS).shape == (LAYERS, EXPERTS) and _cache_mask(target, EXPERTS).all()  # every expert resident from here on
    gen = dec.generate(PROMPTS[1], 24)
    assert gen.output_ids == expected
    assert any(c.nodes_verified > 1 for c in gen.cycles)  # the mirrored verify had draft nodes in it


def test_the_engine_bounds_each_solve_by_search_nodes(ckpt):
    """A branch and bound (host regime, budgets) can take seconds on rare trees; the engine's exact
    selector stops after SOLVE_MAX_VISITS search nodes with the best selection found, and has no wall-clock
    limit (a machine's speed would change its selections); cost-blind selectors take none."""
    spec = SpecDecoder(load(ckpt), SelfDrafter(ckpt), "specfit", shadows=False, cost=COST, predictor=FixedPredictor())
    assert spec.solver.max_visits == SpecDecoder.SOLVE_MAX_VISITS > 0 and spec.solver.time_limit_s is None
    eagle = SpecDecoder(load(ckpt), SelfDrafter(ckpt), "eagle3", cost=COST)
    assert not hasattr(eagle.solver, "time_limit_s")


class _Corrupt:
    """Wraps a drafter or predictor and corrupts its output (the engine's checks of extension points)."""

    valid_output = False  # a corrupting wrapper promises nothing of the predictions it changes

    def __init__(self, inner, **change):
        self.inner, self.change = inner, change

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft_levels(self, root, top_k, depth):
        for level in self.inner.draft_levels(root, top_k, depth):
            yield SimpleNamespace(**{**vars(level), **{k: f(level) for k, f in self.change.items()}})

    def predict(self, tokens, hidden):
        return self.change["experts"](self.inner.predict(tokens, hidden))


@pytest.mark.parametrize("drafted,predicted,field", [
    ({"path_prob": lambda lv: torch.full_like(lv.path_prob, float("nan"))}, None, "path_prob"),
    ({"path_prob": lambda lv: -lv.path_prob}, None, "path_prob"),
    (None, lambda e: e + EXPERTS, r"experts\[\d+\]\[0\]: expert id \d+ is out of range"),
    (None, lambda e: e[:, :1], "experts"),  # one layer instead of LAYERS
])
def test_bad_drafter_or_predictor_output_is_refused_by_field(ckpt, drafted, predicted, field):
    drafter = SelfDrafter(ckpt) if drafted is None else _Corrupt(SelfDrafter(ckpt), **drafted)
    dec = decoder(ckpt, "specfit", drafter, tree=TreeSettings(8, 3, 3))
    if predicted is not None:
        dec.predictor = _Corrupt(dec.predictor, experts=predicted)
        # the root's prediction is checked too: only the draft levels' output is corrupted
        real = dec.predictor.inner
        dec.predictor.predict = lambda tokens, hidden: (predicted(real.predict(tokens, hidden)) if len(tokens) > 1
                                                        else real.predict(tokens, hidden))
    with pytest.raises(SpecFitInputError, match=field):
        dec.generate(PROMPTS[0], 16)


def test_the_engine_observes_and_predicts_in_one_call_where_the_predictor_can(ckpt, monkeypatch):
    """A predictor with ``observe_and_predict`` observes every committed token in that call, at the first
    prediction after them (``observe`` only takes the prompt), and sees the same tokens, in the same order,
    as one without it; the generation is the same (host CPU time frozen: it enters the selection)."""
    monkeypatch.setattr(MeasuredClock, "cpu", lambda self: 0.0)  # the engine's host CPU time frozen

    class Recording(FixedPredictor):
        def __init__(self):
            super().__init__()
            self.seen, self.observes = [], 0

        def observe(self, tokens, routing, hidden):
            super().observe(tokens, routing, hidden)
            self.seen += list(tokens)
            self.observes += 1

    class Fused(Recording):
        def observe_and_predict(self, observed, routing, tokens, hidden):
            super().observe(observed, routing, None)
            self.observes -= 1  # counted apart: fused calls
            self.fused = getattr(self, "fused", 0) + 1
            return self.predict(tokens, hidden)

    runs = []
    for predictor in (Recording(), Fused()):
        dec = SpecDecoder(load(ckpt, slots=4), SelfDrafter(ckpt), "specfit", shadows=False, cost=COST, predictor=predictor,
                          tree=TreeSettings(8, 3, 3))
        gen = dec.generate(PROMPTS[1], 16)
        runs.append((gen.output_ids, [c.nodes_verified for c in gen.cycles], predictor))
    (out, nodes, plain), (out_f, nodes_f, fused) = runs
    assert (out, nodes) == (out_f, nodes_f) and max(nodes) > 1
    assert fused.seen == plain.seen and fused.fused > 1
    assert fused.observes == 1  # the prompt's, at prefill; every committed token through the fused call


def test_the_corrected_costs_terms_are_computed_in_the_learning_slot(ckpt, monkeypatch):
    """Every corrected cost a cycle builds after the first learning finds its correction terms already
    computed (OnlineModel.weighted_corrections, filled behind the verify by _learn_last_cycle), so the
    root's work behind the first draft level takes one dot product for them, not three."""
    from specfit.engine.online import OnlineModel

    found = []
    corrected = OnlineModel.corrected_cost

    def recording(self, cost, root_new):
        if self.root_weight:
            memo = self._weighted
            found.append(memo is not None and memo[0] is cost.per_expert_array(self.root_error.size))
        return corrected(self, cost, root_new)

    monkeypatch.setattr(OnlineModel, "corrected_cost", recording)
    dec = decoder(ckpt, "specfit", SelfDrafter(ckpt), tree=TreeSettings(8, 3, 3))
    gen = dec.generate(PROMPTS[1], 16)
    assert sum(1 for c in gen.cycles if c.levels) > 2 and len(found) > 2 and all(found)


@pytest.mark.parametrize("declared", [False, True])
def test_only_a_predictor_that_declares_valid_output_goes_unchecked(ckpt, monkeypatch, declared):
    """The engine checks each prediction (check_experts) unless the predictor declares ``valid_output``
    (the built-in ones, held to it in tests/models/test_predictors.py); the output is the same."""
    checked = []
    real = decoder_module.check_experts
    monkeypatch.setattr(decoder_module, "check_experts", lambda *a, **k: checked.append(1) or real(*a, **k))
    predictor = FixedPredictor()
    predictor.valid_output = declared
    dec = SpecDecoder(load(ckpt), SelfDrafter(ckpt), "specfit", shadows=False, cost=COST, predictor=predictor,
                      tree=TreeSettings(8, 3, 3))
    gen = dec.generate(PROMPTS[0], 16)
    assert any(c.levels for c in gen.cycles)  # drafted cycles predicted
    assert bool(checked) is not declared


def test_a_drafter_in_bfloat16_drafts_as_in_float32(ckpt, monkeypatch):
    """Path probabilities in a dtype numpy lacks (bfloat16) are widened, not refused: the same
    output and the same verified nodes as the float32 rounding of those probabilities (host CPU
    time frozen: the whole-cycle objective prices the measured host ms)."""
    monkeypatch.setattr(MeasuredClock, "cpu", lambda self: 0.0)  # the engine's host CPU time frozen
    runs = []
    for dtype in (torch.bfloat16, torch.float32):
        to = (lambda lv: lv.path_prob.to(torch.bfloat16)) if dtype == torch.bfloat16 else \
            (lambda lv: lv.path_prob.to(torch.bfloat16).float())
        dec = decoder(ckpt, "specfit", _Corrupt(SelfDrafter(ckpt), path_prob=to), tree=TreeSettings(8, 3, 3))
        gen = dec.generate(PROMPTS[0], 16)
        runs.append((gen.output_ids, [c.nodes_verified for c in gen.cycles], [c.levels for c in gen.cycles]))
    assert runs[0] == runs[1]
    assert sum(runs[0][1]) > len(runs[0][1])  # draft nodes were verified


def test_predict_ms_is_the_predictors_own_time(ckpt):
    """predict_ms times the expert predictor's calls alone; tree building and calibration are tree_ms."""
    import time as _time

    class SlowPredictor(FixedPredictor):
        calls = 0

        def predict(self, tokens, hidden):
            SlowPredictor.calls += 1
            _time.sleep(SLEEP_MS / 1e3)
            return super().predict(tokens, hidden)

    SLEEP_MS = 20.0  # per call: far above what the cycle does around it, even on a loaded machine (2 ms
    # was not: a newcomer's run beside another test run measured 12 ms of tree_ms against a 10 ms bound)
    dec = SpecDecoder(load(ckpt), SelfDrafter(ckpt), "specfit", shadows=False, tree=TreeSettings(8, 3, 3), cost=COST,
                      predictor=SlowPredictor())
    gen = dec.generate(PROMPTS[0], 6)
    predict, tree = sum(c.predict_ms for c in gen.cycles), sum(c.tree_ms for c in gen.cycles)
    assert SlowPredictor.calls > 0 and predict >= SLEEP_MS * SlowPredictor.calls * 0.95
    assert 0 < tree < SLEEP_MS * SlowPredictor.calls * 0.5  # the sleeps are not in tree_ms


def test_kept_levels_are_predicted_once_per_solve_not_per_level(ckpt):
    """The stop rule and the pruning read only P and the cost: a cycle's kept levels are predicted in
    one call before each solve (one more per cycle for the root), each kept node once."""
    predictor = CountingPredictor()
    dec = SpecDecoder(load(ckpt), SelfDrafter(ckpt), "specfit", shadows=False, tree=TreeSettings(16, 4, 3), cost=COST,
                      predictor=predictor)
    solves = []
    solve = dec.solver.solve_tree  # the engine's per-cycle solve
    dec.solver.solve_tree = lambda tree, *a, **kw: solves.append(tree.n) or solve(tree, *a, **kw)
    cycles = dec.generate(PROMPTS[1], 24).cycles
    drafted = [c for c in cycles if c.levels]
    kept = sum(c.nodes_drafted - c.nodes_pruned for c in drafted)
    assert sum(c.levels for c in drafted) > len(solves) + len(cycles)  # one call per level could not pass
    assert len(predictor.sizes) <= len(cycles) + len(solves)
    roots = len(predictor.sizes) - sum(1 for s in predictor.sizes if s > 1)  # calls of one token: roots, or one kept node
    assert kept <= sum(predictor.sizes) <= kept + len(cycles) and roots >= 1


def test_levels_with_and_without_hidden_states_each_reach_the_predictor(ckpt, ar_outputs):
    """A drafter that gives hidden states at some levels only: each level's rows reach the predictor with
    the states it has (one call per level then), and the output is still AR's."""
    class HalfHidden(SelfDrafter):
        def draft_levels(self, root, top_k, max_depth):
            for j, level in enumerate(super().draft_levels(root, top_k, max_depth), start=1):
                hidden = torch.full((len(level.tokens), 4), float(j)) if j % 2 else None
                yield SimpleNamespace(**{**vars(level), "hidden": hidden})

    class Recording(FixedPredictor):
        def __init__(self):
            super().__init__()
            self.rows = []

        def predict(self, tokens, hidden):
            self.rows += [None] * len(tokens) if hidden is None else [float(h[0]) for h in hidden]
            return super().predict(tokens, hidden)

    predictor = Recording()
    dec = SpecDecoder(load(ckpt), HalfHidden(ckpt), "specfit", shadows=False, tree=TreeSettings(16, 4, 3), cost=COST,
                      predictor=predictor)
    gen = dec.generate(PROMPTS[1], 16)
    assert gen.output_ids == ar_outputs[1]
    assert {1.0, 3.0} & set(predictor.rows) and None in predictor.rows  # odd levels' states arrived
    assert 2.0 not in predictor.rows and 4.0 not in predictor.rows
    blind = Recording()  # a predictor that says it never reads them is given none
    blind.uses_hidden = False
    dec = SpecDecoder(load(ckpt), HalfHidden(ckpt), "specfit", shadows=False, tree=TreeSettings(16, 4, 3), cost=COST, predictor=blind)
    gen = dec.generate(PROMPTS[1], 16)
    assert gen.output_ids == ar_outputs[1]
    assert blind.rows and set(blind.rows) == {None}
    from specfit.models.predictors import FrequencyPredictor, ProbePredictor, RecencyPredictor
    assert (FrequencyPredictor.uses_hidden, RecencyPredictor.uses_hidden, ProbePredictor.uses_hidden) == (False, False, True)


def test_the_frequency_predictor_is_given_its_compiled_calls_arrays(ckpt, ar_outputs):
    """The engine calls the frequency predictor's unchecked variants (``observe_and_predict_ids``,
    ``predict_ids``), which read their arguments as int64 C-contiguous arrays without checking: every
    array it passes is one, its predictions are those of the checked calls, and the output is ar's."""
    from specfit.models.predictors import FrequencyPredictor

    rng = np.random.default_rng(0)
    layers = load(ckpt).spec
    L, E, k = len(layers.moe_layers), layers.num_experts, layers.top_k
    table = rng.integers(0, 3, (VOCAB, L, E))
    args = (np.arange(VOCAB), table, np.full(VOCAB, 2), np.full((L, E), 1.0 / E), k)
    seen = []

    class Checked(FrequencyPredictor):
        def _check(self, *arrays):
            for a in arrays:
                assert type(a) is np.ndarray and a.dtype == np.int64 and a.flags.c_contiguous
            seen.append(tuple(a.ndim for a in arrays))

        def reset(self):
            super().reset()
            twin.reset()

        def observe(self, tokens, routing, draft_hidden=None):  # the prompt's routing: observed by both
            super().observe(tokens, routing)
            twin.observe(tokens, routing)

        def observe_and_predict_ids(self, observed, routing, tokens, draft_hidden=None):
            self._check(observed, routing, tokens)
            twin.observe(observed.tolist(), routing.tolist())  # the checked calls, on lists
            got = super().observe_and_predict_ids(observed, routing, tokens)
            np.testing.assert_array_equal(got, twin.predict(tokens.tolist()))
            return got

        def predict_ids(self, tokens, draft_hidden=None):
            self._check(tokens)
            got = super().predict_ids(tokens)
            np.testing.assert_array_equal(got, twin.predict(tokens.tolist()))
            return got

    twin = FrequencyPredictor(*args)
    dec = SpecDecoder(load(ckpt), SelfDrafter(ckpt), "specfit", shadows=False, tree=TreeSettings(8, 3, 3), cost=COST,
                      predictor=Checked(*args))
    gen = dec.generate(PROMPTS[1], 16)
    assert gen.output_ids == ar_outputs[1]
    assert (1, 3, 1) in seen and (1,) in seen


def test_acceptance_learning_runs_while_the_next_verify_is_computed(ckpt, ar_outputs, monkeypatch):
    """A verify's acceptance learning waits for the next cycle's verify (on a GPU it runs while the target
    computes it): every calibrated probability is computed with every verify but the last one learned, its
    CPU time up to the shortest verify is that cycle's ``hidden_host_ms`` (the rest stays in ``host_cpu_ms``),
    nothing is left unlearned when ``generate`` returns, and the first draft level's forward hides the
    cycle's own host work before it (the root's prediction and cost), up to ``draft_level_ms``."""
    import time as _time

    cost = CostModel(6.0, 0.1, 0.05, draft_level_ms=2.0)
    dec = SpecDecoder(load(ckpt), SelfDrafter(ckpt), "specfit", shadows=False, tree=TreeSettings(8, 3, 3), cost=cost,
                      predictor=FixedPredictor())
    learn, add_calibrated, pending_at_use = dec._learn_acceptance, _Drafted.add_calibrated, []
    learned_in = []  # the cycle whose verify slot ran each learning

    def slow_learn(*args):  # 5 ms of CPU, all of it hidden by a verify (the shortest: 6.15 ms)
        learned_in.append(len(cycles_so_far))
        end = _time.thread_time() + 0.005
        while _time.thread_time() < end:
            pass
        learn(*args)

    def checked_add_calibrated(*args):  # where a level's calibrated probabilities are computed
        pending_at_use.append(len(dec.online.deferred))
        return add_calibrated(*args)

    cycles_so_far, cycle = [], dec._cycle

    def counted_cycle(*args):
        out = cycle(*args)
        cycles_so_far.append(out.record)
        return out

    dec._learn_acceptance, dec._cycle = slow_learn, counted_cycle
    monkeypatch.setattr(_Drafted, "add_calibrated", checked_add_calibrated)
    gen = dec.generate(PROMPTS[0], 16)
    assert gen.output_ids == ar_outputs[0]
    drafted = [i for i, c in enumerate(gen.cycles) if c.levels]
    assert len(drafted) >= 3
    assert pending_at_use and max(pending_at_use) == 1 and not dec.online.deferred  # the last verify's, at most
    # each drafted verify is learned in the next cycle's verify slot, the last one's when generate returns
    assert learned_in == [i + 1 for i in drafted]
    for i in drafted[:-1]:
        c = gen.cycles[i + 1]
        assert 5.0 <= c.hidden_host_ms <= dec._shortest_verify_ms() + 2.0
    assert all(0.0 < gen.cycles[i].hidden_host_ms for i in drafted)  # behind the first level: the root's work
    if drafted[-1] == len(gen.cycles) - 1:
        assert gen.cycles[-1].host_cpu_ms >= 5.0 * 0.95  # the last drafted verify's, learned at the end: unhidden
    # the trials of every drafted cycle's verify are in the calibrator once generate returns
    assert dec.acceptance.path_accepted.sum() == sum(gen.cycles[i].accepted for i in drafted)


def test_host_work_a_level_launched_ahead_hides():
    """With a drafter that launches each level ahead, level j's host work is hidden up to draft_level_ms
    behind level j+1's forward; a cycle stopped before its depth paid one level more (levels_ahead), which
    hides its last level's and its final work up to draft_level_ms; the hidden ms leave host_cpu_ms (the
    cycle's untimed part) and the levels' host ms for hidden_host_ms."""
    def hide(level_host_ms, final_ms, levels, depth, slot_ms=0.25):
        now = decoder_module._CycleState(untimed_s=0.0, level_host_ms=sum(level_host_ms))
        dec = SimpleNamespace(cost=CostModel(6.0, 0.1, 0.05, draft_level_ms=slot_ms), _now=now)
        rec = decoder_module.CycleRecord(levels=levels, hidden_host_ms=0.1)
        SpecDecoder._hide_behind_levels(dec, rec, [h / 1e3 for h in level_host_ms], final_ms / 1e3, depth)
        assert now.untimed_s * 1e3 == pytest.approx(rec.hidden_host_ms - 0.1)
        assert now.level_host_ms == pytest.approx(max(sum(level_host_ms) - (rec.hidden_host_ms - 0.1), 0.0))
        return rec.hidden_host_ms - 0.1, rec.levels_ahead

    # stopped at level 3 of 6: 0.1 + 0.25 (level 2's 0.4 capped) + (0.05 + 0.1 behind the unused 4th level)
    assert hide([0.1, 0.4, 0.05], 0.1, 3, 6) == (pytest.approx(0.5), 1)
    assert hide([0.1, 0.4, 0.05], 0.5, 3, 6) == (pytest.approx(0.6), 1)  # the unused level hides 0.25 at most
    assert hide([0.1, 0.4, 0.05], 0.1, 3, 3) == (pytest.approx(0.35), 0)  # the depth reached: nothing unused
    assert hide([0.3], 0.0, 1, 1) == (0.0, 0)  # one level, the last: no forward after it
    assert hide([0.3], 0.0, 1, 6, slot_ms=0.0) == (0.0, 0)  # a profile without a draft-level time hides nothing


def test_a_drafter_that_launches_ahead_has_each_level_hide_its_host_work(ckpt, ar_outputs, monkeypatch):
    """Through the engine, with a drafter that declares launches_ahead: output equal to AR's; a cycle
    counts a level launched ahead only when it stopped before its depth; each level's host work (made
    at least 1 ms here) is hidden up to draft_level_ms behind the next level's forward, and the unused
    level's too; a drafter that does not launch ahead hides none of it."""
    import time as _time

    class AheadDrafter(SelfDrafter):
        launches_ahead = True

    add_calibrated = _Drafted.add_calibrated

    def slow_add_calibrated(*args):  # a level's host work: at least 1 ms of CPU
        end = _time.thread_time() + 0.001
        while _time.thread_time() < end:
            pass
        return add_calibrated(*args)

    monkeypatch.setattr(_Drafted, "add_calibrated", slow_add_calibrated)
    cost = CostModel(6.0, 0.1, 0.05, draft_level_ms=0.5)
    hidden = {}
    for drafter in (AheadDrafter, SelfDrafter):
        dec = SpecDecoder(load(ckpt), drafter(ckpt), "specfit", shadows=False, tree=TreeSettings(8, 3, 3), cost=cost,
                          predictor=FixedPredictor())
        dec._shortest_verify_ms = lambda: 0.0  # no learning hidden behind a verify: only the levels' share
        dec._hide_behind_first_level = lambda rec, start: None  # nor behind the first level
        gen = dec.generate(PROMPTS[0], 16)
        assert gen.output_ids == ar_outputs[0]
        drafted = [c for c in gen.cycles if c.levels]
        assert drafted
        for c in gen.cycles:
            assert c.levels_ahead in (0, 1) and (not c.levels_ahead or 0 < c.levels < 3)
        hidden[drafter] = [(c.hidden_host_ms, 0.5 * (c.levels - 1 + c.levels_ahead)) for c in drafted]
    assert all(h == pytest.approx(want) for h, want in hidden[AheadDrafter])
    assert any(want > 0 for _, want in hidden[AheadDrafter])
    assert all(h == 0.0 for h, _ in hidden[SelfDrafter])


@pytest.mark.parametrize("slots", [0, 4, "all"])
def test_cache_mask_is_the_resident_experts(ckpt, slots):
    """The engine's cache mask (the all-resident shortcut included) marks exactly cached_experts."""
    target = load(ckpt, slots=slots)
    target.prefill(torch.tensor([1, 2, 3, 4, 5]))
    want = np.zeros((LAYERS, EXPERTS), dtype=bool)
    for layer, ids in enumerate(target.cache.cached_experts()):
        want[layer, ids] = True
    assert decoder_module._cache_mask(target, EXPERTS).tolist() == want.tolist()
    assert want.all() == (slots == "all")


def test_a_cycles_online_learning_runs_during_the_next_verify(ckpt, ar_outputs):
    """Each cycle's online learning (_learn) runs while the next cycle's verify is on the device: its CPU
    time up to the shortest verify (the root alone, every expert cached: fixed_ms + per_node_ms) is that
    cycle's hidden_host_ms, the rest its host_cpu_ms; the last cycle's is learned, unhidden, before
    generate returns; the gate counts every drafted cycle at once."""
    import time as _time

    cost = CostModel(6.0, 0.1, 0.05, draft_level_ms=0.0)
    dec = SpecDecoder(load(ckpt), SelfDrafter(ckpt), "specfit", shadows=False, tree=TreeSettings(8, 3, 3), cost=cost,
                      predictor=FixedPredictor())
    learn, calls = dec._learn, []

    def slow_learn(outcome, *args):  # 8 ms of CPU: 6.1 hidden by the next verify, 1.9 on the critical path
        calls.append(outcome.record)
        end = _time.thread_time() + 0.008
        while _time.thread_time() < end:
            pass
        learn(outcome, *args)

    dec._learn = slow_learn
    gen = dec.generate(PROMPTS[0], 16)
    assert gen.output_ids == ar_outputs[0]
    assert calls == gen.cycles and dec._carry.learning is None
    for c in gen.cycles[1:]:
        assert c.hidden_host_ms >= 6.1 - 1e-9 and c.host_cpu_ms >= 1.9 * 0.9
    assert gen.cycles[0].hidden_host_ms < 6.1  # no cycle before it: only the next gate's inputs
    assert gen.cycles[-1].host_cpu_ms >= 8.0 * 0.95  # its own learning, at the end: unhidden
    assert dec.online.policy.state.drafted == sum(1 for c in gen.cycles if c.levels)


def test_the_gates_inputs_are_computed_while_the_verify_runs(ckpt, ar_outputs):
    """Each drafted cycle's cheapest-node expert ms (the sound gate's bound) is computed after its
    selection, in the slot its verify hides (not inside the drafting), and the window the gate reads
    holds the last GATE_WINDOW of them."""
    dec = decoder(ckpt, "specfit", SelfDrafter(ckpt), tree=TreeSettings(total_tokens=8, depth=3, top_k=3))
    inside, seen = [False], []
    draft, cheapest = dec._draft_and_select, dec._cheapest_node_expert_ms

    def drafting(*args):
        inside[0] = True
        try:
            return draft(*args)
        finally:
            inside[0] = False

    def cheapest_ms(tree, cache):
        assert not inside[0] and tree.n > 1
        seen.append(cheapest(tree, cache))
        return seen[-1]

    dec._draft_and_select, dec._cheapest_node_expert_ms = drafting, cheapest_ms
    gen = dec.generate(PROMPTS[0], 16)
    assert gen.output_ids == ar_outputs[0]
    assert seen and len(seen) == sum(1 for c in gen.cycles if c.levels and c.nodes_drafted > c.nodes_pruned)
    assert list(dec.online.min_expert_ms) == seen[-dec.online.GATE_WINDOW:]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_no_kernel_is_compiled_inside_a_decoding_cycle(ckpt, method):
    """Every numba kernel a cycle calls is compiled (or loaded from numba's cache) when the decoder and its
    parts are built: a first call inside a cycle would be booked as that cycle's host time (seconds on a
    fresh checkout)."""
    from specfit.core import kernels
    from specfit.solvers import exact_compiled

    getters = [kernels.level_probs_kernel, kernels.draft_level_kernel, kernels.item_words_kernel, exact_compiled.exact_kernel,
               exact_compiled.linear_prefix_kernel, kernels.ratio_bound_kernel]
    for g in getters:
        g.cache_clear()
    dec = decoder(ckpt, method, SelfDrafter(ckpt), tree=TreeSettings(total_tokens=8, depth=3, top_k=3))
    built = [g.cache_info().misses for g in getters]
    dec.generate(PROMPTS[0], 8)
    assert [g.cache_info().misses for g in getters] == built


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_verify_inputs_are_the_selected_subtrees(data):
    """The verify's tokens and parents are those of DraftTree.subtree on the selection's nodes (sorted,
    root first, ancestor-closed), for any tree and any such node set."""
    n = data.draw(st.integers(1, 40))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = data.draw(st.lists(st.integers(0, 4095), min_size=n, max_size=n))
    tree = DraftTree(parents, q=[1.0] + [0.5] * (n - 1), tokens=tokens)
    keep = {0}
    for v in range(1, n):  # parents precede children: keep v only if its parent is kept
        if parents[v] in keep and data.draw(st.booleans()):
            keep.add(v)
    keep = sorted(keep)
    sub, _ = tree.subtree(keep)
    assert decoder_module._verify_inputs(tree, keep) == (sub.tokens.tolist(), sub.parents.tolist())


@pytest.mark.parametrize("method", ["specfit", "eagle3"])
def test_the_draft_policy_is_one_argument(ckpt, ar_outputs, method):
    """``policy="never"``: every cycle is an AR step that verifies the root alone; ``"always"``: no cycle
    skips drafting. The output is AR's either way."""
    for policy in ("never", "always"):
        dec = decoder(ckpt, method, SelfDrafter(ckpt), policy=policy)
        assert dec.policy.name == policy
        for prompt, expected in zip(PROMPTS[:2], ar_outputs):
            gen = dec.generate(prompt, 8)
            assert gen.output_ids == expected[:8]  # greedy: AR's first 8 tokens
            drafting = gen.cycles[1:]  # the first cycle has no drafter state yet for a one-token prompt
            if policy == "never":
                assert all(c.nodes_verified == 1 and c.levels == 0 for c in gen.cycles)
                assert drafting and all(c.decision == "ar" for c in drafting)
            else:
                assert drafting and all(c.decision == "draft" and c.levels >= 1 for c in drafting)


def test_a_policy_the_method_cannot_take_is_refused(ckpt):
    from specfit.engine.online import OnlineModel

    with pytest.raises(SpecFitInputError) as err:
        decoder(ckpt, "eagle3", SelfDrafter(ckpt), policy="gate")
    assert err.value.field == "policy"
    with pytest.raises(SpecFitInputError) as err:
        decoder(ckpt, "specfit", SelfDrafter(ckpt), policy="never", online=OnlineModel(6))
    assert err.value.field == "policy"
    with pytest.raises(SpecFitInputError) as err:
        decoder(ckpt, "specfit", SelfDrafter(ckpt), policy="sometimes")
    assert err.value.field == "policy"


def test_mechanisms_switched_off_by_argument_change_host_work_not_output(ckpt, ar_outputs):
    """``batch_predict=False`` calls the predictor once per draft level (each kept node still once),
    ``stop_bounds=False`` solves at every level the stop rule is asked, ``twin=False`` leaves the gate
    without its AR twin (no AR-twin ms, no shadow cycle); the output is AR's either way (FrozenClock:
    the same decisions for the same inputs)."""
    from specfit.engine.clock import FrozenClock

    def run(policy, **kw):
        predictor, solves = CountingPredictor(), []
        dec = SpecDecoder(load(ckpt), SelfDrafter(ckpt), "specfit", tree=TreeSettings(16, 4, 3), cost=COST,
                          predictor=predictor, policy=policy, clock=FrozenClock(), **kw)
        solve = dec.solver.solve_tree
        dec.solver.solve_tree = lambda tree, *a, **k: solves.append(tree.n) or solve(tree, *a, **k)
        gen = dec.generate(PROMPTS[1], 10)
        assert gen.output_ids == ar_outputs[1][:10]
        return gen.cycles, predictor.sizes, solves

    cycles, sizes, solves = run("always", shadows=False)
    per_level = run("always", shadows=False, batch_predict=False)
    assert [c.nodes_verified for c in per_level[0]] == [c.nodes_verified for c in cycles]
    assert len(per_level[1]) > len(sizes) and sum(per_level[1]) == sum(sizes)
    unbounded = run("always", shadows=False, stop_bounds=False)
    assert len(unbounded[2]) > len(solves)
    with_twin, no_twin = run("gate")[0], run("gate", twin=False)[0]
    assert any(c.ar_tokens_ms > 0 for c in with_twin)
    assert all(c.ar_tokens_ms == 0 and c.decision != "shadow" for c in no_twin)
