"""Verifiers: accept a root path of the verified draft tree and draw the bonus token.

Both verifiers are lossless for *any* draft tree and *any* selection rule, because they never use
the draft probabilities: each committed token is exactly what the target alone would have produced
after the same prefix.

* :func:`verify_greedy` (temperature 0): walk from the root; at node u the target's next token is
  ``argmax logits[u]``; move to the child carrying that token, if any; otherwise that token is the
  bonus token. The committed text equals greedy autoregressive decoding token for token.
* :func:`verify_sampling` (temperature > 0): the same walk with the next token *sampled* from the
  target distribution at u (temperature, then top-p). This is the one-hot form of multi-candidate
  verification (each deterministic top-k candidate treated as a point mass, "recursive rejection
  sampling" with q = one-hot: accept candidate x with probability p(x), else renormalise p without x
  and try the next; drawing y ~ p and descending into the child with token y has exactly the same
  law). Equal sibling tokens are harmless: the first such child is taken and the others are never
  reached. Valid for deterministically drafted trees (EAGLE-2/3 top-k); q-ratio rejection sampling,
  which is valid only for candidates *sampled* from the draft, is deliberately not offered
  (PITFALLS.md, "Verification").

References: Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", ICML 2023,
§2.3 (lossless acceptance); Miao et al., "SpecInfer", ASPLOS 2024, §4 (multi-candidate tree
verification); Li et al., "EAGLE-2", EMNLP 2024, §4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specfit.core.errors import SpecFitInputError


@dataclass(frozen=True)
class Acceptance:
    """Result of verifying one draft tree.

    Attributes
    ----------
    path : list of int
        Accepted node ids, root first (``path[0] == 0``); the accepted draft tokens are the tokens of
        ``path[1:]``.
    bonus_token : int
        The token the target produces after the last accepted node.
    new_tokens : list of int
        Committed tokens this cycle: ``tokens[path[1:]] + [bonus_token]``; ``len(new_tokens)`` is this
        cycle's τ contribution (accepted draft tokens + 1).
    """

    path: list[int]
    bonus_token: int
    new_tokens: list[int]

    @property
    def accepted(self) -> int:
        """Accepted draft tokens (``len(path) - 1``)."""
        return len(self.path) - 1


def _children_by_token(tokens: Sequence[int], parents: Sequence[int]) -> list[dict[int, int]]:
    """``kids[u][token] = first child of u carrying token`` (equal sibling tokens: first wins)."""
    if len(tokens) != len(parents) or not len(parents) or parents[0] != -1:
        raise SpecFitInputError("parents", "must have one entry per token with parents[0] == -1")
    kids: list[dict[int, int]] = [dict() for _ in parents]
    for v in range(1, len(parents)):
        p = int(parents[v])
        if not 0 <= p < v:
            raise SpecFitInputError(f"parents[{v}]", f"must be in [0, {v}), got {p}")
        kids[p].setdefault(int(tokens[v]), v)
    return kids


def _walk(tokens, parents, next_token) -> Acceptance:
    kids = _children_by_token(tokens, parents)
    path = [0]
    while True:
        y = next_token(path[-1])
        child = kids[path[-1]].get(y)
        if child is None:
            return Acceptance(path, y, [int(tokens[v]) for v in path[1:]] + [y])
        path.append(child)


def verify_greedy(tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> Acceptance:
    """Greedy verification of a draft tree.

    Parameters
    ----------
    tokens : sequence of int, shape (n,)
        Token of each verified node; node 0 is the root (the last committed token).
    parents : sequence of int, shape (n,)
        ``parents[0] = -1``, ``parents[v] < v``.
    logits : torch.Tensor, shape (n, V)
        Target logits at each node (predicting the token after it).

    Returns
    -------
    Acceptance

    Raises
    ------
    SpecFitInputError
        If shapes disagree or ``parents`` is not a tree in topological order.
    """
    if logits.ndim != 2 or logits.shape[0] != len(tokens):
        raise SpecFitInputError("logits", f"must have shape (n={len(tokens)}, V), got {tuple(logits.shape)}")
    argmax = logits.argmax(dim=-1).tolist()
    return _walk(tokens, parents, lambda u: argmax[u])


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution from logits: softmax(logits / temperature), then nucleus (top-p)
    truncation and renormalisation (Holtzman et al., ICLR 2020, §3.1).

    Parameters
    ----------
    logits : torch.Tensor, shape (..., V)
    temperature : float, > 0
    top_p : float, in (0, 1]

    Returns
    -------
    torch.Tensor, shape (..., V), float32, rows summing to 1.

    Raises
    ------
    SpecFitInputError
        If ``temperature <= 0`` or ``top_p`` is outside (0, 1].
    """
    if not temperature > 0:
        raise SpecFitInputError("temperature", f"must be > 0 for sampling (use greedy for 0), got {temperature}")
    if not 0 < top_p <= 1:
        raise SpecFitInputError("top_p", f"must lie in (0, 1], got {top_p}")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
        sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def verify_sampling(tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor, *, temperature: float,
                    top_p: float = 1.0, generator: torch.Generator | None = None) -> Acceptance:
    """Lossless sampling verification of a deterministically drafted tree (one-hot multi-candidate).

    Parameters
    ----------
    tokens, parents, logits
        As in :func:`verify_greedy`.
    temperature : float, > 0
    top_p : float, in (0, 1]
    generator : torch.Generator, optional
        Source of randomness (seed it for reproducible runs); on the logits' device type.

    Returns
    -------
    Acceptance
        The bonus token after a fully accepted path is drawn from the last node's target
        distribution.

    Raises
    ------
    SpecFitInputError
        On bad shapes, temperature or top_p, or a generator on another device type than the logits.
    """
    if logits.ndim != 2 or logits.shape[0] != len(tokens):
        raise SpecFitInputError("logits", f"must have shape (n={len(tokens)}, V), got {tuple(logits.shape)}")
    if generator is not None and generator.device.type != logits.device.type:
        raise SpecFitInputError("generator", f"is on {generator.device} but the logits are on {logits.device}; "
                                "create it with torch.Generator(device=logits.device)")
    probs = target_probs(logits, temperature, top_p)
    return _walk(tokens, parents, lambda u: int(torch.multinomial(probs[u], 1, generator=generator)))


class Sampling:
    """How a verify accepts: greedy at ``temperature`` 0 (:func:`verify_greedy`), else lossless
    sampling (:func:`verify_sampling`) at ``temperature`` and ``top_p`` from a generator seeded with
    ``seed``, made on the CPU and moved to the logits' device at the first sampled verify.

    Raises
    ------
    SpecFitInputError
        If ``temperature`` < 0.
    """

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        if temperature < 0:
            raise SpecFitInputError("temperature", f"must be >= 0, got {temperature}")
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.generator = torch.Generator().manual_seed(seed)

    def accept(self, tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> Acceptance:
        """The verify's :class:`Acceptance` of the tree ``tokens``, ``parents`` (n,) from the target's
        ``logits`` (n, V)."""
        if self.temperature > 0:
            if self.generator.device != logits.device:  # torch.multinomial needs both on one device
                self.generator = torch.Generator(device=logits.device).manual_seed(self.seed)
            return verify_sampling(tokens, parents, logits, temperature=self.temperature, top_p=self.top_p,
                                   generator=self.generator)
        return verify_greedy(tokens, parents, logits)
