"""EAGLE-3 head: forward, public checkpoint layout, mismatch errors, level-by-level drafting."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from specfit.models.eagle3 import (
    WEIGHT_NAMES,
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Head,
    check_target,
    default_aux_layer_ids,
    load_eagle3,
    save_eagle3,
    select_aux_hidden,
)
from specfit.core.errors import SpecFitInputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, vocab_size=50, draft_vocab_size=40, target_hidden_size=24, aux_layer_ids=(1, 2, 4))
TARGET = {"hidden_size": 24, "num_hidden_layers": 6, "vocab_size": 50}


def random_head(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    head = Eagle3Head(cfg).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.4)
        # a non-trivial draft → target map: draft ids spread over the target vocabulary
        keep = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
        head.d2t.copy_(keep - torch.arange(cfg.draft_vocab_size))
        head.t2d.zero_()
        head.t2d[keep] = True
    return head


def prompt(seed=1, n=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g), torch.randn(n, 3 * CFG.target_hidden_size, generator=g)


@torch.no_grad()
def chain_step_logits(head, tokens, aux, path):
    """Reference: the draft logits after feeding ``path`` (root first) one token at a time.

    Runs causal attention over plain sequences (no tree mask, no drafter): the committed slots
    (token s+1, fused feature s), then the path tokens with the previous step's hidden state.
    """
    feats = head.fuse(aux)
    seq_tok = list(tokens[1:].tolist()) + [path[0]]
    hid = [feats[i] for i in range(len(tokens))]
    logits = None
    for j in range(len(path)):
        toks = torch.tensor(seq_tok)[None]
        x = torch.stack(hid)[None]
        t = toks.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        pk, pv = head.empty_kv(1)
        h, lg, _, _ = head.step(toks, x, torch.arange(1, t + 1), pk, pv, mask)
        logits = lg[0, -1]
        if j + 1 < len(path):
            seq_tok.append(path[j + 1])
            hid.append(h[0, -1])
    return logits


def test_forward_shapes_and_causality():
    head = random_head()
    ids = torch.randint(0, 50, (2, 7))
    aux = torch.randn(2, 7, 72)
    logits, h = head(ids, aux)
    assert logits.shape == (2, 7, 40) and h.shape == (2, 7, 32)
    ids2, aux2 = ids.clone(), aux.clone()
    ids2[:, 5:], aux2[:, 5:] = 3, 0.0  # changing the future must not change the past
    logits2, _ = head(ids2, aux2)
    torch.testing.assert_close(logits[:, :5], logits2[:, :5])
    assert not torch.allclose(logits[:, 5:], logits2[:, 5:])


def test_fuse_rejects_wrong_width():
    with pytest.raises(SpecFitInputError, match="target_aux_hidden"):
        random_head().fuse(torch.randn(3, 70))


def write_public_checkpoint(path, head, *, prefix="", config_edit=None, drop=(), include_embed=True):
    """Write a checkpoint by hand in the public layout (independent of save_eagle3)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": 50, "draft_vocab_size": 40, "target_hidden_size": 24,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4], "use_aux_hidden_state": True},
    }
    cfg.update(config_edit or {})
    (path / "config.json").write_text(json.dumps(cfg))
    sd = head.state_dict()
    names = list(WEIGHT_NAMES) + (["embed_tokens.weight"] if include_embed else [])
    tensors = {prefix + n: sd[n].clone().contiguous() for n in names if n not in drop}
    save_file(tensors, str(path / "model.safetensors"))


def test_load_public_layout_roundtrip(tmp_path):
    head = random_head()
    write_public_checkpoint(tmp_path / "a", head)
    loaded = load_eagle3(tmp_path / "a", TARGET)
    assert loaded.aux_layer_ids == (1, 2, 4)
    ids, aux = torch.randint(0, 50, (1, 6)), torch.randn(1, 6, 72)
    torch.testing.assert_close(loaded(ids, aux)[0], head(ids, aux)[0])
    torch.testing.assert_close(loaded.d2t, head.d2t)
    # "model." prefixed names and a head without its own embedding (the target's is passed in)
    write_public_checkpoint(tmp_path / "b", head, prefix="model.", include_embed=False)
    loaded = load_eagle3(tmp_path / "b", TARGET, embed_weight=head.embed_tokens.weight.detach())
    torch.testing.assert_close(loaded(ids, aux)[0], head(ids, aux)[0])
    # a .bin checkpoint (some published heads ship one)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    torch.save({n: head.state_dict()[n] for n in WEIGHT_NAMES}, tmp_path / "d" / "pytorch_model.bin")
    loaded = load_eagle3(tmp_path / "d", TARGET, embed_weight=head.embed_tokens.weight.detach())
    torch.testing.assert_close(loaded(ids, aux)[0], head(ids, aux)[0])
    # save_eagle3 writes the same layout back
    save_eagle3(loaded, tmp_path / "c", dtype=torch.float32)
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 40 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    again = load_eagle3(tmp_path / "c", TARGET, embed_weight=head.embed_tokens.weight.detach())
    torch.testing.assert_close(again(ids, aux)[0], head(ids, aux)[0])


@pytest.mark.parametrize(
    "target, field",
    [
        ({**TARGET, "hidden_size": 32}, "target_hidden_size"),
        ({**TARGET, "vocab_size": 51}, "vocab_size"),
        ({**TARGET, "num_hidden_layers": 4}, "eagle_aux_hidden_state_layer_ids"),  # id 4 out of range
    ],
)
def test_target_mismatch_errors(tmp_path, target, field):
    write_public_checkpoint(tmp_path, random_head())
    with pytest.raises(SpecFitInputError, match=field):
        load_eagle3(tmp_path, target)


@pytest.mark.parametrize(
    "edit, drop, field",
    [
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 2, 4]}}, (), "eagle_aux_hidden_state_layer_ids"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, (), "eagle_aux_hidden_state_layer_ids"),
        ({"draft_vocab_size": 41}, (), r"weights\.(d2t|lm_head\.weight)"),
        ({"target_hidden_size": 16}, (), "weights.fc.weight"),
        ({"num_hidden_layers": 2}, (), "num_hidden_layers"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, (), "rope_scaling"),
        ({}, ("midlayer.hidden_norm.weight",), "weights.midlayer.hidden_norm.weight"),
        ({}, ("d2t",), "weights.d2t"),
    ],
)
def test_checkpoint_errors(tmp_path, edit, drop, field):
    write_public_checkpoint(tmp_path, random_head(), config_edit=edit, drop=drop)
    target = {**TARGET, "hidden_size": edit.get("target_hidden_size", 24)}
    with pytest.raises(SpecFitInputError, match=field):
        load_eagle3(tmp_path, target)


def test_d2t_out_of_vocabulary_and_missing_embedding(tmp_path):
    head = random_head()
    with torch.no_grad():
        head.d2t[-1] = 100
    write_public_checkpoint(tmp_path / "a", head)
    with pytest.raises(SpecFitInputError, match="d2t"):
        load_eagle3(tmp_path / "a", TARGET)
    write_public_checkpoint(tmp_path / "b", random_head(), include_embed=False)
    with pytest.raises(SpecFitInputError, match="embed_tokens"):
        load_eagle3(tmp_path / "b", TARGET)


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(48) == (2, 24, 45)  # Qwen3-30B-A3B: EAGLE-3's (2, L/2, L-3)
    assert default_aux_layer_ids(6) == (1, 3, 5)  # shallow proxy: (2, 3, 3) is not distinct
    for n in range(3, 60):
        ids = default_aux_layer_ids(n)
        assert 0 <= ids[0] < ids[1] < ids[2] < n
    with pytest.raises(SpecFitInputError):
        default_aux_layer_ids(2)
    hs = [torch.full((1, 2, 3), float(i)) for i in range(5)]
    assert select_aux_hidden(hs, (1, 2, 4))[0, 0].tolist() == [1.0] * 3 + [2.0] * 3 + [4.0] * 3
    assert check_target(Eagle3Config(**{**CFG.__dict__, "aux_layer_ids": None}), TARGET) == (1, 3, 5)


@pytest.mark.parametrize("top_k, depth", [(1, 5), (2, 4), (3, 3), (4, 2)])
def test_levels_are_consistent(top_k, depth):
    head = random_head(2)
    tokens, aux = prompt()
    d = Eagle3Drafter(head)
    d.prefill(tokens, aux)
    prob = {0: 1.0}
    level_of = {0: 0}
    seen = 1
    for lv in d.draft_levels(7, top_k, depth):
        m = lv.node_ids.numel()
        expanded = 1 if lv.depth == 1 else min(top_k, top_k ** (lv.depth - 1))
        assert m == expanded * top_k
        assert lv.node_ids.tolist() == list(range(seen, seen + m))
        for nid, par, q, p in zip(lv.node_ids.tolist(), lv.parents.tolist(), lv.q.tolist(), lv.path_prob.tolist()):
            assert level_of[par] == lv.depth - 1  # parent in the previous (earlier) level
            assert p == pytest.approx(prob[par] * q, rel=1e-5)
            assert p <= prob[par] + 1e-9  # P non-increasing along every path
            prob[nid], level_of[nid] = p, lv.depth
        assert bool(head.t2d[lv.tokens].all())  # every token is a draft-vocabulary token
        assert lv.hidden.shape == (m, CFG.hidden_size)
        seen += m
    assert max(level_of.values()) == depth


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_each_level_is_launched_before_the_level_above_it_is_yielded(depth):
    """The drafter runs one head forward ahead (Eagle3Drafter.launches_ahead): when level j is yielded,
    level j+1's forward has run (none past max_depth), and the level's host copies (host_arrays) are its
    parents, tokens and path probabilities."""
    head = random_head(4)
    tokens, aux = prompt()
    d = Eagle3Drafter(head)
    d.prefill(tokens, aux)
    steps, step = [], head.step
    head.step = lambda *a, **kw: steps.append(1) or step(*a, **kw)  # counts the head forwards
    assert Eagle3Drafter.launches_ahead
    for j, lv in enumerate(d.draft_levels(7, 3, depth), start=1):
        assert len(steps) == min(j + 1, depth)
        parents, toks, pp = lv.host_arrays()
        assert parents.tolist() == lv.parents.tolist() and toks.tolist() == lv.tokens.tolist()
        assert pp.tolist() == lv.path_prob.tolist()
    gen = d.draft_levels(7, 3, depth)
    next(gen)
    gen.close()  # stopped after the first level: at most one forward more than it read
    assert len(steps) == depth + min(2, depth)


def test_tree_logits_equal_sequential_root_paths():
    """Every node's q equals the draft distribution of running its root path sequentially."""
    head = random_head(3)
    tokens, aux = prompt(4)
    d = Eagle3Drafter(head)
    d.prefill(tokens, aux)
    path_of = {0: [5]}
    for lv in d.draft_levels(5, 3, 3):
        for nid, par, tok, q in zip(lv.node_ids.tolist(), lv.parents.tolist(), lv.tokens.tolist(), lv.q.tolist()):
            path_of[nid] = path_of[par] + [tok]
            ref = torch.softmax(chain_step_logits(head, tokens, aux, path_of[par]), -1)
            draft_id = int((torch.arange(40) + head.d2t == tok).nonzero()[0, 0])
            assert q == pytest.approx(float(ref[draft_id]), rel=1e-4, abs=1e-6)


def test_top_k_1_is_greedy_chain():
    head = random_head(5)
    tokens, aux = prompt(6)
    d = Eagle3Drafter(head)
    d.prefill(tokens, aux)
    chain = [int(lv.tokens[0]) for lv in d.draft_levels(11, 1, 5)]
    path = [11]
    for _ in range(5):
        logits = chain_step_logits(head, tokens, aux, path)
        path.append(int(head.draft_to_target(logits.argmax())))
    assert chain == path[1:]


def assert_same_state(a, b):
    sa, sb = a.state(), b.state()
    assert sa["n_committed"] == sb["n_committed"]
    torch.testing.assert_close(sa["k"], sb["k"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sa["v"], sb["v"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sa["pending"], sb["pending"])


def test_commit_equals_fresh_prefill_without_ghost_kv():
    head = random_head(7)
    tokens, aux = prompt(8, n=14)
    d = Eagle3Drafter(head)
    d.prefill(tokens[:6], aux[:6])
    # a cycle: draft a branching tree, accept the root + two tokens, commit with the target's features
    levels = list(d.draft_levels(int(tokens[6]), 4, 4))
    assert sum(lv.node_ids.numel() for lv in levels) > 3
    d.commit(tokens[6:9], aux[6:9])
    # another cycle where only the root is accepted
    list(d.draft_levels(int(tokens[9]), 2, 3))
    d.commit(tokens[9:10], aux[9:10])
    fresh = Eagle3Drafter(head)
    fresh.prefill(tokens[:10], aux[:10])
    assert_same_state(d, fresh)
    # the next draft is identical too
    a = [lv.q for lv in d.draft_levels(int(tokens[10]), 3, 3)]
    b = [lv.q for lv in fresh.draft_levels(int(tokens[10]), 3, 3)]
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_drafting_input_errors():
    d = Eagle3Drafter(random_head())
    with pytest.raises(SpecFitInputError, match="drafter"):
        next(d.draft_levels(1, 2, 2))
    tokens, aux = prompt()
    d.prefill(tokens, aux)
    for kwargs, field in [((1, 0, 2), "top_k"), ((1, 2, 0), "max_depth"), ((99, 2, 2), "root_token")]:
        with pytest.raises(SpecFitInputError, match=field):
            next(d.draft_levels(*kwargs))
    with pytest.raises(SpecFitInputError, match="target_aux_hidden"):
        d.commit(tokens[:2], aux[:3])


def test_training_time_test_matches_drafting():
    """The head's training unroll (TTT) computes exactly what drafting a chain computes."""
    from specfit.models.proxy.train_head import ttt_logits

    head = random_head(9)
    tokens, aux = prompt(10, n=8)
    with torch.no_grad():
        steps = ttt_logits(head, tokens[None], aux[None], ttt_steps=3)
    for j, logits in enumerate(steps):
        for s in range(0, 7 - j):
            # committed tokens 0..s, root = token s+1, chain of teacher-forced tokens s+2..s+1+j
            ref = chain_step_logits(head, tokens[: s + 1], aux[: s + 1], tokens[s + 1: s + 2 + j].tolist())
            torch.testing.assert_close(logits[0, s], ref, rtol=1e-4, atol=1e-5)


def test_host_arrays_of_a_level_built_by_hand():
    """A DraftLevel without host copies gets them when read; a bfloat16 P is widened (numpy has none)."""
    from specfit.models.eagle3 import DraftLevel

    pp = torch.tensor([0.5, 0.25], dtype=torch.bfloat16)
    lv = DraftLevel(depth=1, node_ids=torch.tensor([1, 2]), parents=torch.tensor([0, 0]), tokens=torch.tensor([5, 9]),
                    q=pp, path_prob=pp, hidden=torch.zeros(2, 4))
    parents, toks, p = lv.host_arrays()
    assert parents.tolist() == [0, 0] and toks.tolist() == [5, 9]
    assert p.dtype == np.float64 and p.tolist() == [0.5, 0.25]


def test_commits_queue_until_the_next_draft():
    """commit runs no head forward: the next draft runs every token committed since in its first level's
    forward (no forward of its own), and the state and the draft are those of a drafter that committed
    eagerly (a fresh prefill)."""
    head = random_head(11)
    tokens, aux = prompt(12, n=14)
    d = Eagle3Drafter(head)
    d.prefill(tokens[:6], aux[:6])
    calls = []
    step = head.step
    head.step = lambda *a, **kw: calls.append((a[0].shape[1], kw.get("logits_from", 0))) or step(*a, **kw)
    try:
        for s in range(6, 10):  # four AR steps: one token each
            d.commit(tokens[s:s + 1], aux[s:s + 1])
        assert calls == [] and d.n_committed == 10
        levels = list(d.draft_levels(int(tokens[10]), 3, 2))
        # one forward per level; the first over the 4 queued slots and the root, the LM head on the root only
        assert calls[0] == (5, 4) and len(calls) == len(levels) and d.queued == []
    finally:
        head.step = step
    fresh = Eagle3Drafter(head)
    fresh.prefill(tokens[:10], aux[:10])
    assert_same_state(d, fresh)
    b = list(fresh.draft_levels(int(tokens[10]), 3, 2))
    for x, y in zip(levels, b):
        assert torch.equal(x.tokens, y.tokens)
        torch.testing.assert_close(x.q, y.q, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("bad", ["width", "id"])
def test_commit_checks_before_queueing(bad):
    """A bad feature width or an id outside the vocabulary raises at commit, and nothing is queued."""
    head = random_head(13)
    tokens, aux = prompt(14)
    d = Eagle3Drafter(head)
    d.prefill(tokens[:4], aux[:4])
    with pytest.raises(SpecFitInputError, match="target_aux_hidden" if bad == "width" else "accepted_tokens"):
        if bad == "width":
            d.commit(tokens[4:6], aux[4:6, :-1])
        else:
            d.commit(torch.tensor([head.cfg.vocab_size]), aux[4:5])
    assert d.n_committed == 4 and d.queued == []


def test_queued_commit_keeps_its_own_copy():
    """A caller that reuses its tensors after commit does not change what the catch-up reads."""
    head = random_head(15)
    tokens, aux = prompt(16, n=10)
    d = Eagle3Drafter(head)
    d.prefill(tokens[:5], aux[:5])
    buf_t, buf_a = tokens[5:8].clone(), aux[5:8].clone()
    d.commit(buf_t, buf_a)
    buf_t.zero_()
    buf_a.zero_()
    fresh = Eagle3Drafter(head)
    fresh.prefill(tokens[:8], aux[:8])
    assert_same_state(d, fresh)


def test_a_failed_draft_keeps_the_queue():
    """If the fused first forward fails, the queued commits stay queued and the committed cache unchanged:
    the next draft catches up as if the failed one had not run."""
    head = random_head(17)
    tokens, aux = prompt(18, n=10)
    d = Eagle3Drafter(head)
    d.prefill(tokens[:5], aux[:5])
    d.commit(tokens[5:8], aux[5:8])
    step = head.step

    def broken(*a, **kw):
        raise RuntimeError("device lost")

    head.step = broken
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            next(d.draft_levels(int(tokens[8]), 3, 2))
    finally:
        head.step = step
    assert len(d.queued) == 1 and d.k.shape[1] == 4  # the prompt's 4 slots only (EAGLE's shift)
    fresh = Eagle3Drafter(head)
    fresh.prefill(tokens[:8], aux[:8])
    a, b = list(d.draft_levels(int(tokens[8]), 3, 2)), list(fresh.draft_levels(int(tokens[8]), 3, 2))
    for x, y in zip(a, b):
        assert torch.equal(x.tokens, y.tokens)
        torch.testing.assert_close(x.q, y.q, rtol=1e-4, atol=1e-6)
