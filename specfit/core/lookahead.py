"""Predicted near-future expert demand: the draft tree as a lookahead for the expert cache.

A draft tree predicts the next tokens, and the expert predictor predicts their experts. Weighting each
node's predicted experts by the node's path probability gives, per MoE layer, how much each expert is
expected to be used by the tokens about to be committed. A lookahead eviction policy
(:class:`specfit.models.experts.Lookahead`) evicts the resident expert with the least such demand, so
the experts the next tokens are predicted to need stay resident.

Speculation used as a lookahead for expert prefetch and eviction: MoE-SpAc (arXiv 2603.09983) and
SP-MoE (draft-predicted expert prefetch). The weighting by path probability is the expectation of
SPECFIT.md §3 (``Pr[v accepted] = P_v``, the calibrated ``P̂_v`` where the engine has it).

Pure numpy; no torch.
"""

from __future__ import annotations

import numpy as np

from specfit.core.errors import SpecFitInputError, as_int_array, check_positive_int
from specfit.core.tree import DraftTree, check_experts, check_probabilities


def expert_demand(weights, experts, num_experts: int) -> np.ndarray:
    """Expected uses of each expert by a set of predicted future tokens, per MoE layer.

    ``demand[l, e] = Σ_v w_v · [e ∈ E[v][l]]``: with ``w_v`` the probability that node v is committed
    (its path probability ``P_v``, calibrated when available), ``demand[l, e]`` is, by linearity of
    expectation, the expected number of the nodes' tokens that will be routed to expert e in layer l.

    Parameters
    ----------
    weights : array_like of float, shape (n,)
        Weight of each node, in [0, 1]: a path probability (a draft node), or 1 for a token known to
        come (the true next tokens of a trace).
    experts : array_like of int, shape (n, L, k)
        Predicted (or true) experts of each node per MoE layer, ids in ``[0, num_experts)``, distinct
        within a (node, layer) row (a repeated id would count twice).
    num_experts : int
        Experts per MoE layer E.

    Returns
    -------
    numpy.ndarray of float64, shape (L, E)
        Expected uses (a count of tokens, not a probability: it may exceed 1). All zero when n = 0.

    Raises
    ------
    SpecFitInputError
        Naming ``weights`` (not n numbers in [0, 1]), ``experts`` (not (n, L, k) integers, an id out of
        range) or ``num_experts`` (not a positive integer).
    """
    E = check_positive_int("num_experts", num_experts)
    exp = as_int_array(experts, "experts", 3, copy=False)
    exp = check_experts(exp, exp.shape[0], E, copy=False)
    n, L, k = exp.shape
    w = check_probabilities(weights, "weights", n)
    flat = (exp + (np.arange(L, dtype=np.int64) * E)[None, :, None]).ravel()
    out = np.bincount(flat, weights=np.repeat(w, L * k), minlength=L * E)
    return out.reshape(L, E).astype(np.float64, copy=False)  # bincount of nothing is int64


def tree_expert_demand(tree: DraftTree, path_prob=None, *, include_root: bool = False, exclude=None) -> np.ndarray:
    """:func:`expert_demand` of a draft tree's nodes, weighted by their path probabilities.

    Parameters
    ----------
    tree : DraftTree
        A tree with predicted experts (``tree.experts`` of shape (n, L, k)).
    path_prob : array_like of float, shape (n,), optional
        The weights to use instead of ``tree.path_prob``: the calibrated ``P̂`` of the engine's
        acceptance calibrator (:mod:`specfit.core.acceptance`), which predicts acceptance where the
        drafter's raw P does not.
    include_root : bool
        Count the root (node 0, weight 1). Default False: the root is the token the current forward
        computes, so its experts are in use (never evicted) during that forward, and the demand is meant
        for the tokens after it.
    exclude : iterable of int, optional
        Node ids not counted: the nodes the current forward verifies (their experts are in use during it;
        what comes after it are the other nodes' tokens).

    Returns
    -------
    numpy.ndarray of float64, shape (L, E)
        Expected uses of each expert by the tree's (non-root) nodes, per MoE layer.

    Raises
    ------
    SpecFitInputError
        If the tree has no experts (field ``experts``), ``path_prob`` is not n numbers in [0, 1]
        (field ``path_prob``), or ``exclude`` holds an id outside [0, n) (field ``exclude``).
    """
    if tree.experts is None or tree.num_experts is None:
        raise SpecFitInputError("experts", "the draft tree has no predicted experts")
    pp = tree.path_prob if path_prob is None else check_probabilities(path_prob, "path_prob", tree.n)
    counted = np.ones(tree.n, dtype=bool)
    counted[0] = include_root
    if exclude is not None:
        ids = as_int_array(list(exclude), "exclude", 1)
        if ids.size and (ids.min() < 0 or ids.max() >= tree.n):
            raise SpecFitInputError("exclude", f"node ids must lie in [0, {tree.n})")
        counted[ids] = False
    return expert_demand(pp[counted], tree.experts[counted], tree.num_experts)
