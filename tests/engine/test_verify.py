"""Verifiers: greedy equals the argmax walk; sampling is lossless (statistically), duplicates included."""

import itertools

import pytest
import torch

from specfit.core.errors import SpecFitInputError
from specfit.engine.verify import target_probs, verify_greedy, verify_sampling

V = 3
# A Markov "target": the next-token logits depend on the current token only.
MARKOV_LOGITS = torch.tensor([[1.0, 0.2, -0.5], [-0.3, 0.8, 0.4], [0.5, -1.0, 0.9]])
# Draft tree below the root, with equal sibling tokens (nodes 1 and 2 both carry token 0):
#   0 ─ 1(0) ─ 4(1)
#     ├ 2(0) ─ 5(2)
#     └ 3(2) ─ 6(2) ─ 7(0)
PARENTS = [-1, 0, 0, 0, 1, 2, 3, 6]
CHILD_TOKENS = [0, 0, 2, 1, 2, 2, 0]


def _tree(last_token):
    tokens = [last_token] + CHILD_TOKENS
    return tokens, MARKOV_LOGITS[torch.tensor(tokens)]


def test_greedy_walks_argmax_and_returns_bonus():
    tokens, logits = _tree(1)  # argmax after 1 is 1: no child carries 1 at the root
    acc = verify_greedy(tokens, PARENTS, logits)
    assert acc.path == [0] and acc.bonus_token == 1 and acc.new_tokens == [1]
    tokens, logits = _tree(2)  # after 2 → 2 (node 3), after 2 → 2 (node 6), after 2 → 2: bonus
    acc = verify_greedy(tokens, PARENTS, logits)
    assert acc.path == [0, 3, 6] and acc.bonus_token == 2 and acc.new_tokens == [2, 2, 2]
    assert acc.accepted == 2


def test_bad_shapes_are_refused():
    tokens, logits = _tree(0)
    with pytest.raises(SpecFitInputError, match="logits"):
        verify_greedy(tokens, PARENTS, logits[:3])
    with pytest.raises(SpecFitInputError, match="parents"):
        verify_greedy(tokens, [-1, 0, 5, 0, 1, 2, 3, 6], logits)
    with pytest.raises(SpecFitInputError, match="temperature"):
        verify_sampling(tokens, PARENTS, logits, temperature=0.0)
    with pytest.raises(SpecFitInputError, match="top_p"):
        target_probs(logits, 1.0, top_p=1.5)


def _exact_law(length, temperature, top_p, start=0):
    p = target_probs(MARKOV_LOGITS, temperature, top_p)
    law = {}
    for seq in itertools.product(range(V), repeat=length):
        prob, prev = 1.0, start
        for y in seq:
            prob *= float(p[prev, y])
            prev = y
        law[seq] = prob
    return law


def _empirical_law(verifier, length, draws, start=0, **kw):
    gen = torch.Generator().manual_seed(1234)
    counts = {}
    for _ in range(draws):
        out, last = [], start
        while len(out) < length:
            tokens, logits = _tree(last)
            acc = verifier(tokens, PARENTS, logits, generator=gen, **kw)
            out += acc.new_tokens
            last = out[-1]
        key = tuple(out[:length])
        counts[key] = counts.get(key, 0) + 1
    return {k: c / draws for k, c in counts.items()}


def _tv(p, q):
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 1.0), (1.0, 0.8)])
def test_sampling_verifier_matches_the_target_law(temperature, top_p):
    # 9 two-token outcomes, 4000 draws: a correct sampler's TV distance is ~0.02; a biased one's is far larger
    law = _exact_law(2, temperature, top_p)
    emp = _empirical_law(verify_sampling, 2, 4000, temperature=temperature, top_p=top_p)
    assert _tv(emp, law) < 0.045


def test_the_statistical_check_catches_a_biased_verifier():
    def accept_first_child(tokens, parents, logits, *, generator, temperature):
        # wrong: always accepts the first child, as a verifier ignoring the target would
        acc = verify_sampling(tokens, parents, logits, temperature=temperature, generator=generator)
        kids = [v for v in range(1, len(parents)) if parents[v] == 0]
        return type(acc)([0, kids[0]], acc.bonus_token, [tokens[kids[0]], acc.bonus_token])

    law = _exact_law(2, 1.0, 1.0)
    emp = _empirical_law(accept_first_child, 2, 2000, temperature=1.0)
    assert _tv(emp, law) > 0.1


def test_sampling_settings_accept_greedily_or_by_a_seeded_sample():
    from specfit.engine.verify import Sampling

    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    tokens, parents = [5, int(logits[0].argmax()), 7], [-1, 0, 0]
    assert Sampling().accept(tokens, parents, logits) == verify_greedy(tokens, parents, logits)
    a, b = Sampling(0.8, 0.9, seed=3), Sampling(0.8, 0.9, seed=3)
    draws = [a.accept(tokens, parents, logits) for _ in range(5)]
    assert draws == [b.accept(tokens, parents, logits) for _ in range(5)]  # one generator, seeded
    assert len({d.bonus_token for d in draws + [Sampling(0.8, 0.9, seed=s).accept(tokens, parents, logits)
                                               for s in range(20)]}) > 1
    with pytest.raises(SpecFitInputError, match="temperature: must be >= 0"):
        Sampling(-0.1)
