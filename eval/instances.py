"""Synthetic selection instances: EAGLE-like draft trees with predicted experts and an expert cache.

The draft tree grows level by level as in EAGLE-2 (Li et al. 2024, §4.1-4.2): each of the ``branch``
most probable nodes of the last level is expanded into its ``branch`` most probable children, whose
draft probabilities q are the largest entries of a Dirichlet(alpha) sample over ``vocab`` tokens;
all children join a pool, and the instance keeps the ``n`` pool nodes of highest path probability
(ties shallow-first), which form an ancestor-closed tree.

Predicted experts follow a skewed, partly inherited routing model: expert popularity in each layer
is Zipf with exponent ``skew`` over a random permutation of the experts; a node draws its top-k
experts per layer without replacement from that popularity (Gumbel top-k), except that each of
its k slots keeps the parent's expert with probability ``sharing`` (consecutive tokens of MoE
models reuse experts; siblings share through their parent). The cache holds, per layer, a
``cache_fraction`` of the experts: the most popular ones or a random set.

These are modelling assumptions, not measured routing; the evaluation measures real routing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from specfit.core.cost import get_host_profile, get_profile
from specfit.core.errors import (MAX_EXPERTS, MAX_LAYERS, SpecFitInputError, check_int,
                                 check_number, check_seed, lookup)
from specfit.core.instance import Instance
from specfit.core.tree import DraftTree


@dataclass(frozen=True)
class InstanceSpec:
    """Options of the instance generator.

    Parameters
    ----------
    layers, experts, top_k : int
        MoE layers L, experts per layer, experts per token per layer (k).
    skew : float
        Zipf exponent of expert popularity (0 = uniform routing).
    sharing : float
        Probability in [0, 1] that a node's expert slot repeats its parent's expert.
    cache_fraction : float
        Share of each layer's experts resident in the expert cache, in [0, 1].
    cache_policy : str
        ``"popular"`` (the most popular experts) or ``"random"``.
    branch : int
        EAGLE's top_k: children per expanded node and nodes expanded per level.
    alpha : float
        Dirichlet concentration of the draft distribution (smaller = more peaked q). The default
        0.03 over 32 tokens gives a mean top-1 q of about 0.64, so a 2-token chain commits
        1 + 0.64 + 0.64² ≈ 2.05 tokens, the τ ≈ 2.0-2.1 reported for the public EAGLE-3 heads of
        Qwen3-30B-A3B (SPECFIT.md §5).
    vocab : int
        Support size of the Dirichlet draft distribution.
    profile : str
        Cost profile name in :data:`specfit.core.cost.PROFILES`.
    host_profile : str, optional
        A host-regime profile of :data:`specfit.core.cost.HOST_PROFILES`: the instances' cost is
        then that profile scaled to ``layers`` (SPECFIT.md §3, "Host-compute regime") instead of
        ``profile``.
    max_nodes, max_new_experts_per_layer : int or None
        Budgets written into every instance.

    Raises
    ------
    SpecFitInputError
        If an option is out of range (the field names the option).
    """

    layers: int = 4
    experts: int = 16
    top_k: int = 2
    skew: float = 1.0
    sharing: float = 0.5
    cache_fraction: float = 0.25
    cache_policy: str = "popular"
    branch: int = 4
    alpha: float = 0.03
    vocab: int = 32
    profile: str = "qwen3-30b-a3b-pcie4"
    host_profile: str | None = None
    max_nodes: int | None = None
    max_new_experts_per_layer: int | None = None

    def __post_init__(self):
        for name, high in (("layers", MAX_LAYERS), ("experts", MAX_EXPERTS), ("top_k", MAX_EXPERTS), ("branch", None),
                           ("vocab", None)):
            check_int(name, getattr(self, name), 1, high)
        if self.top_k > self.experts:
            raise SpecFitInputError("top_k", f"must be <= experts ({self.experts}), got {self.top_k}")
        if self.branch > self.vocab:
            raise SpecFitInputError("branch", f"must be <= vocab ({self.vocab}), got {self.branch}")
        for name in ("sharing", "cache_fraction"):
            object.__setattr__(self, name, check_number(name, getattr(self, name), 0.0, 1.0))
        object.__setattr__(self, "skew", check_number("skew", self.skew, 0.0))
        object.__setattr__(self, "alpha", check_number("alpha", self.alpha, 0.0, low_open=True))
        for name in ("max_nodes", "max_new_experts_per_layer"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1 if name == "max_nodes" else 0)
        if self.cache_policy not in ("popular", "random"):
            raise SpecFitInputError("cache_policy", f"must be 'popular' or 'random', got {self.cache_policy!r}")
        get_profile(self.profile)
        if self.host_profile is not None:
            get_host_profile(self.host_profile)


#: Named generator settings. ``qwen3-30b-a3b``: Qwen3-30B-A3B routing shape (48 MoE layers, 128
#: experts, top-8; SPECFIT.md §5), the PCIe Gen4 cost profile, a quarter of each layer cached, and
#: EAGLE's top_k = 4 of the Qwen3 EAGLE-3 scripts.
PRESETS: dict[str, InstanceSpec] = {
    "small": InstanceSpec(),
    "qwen3-30b-a3b": InstanceSpec(layers=48, experts=128, top_k=8, cache_fraction=0.25, branch=4,
                                  profile="qwen3-30b-a3b-pcie4"),
}


def get_preset(name: str) -> InstanceSpec:
    """The generator settings named ``name`` (see :data:`PRESETS`).

    Raises
    ------
    SpecFitInputError
        If the preset is unknown.
    """
    return lookup(PRESETS, name, "preset")


def draft_tree_shape(n: int, spec: InstanceSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Grow an EAGLE-like pool level by level and keep its ``n`` most probable nodes.

    The pool grows until it holds at least ``2 n`` nodes, so the kept tree is the EAGLE-2
    reranking of a deeper drafted tree (Li et al. 2024, §4.2).

    Parameters
    ----------
    n : int
        Nodes to keep, root included.
    spec : InstanceSpec
        Uses ``branch``, ``alpha`` and ``vocab``.
    rng : numpy.random.Generator

    Returns
    -------
    parents : numpy.ndarray of int64, shape (n,)
        In BFS order (depth, then decreasing path probability), ``parents[0] = -1``.
    path_prob : numpy.ndarray of float64, shape (n,)

    Raises
    ------
    SpecFitInputError
        If ``n < 1``.
    """
    if n < 1:
        raise SpecFitInputError("n", f"must be >= 1, got {n}")
    par, prob, depth = [-1], [1.0], [0]
    beam = [0]
    while len(par) < 2 * n:
        level = []
        for b in beam:
            q = np.sort(rng.dirichlet(np.full(spec.vocab, spec.alpha)))[::-1][: spec.branch]
            for qi in q:
                par.append(b)
                prob.append(prob[b] * float(qi))
                depth.append(depth[b] + 1)
                level.append(len(par) - 1)
        beam = sorted(level, key=lambda v: -prob[v])[: spec.branch]
    keep = sorted(range(len(par)), key=lambda v: (-prob[v], depth[v], v))[:n]
    keep.sort(key=lambda v: (depth[v], -prob[v], v))
    new_id = {old: i for i, old in enumerate(keep)}
    parents = np.array([-1] + [new_id[par[v]] for v in keep[1:]], dtype=np.int64)
    return parents, np.array([prob[v] for v in keep])


def predicted_experts(parents: np.ndarray, spec: InstanceSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draw each node's top-k experts per layer (skewed popularity, inherited with ``sharing``).

    Parameters
    ----------
    parents : numpy.ndarray of int64, shape (n,)
        Parents before children.
    spec : InstanceSpec
        Uses ``layers``, ``experts``, ``top_k``, ``skew`` and ``sharing``.
    rng : numpy.random.Generator

    Returns
    -------
    experts : numpy.ndarray of int64, shape (n, L, k)
    log_popularity : numpy.ndarray of float64, shape (L, E)
    """
    L, E, k = spec.layers, spec.experts, spec.top_k
    ranks = np.stack([rng.permutation(E) for _ in range(L)]) + 1.0
    logp = -spec.skew * np.log(ranks)
    n = parents.shape[0]
    out = np.zeros((n, L, k), dtype=np.int64)
    rows = np.arange(L)[:, None]
    for v in range(n):
        keys = logp + rng.gumbel(size=(L, E))
        if v:
            inherit = rng.random((L, k)) < spec.sharing
            parent = out[parents[v]]
            keys[np.broadcast_to(rows, (L, k))[inherit], parent[inherit]] = np.inf
        out[v] = np.argpartition(-keys, k - 1, axis=1)[:, :k]
    return out, logp


def generate_instance(n: int, spec: InstanceSpec, rng: np.random.Generator) -> Instance:
    """One synthetic instance with ``n`` draft-tree nodes (root included).

    Parameters
    ----------
    n : int
    spec : InstanceSpec
    rng : numpy.random.Generator

    Returns
    -------
    Instance
        Experts of shape (n, spec.layers, spec.top_k); cache of shape (layers, experts); cost from
        ``spec.profile`` (or ``spec.host_profile``); the spec's budgets.

    Raises
    ------
    SpecFitInputError
        If ``n < 1`` or the budgets cannot hold the root.
    """
    parents, prob = draft_tree_shape(n, spec, rng)
    experts, logp = predicted_experts(parents, spec, rng)
    size = int(round(spec.cache_fraction * spec.experts))
    cache = np.zeros((spec.layers, spec.experts), dtype=bool)
    for l in range(spec.layers):
        ids = np.argsort(-logp[l])[:size] if spec.cache_policy == "popular" else rng.choice(spec.experts, size, replace=False)
        cache[l, ids] = True
    tree = DraftTree(parents, path_prob=prob, experts=experts, num_experts=spec.experts)
    cost = get_profile(spec.profile) if spec.host_profile is None else get_host_profile(spec.host_profile).for_layers(spec.layers)
    return Instance(tree, cost, cache, spec.max_nodes, spec.max_new_experts_per_layer)


def generate_instances(spec: InstanceSpec, sizes, count: int, seed: int = 0) -> Iterator[tuple[int, int, Instance]]:
    """Yield ``(n, index, instance)`` for ``count`` instances of each size in ``sizes``.

    Instance ``(n, index)`` is drawn from ``numpy.random.default_rng((seed, n, index))``, so it is
    the same whatever other sizes or counts are asked for.

    Raises
    ------
    SpecFitInputError
        If ``seed`` is not an integer in [0, 2**63) (at the first instance: this is a generator).
    """
    check_seed("seed", seed)
    for n in sizes:
        for i in range(count):
            yield n, i, generate_instance(int(n), spec, np.random.default_rng((seed, int(n), i)))


def with_options(spec: InstanceSpec, **options) -> InstanceSpec:
    """``spec`` with the options that are not None replaced (re-validated)."""
    return replace(spec, **{k: v for k, v in options.items() if v is not None})
