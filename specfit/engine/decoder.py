"""The SpecFit decoding cycle; every method of SPECFIT.md §6 is a configuration of it.

One cycle (ARCHITECTURE.md, "the one way through"):

    draft one level → stop? (from P and the cost) → predict the kept nodes' experts → select
    → verify the selected subtree in one target forward → accept a root path + bonus token
    → compact the target KV, commit to the drafter → cycle record

The root of every cycle is the last committed token, whose KV is not yet in the target (the
previous cycle's bonus token). A method that drafts nothing (``ar``) verifies the root alone, which
is a plain autoregressive step through the same code.

The engine talks to three duck-typed parts:

* target — :class:`specfit.models.qwen3_moe.OffloadedQwen3Moe` or anything with ``prefill(ids)``,
  ``verify(tokens, parents)`` (both returning ``logits`` (n, V), ``routing`` (n, L, k),
  ``aux_hidden`` (n, 3H)), ``commit(path)``, ``reset()``, ``cache.cached_experts()`` (or
  ``cache.resident_mask()``, the same as an (L, E) bool array, read instead where present),
  ``cache.stats()``, ``spec.num_experts`` and ``spec.top_k`` (a cache whose ``slots`` equal the expert
  count keeps every expert resident: its mask is built from ``cache.num_layers`` without listing them;
  a cache with ``slots``, ``policy`` (``"lru"``/``"lfu"`` or an object with that ``name``) and
  ``recency()`` (:meth:`specfit.models.experts.DeviceExpertCache.recency`) gets the AR gate's twin,
  :mod:`specfit.engine.twin`);
* drafter — :class:`specfit.models.eagle3.Eagle3Drafter` or anything with ``prefill(tokens, aux)``,
  ``commit(tokens, aux)`` and ``draft_levels(root_token, top_k, max_depth)`` yielding levels with
  ``parents``, ``tokens``, ``path_prob``, ``hidden``;
* predictor — :mod:`specfit.models.predictors` (``reset``, ``observe``, ``predict``; ``uses_hidden = False``
  spares it the head's hidden states).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

import numpy as np
import torch

from specfit.core.acceptance import greedy_trials, verify_trials
from specfit.core.cost import CostModel, HostProfile, calibrate
from specfit.core.errors import SpecFitInputError, check_context, check_positive_int, check_single_sequence, lookup
from specfit.core.tree import DraftTree, check_experts
from specfit.engine.online import OnlineModel
from specfit.engine.twin import ARTwinCache
from specfit.engine.verify import verify_greedy, verify_sampling
from specfit.solvers import get_solver
from specfit.solvers.base import solver_class
from specfit.solvers.stop import _ratio_upper_bound, draft_can_beat_ar, selectable_threshold, stop_node_ms


@dataclass(frozen=True)
class Method:
    """A decoding method as a configuration of the engine (SPECFIT.md §6).

    Attributes
    ----------
    name : str
    drafts : bool
        Whether a draft tree is grown (False: plain AR decoding).
    selector : str or None
        Registered solver that picks the verified subtree (``eagle``, ``scan``, ``exact``).
    level_by_level : bool
        Select after every draft level and stop drafting by the stop rule (SpecFit).
    oracle : bool
        Feed the selector the target's true routing instead of predicted experts.
    uses_cache : bool
        False for ``eagle3-vanilla``: the target must run with ``cache_slots=0``.
    calibrated : bool
        Select, stop and gate with calibrated acceptance learned online from verify outcomes
        (:mod:`specfit.core.acceptance`), charge the draft levels of the cycle (whole-cycle
        objective) and take the AR step when no draft can beat it (SPECFIT.md §3).

    The properties below say what a method needs; callers test them, never method names.
    """

    name: str
    drafts: bool
    selector: str | None
    level_by_level: bool = False
    oracle: bool = False
    uses_cache: bool = True
    calibrated: bool = False

    @property
    def cost_aware(self) -> bool:
        """True iff the selector prices the experts a subtree needs (``Solver.cost_aware``), so the
        engine needs a cost model and the draft nodes' experts."""
        return self.selector is not None and solver_class(self.selector).cost_aware

    @property
    def needs_experts(self) -> bool:
        """True iff the draft tree carries experts per node (predicted, or the true routing for the oracle)."""
        return self.drafts and self.cost_aware

    @property
    def needs_predictor(self) -> bool:
        """True iff the method predicts the draft nodes' experts with an expert predictor."""
        return self.needs_experts and not self.oracle

    @property
    def needs_reference(self) -> bool:
        """True iff the method needs a reference target for the true routing (the oracle)."""
        return self.oracle


METHODS: dict[str, Method] = {
    "ar": Method("ar", drafts=False, selector=None),
    "eagle3-vanilla": Method("eagle3-vanilla", drafts=True, selector="eagle", uses_cache=False),
    "eagle3": Method("eagle3", drafts=True, selector="eagle"),
    "eagle3-scan": Method("eagle3-scan", drafts=True, selector="scan"),
    "specfit": Method("specfit", drafts=True, selector="exact", level_by_level=True, calibrated=True),
    "oracle": Method("oracle", drafts=True, selector="exact", level_by_level=True, oracle=True, calibrated=True),
}


def get_method(name: str) -> Method:
    """The method called ``name``.

    Raises
    ------
    SpecFitInputError
        If the name is unknown.
    """
    return lookup(METHODS, name, "method")


@dataclass(frozen=True)
class TreeSettings:
    """Draft-tree settings (EAGLE's names): ``total_tokens`` draft nodes verified besides the root
    by the fixed-tree methods, ``depth`` draft levels at most, ``top_k`` children per expanded node
    and nodes expanded per level. Defaults: the Qwen3 EAGLE-3 scripts' 32 / 6 / 4 (SPECFIT.md §5,
    depth 6 as the proxy's issue asks)."""

    total_tokens: int = 32
    depth: int = 6
    top_k: int = 4

    def __post_init__(self):
        for name in ("total_tokens", "depth", "top_k"):
            check_positive_int(name, getattr(self, name))

    def level_width(self, depth: int) -> int:
        """Most nodes the drafter adds at ``depth`` >= 1: ``top_k`` children of the root, then ``top_k``
        children of each of the ``top_k`` nodes expanded per level (EAGLE-2 dynamic tree, Li et al. 2024 §4)."""
        return self.top_k ** min(depth, 2)


def _verify_inputs(tree: DraftTree, keep: list) -> tuple[list, list]:
    """Tokens and parents (renumbered, root ``-1``) of the verified subtree on ``keep``, a selection's
    nodes (sorted, root first, ancestor-closed: :class:`specfit.solvers.Selection`): what
    :meth:`DraftTree.subtree` gives, without building a tree."""
    k = np.asarray(keep, dtype=np.int64)
    new_of = np.empty(tree.n, dtype=np.int64)
    new_of[k] = np.arange(k.size)
    parents = new_of[tree.parents[k]]
    parents[0] = -1
    return tree.tokens[k].tolist(), parents.tolist()


@dataclass
class CycleRecord:
    """What one cycle did and cost.

    Counts: ``levels`` drafted, ``levels_ahead`` launched and not used (1 when a drafter that launches
    each level ahead, ``launches_ahead``, was stopped before the cycle's depth: that head forward is
    paid; 1, or 2 with ``launches_ahead``, when the AR gate's sound bound, asked behind the first level,
    took the AR step: ``levels`` is then 0), ``nodes_drafted`` by the head (root excluded), ``nodes_pruned`` of
    them in no optimal selection (:func:`specfit.solvers.stop.selectable`; never predicted nor
    priced), ``nodes_verified`` (root included), ``accepted`` draft tokens, ``committed`` tokens
    (accepted + bonus; τ of this cycle).
    Experts per MoE layer, lists of length L: ``predicted_new`` (uncached experts the selector
    predicted for the verified subtree), ``true_experts`` (distinct experts the verified nodes
    really routed to), ``transferred`` (experts the runtime copied host-to-device). Model terms:
    ``expected_tokens`` A(S) (with calibrated acceptance for calibrated methods), ``expected_tokens_raw``
    A(S) from the draft's raw path probabilities, ``predicted_ms`` T(S) (whole cycle for calibrated
    methods: it includes the draft levels' ``level_ms`` and the cycle's measured host ms,
    :meth:`SpecDecoder._level_ms`). ``decision``: ``"draft"``, or ``"ar"`` when
    the AR gate skipped drafting (SPECFIT.md §3, "The AR step as a candidate"), ``"explore"`` when it
    drafted only to measure drafting again. ``ar_step_ms``: the counterfactual AR step of this cycle,
    T(root alone) with the root's true experts against the cache at the cycle's start (ms; calibrated
    methods, else 0); ``speedup_estimate``: the gate's measured speedup of drafting over AR Ŝ when it
    decided (None before any; :mod:`specfit.engine.online`). ``ar_tokens_ms``: what plain AR decoding
    would have paid for this cycle's committed tokens, one step each with its own expert cache (the
    AR twin, :mod:`specfit.engine.twin`; calibrated methods in the transfer regime with a runtime
    cache, on the cycles the online model learns from, else 0). Measured wall-clock ms: ``draft_ms``,
    ``predict_ms`` (the expert predictor's calls), ``tree_ms`` (the rest of each level's host work:
    tree building, calibration, pruning), ``solve_ms``, ``verify_ms`` (whole target forward),
    ``transfer_ms`` (H2D part of it, from the expert cache's timer), ``compute_ms``
    (``verify_ms - transfer_ms``), ``accept_ms``. ``host_cpu_ms``: CPU ms of the engine's thread spent on the host side of the cycle (expert
    predictor, tree building, calibration, gate, solver; the head and target forwards excluded), by
    ``time.thread_time``: unlike wall-clock ms it does not grow with other processes' load.
    ``hidden_host_ms``: host CPU ms that the device hides: this cycle's host work before its first draft
    level is read (the root's prediction and cost, the AR gate's sound bound) while it computes that level
    (:meth:`SpecDecoder._hide_behind_first_level`, at most the profile's ``draft_level_ms``), each level's host work while
    it computes the next level (with a drafter that launches ahead, up to ``draft_level_ms`` per level:
    :meth:`SpecDecoder._hide_behind_levels`) and the last cycle's online
    learning and the earlier drafted cycles' acceptance learning (:meth:`OnlineModel.defer`) while it
    verifies this cycle (:meth:`SpecDecoder._learn_last_cycle`, at most the shortest verify); not in
    ``host_cpu_ms`` (what exceeds them is).
    ``shadow_levels``: for ``decision == "shadow"`` (an AR step that drafted and selected a tree in its
    shadow, :meth:`SpecDecoder._shadow_of`), the head forwards that tree took (its levels, and one launched
    ahead and not used); they run while the device copies the AR step's experts, so the modeled time
    charges only what exceeds the step's H2D ms (eval/modeled.py); ``levels`` and ``levels_ahead`` are 0.
    ``host``: in the host and auto offload modes (``offload="host"``/``"auto"``), per MoE layer the
    experts computed on the host (``"computed"``) and their (token, expert) rows (``"rows"``); empty
    in the transfer mode (in the auto mode ``transferred`` counts the experts it chose to copy).
    """

    levels: int = 0
    levels_ahead: int = 0
    shadow_levels: int = 0
    nodes_drafted: int = 0
    nodes_pruned: int = 0
    nodes_verified: int = 1
    accepted: int = 0
    committed: int = 0
    expected_tokens: float = 1.0
    expected_tokens_raw: float = 1.0
    predicted_ms: float = 0.0
    decision: str = "draft"
    ar_step_ms: float = 0.0
    speedup_estimate: float | None = None
    predicted_new: list = field(default_factory=list)
    true_experts: list = field(default_factory=list)
    transferred: list = field(default_factory=list)
    draft_ms: float = 0.0
    predict_ms: float = 0.0
    tree_ms: float = 0.0
    solve_ms: float = 0.0
    verify_ms: float = 0.0
    transfer_ms: float = 0.0
    compute_ms: float = 0.0
    accept_ms: float = 0.0
    host_cpu_ms: float = 0.0
    hidden_host_ms: float = 0.0
    ar_tokens_ms: float = 0.0
    host: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The record as a JSON object (field name → value)."""
        return asdict(self)


@dataclass
class _Drafted:
    """The whole tree the head drafted in one cycle, ids in drafting order (the root, then each level),
    and which of its nodes the priced :class:`DraftTree` holds (the others are in no optimal selection,
    :func:`specfit.solvers.stop.selectable`). Calibration learns from every drafted node.

    Attributes: ``n`` the nodes drafted (root included); ``parents``, ``tokens``, ``depth`` int64;
    ``raw`` the head's path probabilities; ``q`` its conditional ones, P_v / P_parent (1 for the root);
    ``cal`` the calibrated path probabilities P̂ (the product of calibrated conditionals); ``pp`` the
    objective's (for a calibrated method P̂ with the per-depth path correction,
    :meth:`~specfit.core.acceptance.AcceptanceCalibrator.path_prob`); ``tree_ids`` each node's id in the priced
    tree or -1; ``rank`` each node's sibling-rank class (:func:`specfit.core.acceptance.sibling_rank`:
    0 for its parent's most likely child; 0 for the root): buffers whose first ``n`` entries hold the
    nodes (one allocation per cycle, grown when a level overflows them); ``full_ids`` (tree size,) each
    priced node's drafted id.
    """

    parents: np.ndarray
    tokens: np.ndarray
    depth: np.ndarray
    raw: np.ndarray
    q: np.ndarray
    cal: np.ndarray
    pp: np.ndarray
    tree_ids: np.ndarray
    full_ids: np.ndarray
    rank: np.ndarray
    n: int = 1

    _BUFFERS = ("parents", "tokens", "depth", "raw", "q", "cal", "pp", "tree_ids", "rank")

    @classmethod
    def of_root(cls, root: int, capacity: int = 1) -> "_Drafted":
        """The root alone, with room for ``capacity`` drafted nodes (root included)."""
        c = max(int(capacity), 1)
        ints = [np.zeros(c, dtype=np.int64) for _ in range(5)]
        parents, tokens, depth, tree_ids, rank = ints
        parents[0], tokens[0] = -1, root
        return cls(parents, tokens, depth, np.ones(c), np.ones(c), np.ones(c), np.ones(c), tree_ids,
                   np.zeros(1, dtype=np.int64), rank)

    def _reserve(self, size: int) -> None:
        """Grow the buffers to hold at least ``size`` nodes (at least doubling them)."""
        if size > self.parents.size:
            for name in self._BUFFERS:
                buf = getattr(self, name)
                setattr(self, name, np.concatenate([buf, np.zeros(max(size, 2 * buf.size) - buf.size, dtype=buf.dtype)]))

    def add_calibrated(self, cal, parents: np.ndarray, tokens: np.ndarray, head_pp: np.ndarray, threshold: float,
                       first_tree_id: int, pp_sum: float):
        """Append one drafted level of a calibrated method, its calibrated probabilities and the nodes it
        keeps, in one compiled call (:func:`specfit.core.kernels.draft_level_kernel`; the numpy steps of
        :meth:`add_raw` with :meth:`~specfit.core.acceptance.AcceptanceCalibrator.level_probs`' values,
        bit for bit). Arguments and return value as :meth:`add_raw`'s; ``cal`` the
        :class:`~specfit.core.acceptance.AcceptanceCalibrator`."""
        from specfit.core.kernels import draft_level_kernel

        n, m = self.n, len(parents)
        self._reserve(n + m)
        ok, kept, kept_parents, kept_pp, pp_sum, p_f = draft_level_kernel()(
            *cal._kernel_tables(), self.parents, self.tokens, self.depth, self.raw, self.q, self.cal, self.pp,
            self.tree_ids, self.rank, n, parents, tokens, head_pp, threshold, first_tree_id, pp_sum)
        if not ok:
            raise SpecFitInputError("path_prob", "the drafter's path probabilities must lie in [0, 1]")
        self.full_ids = np.concatenate([self.full_ids, n + kept])
        self.n = n + m
        return kept, kept_parents, kept_pp, pp_sum, p_f

    def add_raw(self, parents: np.ndarray, tokens: np.ndarray, head_pp: np.ndarray, threshold: float,
                first_tree_id: int, pp_sum: float):
        """Append one drafted level (m,) whose path probabilities are the head's own (an uncalibrated method).

        ``parents``, ``tokens`` int64 (parents < n); ``head_pp`` the head's path probabilities, kept
        non-increasing along paths (EAGLE's float32 products can differ from the parent's by an ulp);
        a node is kept (priced) when its parent is and its path probability is >= ``threshold``
        (:func:`specfit.solvers.stop.selectable_threshold`, ``-inf`` to keep all). Returns ``(kept,
        kept_parents, kept_pp, pp_sum, p_f)``: the kept nodes' indices in the level, their parents' priced
        ids and path probabilities, ``pp_sum`` plus those added in order, and the largest of them (0 if none).

        Raises
        ------
        SpecFitInputError
            A head path probability that is NaN or negative (field ``path_prob``).
        """
        up = self.raw[parents]  # each <= 1 (the root's is 1), so raw <= 1
        raw = np.minimum(head_pp, up)
        if raw.size and not raw.min() >= 0.0:  # NaN fails it (np.minimum keeps NaN); the drafter's contract
            raise SpecFitInputError("path_prob", "the drafter's path probabilities must lie in [0, 1]")
        q = raw / np.maximum(up, 1e-300)  # conditional draft probabilities (raw <= up: 0 where up is 0)
        kept = ((self.tree_ids[parents] >= 0) & (raw >= threshold)).nonzero()[0]
        kept_parents, kept_pp = self.tree_ids[parents[kept]], raw[kept]
        kept_list = kept_pp.tolist()
        self.add(parents, tokens, self.depth[parents] + 1, raw, q, raw, raw, 0, kept, first_tree_id)
        return kept, kept_parents, kept_pp, sum(kept_list, pp_sum), max(kept_list, default=0.0)

    def add(self, parents: np.ndarray, tokens: np.ndarray, depth: np.ndarray, raw: np.ndarray, q: np.ndarray,
            cal: np.ndarray, pp: np.ndarray, rank, kept: np.ndarray, first_tree_id: int) -> None:
        """Append one drafted level (m,) (``depth``: its parents' depths + 1; ``rank``: (m,) or one int for
        every node); its nodes ``kept`` (increasing indices into the level) became priced nodes
        ``first_tree_id, first_tree_id + 1, ...`` in order."""
        n, m = self.n, len(parents)
        self._reserve(n + m)
        self.full_ids = np.concatenate([self.full_ids, n + kept])
        end = n + m
        self.depth[n:end] = depth
        self.parents[n:end], self.tokens[n:end], self.rank[n:end] = parents, tokens, rank
        self.raw[n:end], self.q[n:end], self.cal[n:end], self.pp[n:end] = raw, q, cal, pp
        self.tree_ids[n:end] = -1
        self.tree_ids[n + kept] = np.arange(first_tree_id, first_tree_id + kept.size)
        self.n = end


@dataclass
class _Shadow:
    """A shadow cycle waiting for its outcome (SPECFIT.md §3, "Drafting in the AR step's shadow"): the
    tree an AR step drafted and the subtree the exact selection chose, and what decoding committed
    after its root.

    Attributes: ``drafted`` the whole drafted tree (:class:`_Drafted`); ``selected`` the selection's
    nodes as drafted ids (root first); ``experts`` (|S|, L, k) their experts as the selection priced
    them (predicted; the oracle's true); ``cache`` (L, E) bool, the cache its accounting used;
    ``levels``, ``levels_ahead`` its head forwards; ``routing`` the committed forwards' routing from its
    root on ((L, k) each, the root's first), ``tokens`` the committed tokens after its root, ``ar_ms``
    each forward's ms in AR decoding's cache (the AR twin), filled one cycle late.
    """

    drafted: "_Drafted"
    selected: np.ndarray
    experts: np.ndarray
    cache: np.ndarray
    levels: int
    levels_ahead: int
    routing: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    ar_ms: list = field(default_factory=list)


def shadow_outcome(parents, tokens, continuation) -> tuple[list[int], int] | None:
    """The accepted path a verify of the whole draft tree would take, given the tokens decoding committed
    after its root.

    Greedy verification accepts the child carrying the target's next token; the sampling verifier
    (:func:`specfit.engine.verify.verify_sampling`, one-hot multi-candidate) accepts the child carrying
    the token it samples from the target's distribution there. Plain decoding of the same prefix commits
    that greedy token, or a token of that same distribution, so walking the tree along the committed
    continuation gives the outcome a verify would have (greedy: the same; sampling: the same in
    distribution). Equal sibling tokens: the first wins, as in the verifiers.

    Parameters
    ----------
    parents, tokens : sequence of int, shape (n,)
        The draft tree (``parents[0] = -1``, ``parents[v] < v``); node 0 is the root.
    continuation : sequence of int
        The tokens committed after the root, in order.

    Returns
    -------
    (path, bonus) or None
        ``path`` the accepted node ids, root first, and ``bonus`` the committed token after its last node;
        None while ``continuation`` ends before the walk does (the outcome is not known yet).
    """
    kids: list[dict] = [dict() for _ in range(len(parents))]
    for v in range(1, len(parents)):
        kids[int(parents[v])].setdefault(int(tokens[v]), v)
    path = [0]
    for y in continuation:
        child = kids[path[-1]].get(int(y))
        if child is None:
            return path, int(y)
        path.append(child)
    return None


@dataclass
class Generation:
    """Result of :meth:`SpecDecoder.generate`: ``output_ids`` (new tokens only, at most
    ``max_new_tokens``), one :class:`CycleRecord` per cycle, and the wall-clock seconds of the
    decode loop (prefill excluded: ``wall_s``; prefill: ``prefill_s``)."""

    output_ids: list[int]
    cycles: list[CycleRecord]
    wall_s: float
    prefill_s: float

    @property
    def tau(self) -> float:
        """Mean committed tokens per cycle (accepted draft tokens + 1 bonus), AR = 1."""
        return tau(self.cycles)

    def to_json(self) -> dict:
        """The generation as a JSON object: output ids, wall/prefill seconds and the cycle records."""
        return {"output_ids": self.output_ids, "wall_s": self.wall_s, "prefill_s": self.prefill_s,
                "cycles": [c.to_json() for c in self.cycles]}


def prompt_list(prompt_ids, field: str = "prompt_ids") -> list[int]:
    """Prompt ids as a list of int.

    Parameters
    ----------
    prompt_ids : sequence of int, nested list, numpy array or tensor, shape (T,) or (1, T)
        Batch size 1 only.
    field : str
        The input field named in errors.

    Returns
    -------
    list of int, length T (possibly 0; callers refuse an empty prompt)

    Raises
    ------
    SpecFitInputError
        On ``field``: not integer ids, or a batch of more than one sequence (``batch size 1 only``).
    """
    try:
        t = torch.as_tensor(prompt_ids)
    except (TypeError, ValueError, RuntimeError):
        raise SpecFitInputError(field, "must be integer token ids of shape (T,) or (1, T)") from None
    check_single_sequence(field, tuple(t.shape))
    if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise SpecFitInputError(field, f"must be integer token ids, got dtype {t.dtype}")
    return [int(x) for x in t.reshape(-1).tolist()]


def tau(cycles: Sequence[CycleRecord]) -> float:
    """Mean committed tokens per cycle τ (accepted draft tokens + 1 bonus token; AR = 1), 0 for no cycle.

    Spec-Bench's convention (docs/PITFALLS.md, "Measurement")."""
    return sum(c.committed for c in cycles) / len(cycles) if cycles else 0.0


#: Torch dtypes numpy takes as they are (bfloat16, for one, must be widened first).
_NUMPY_FLOATS = (torch.float32, torch.float64)


def _level_arrays(level) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A drafted level's parents and tokens (m,) int64 and the head's path probabilities (m,) float64 (a
    float32 widens exactly), contiguous numpy arrays: from the level's host copies when it has them
    (:meth:`specfit.models.eagle3.DraftLevel.host_arrays`, which waits for this level alone), else from its
    tensors."""
    if hasattr(level, "host_arrays"):
        parents, tokens, pp = level.host_arrays()
    else:
        pp = level.path_prob if level.path_prob.dtype in _NUMPY_FLOATS else level.path_prob.double()
        parents, tokens, pp = level.parents.cpu().numpy(), level.tokens.cpu().numpy(), pp.cpu().numpy()
    return (np.ascontiguousarray(parents, dtype=np.int64), np.ascontiguousarray(tokens, dtype=np.int64),
            np.ascontiguousarray(pp, dtype=np.float64))


def _root_only(root: int, experts: np.ndarray | None, num_experts: int) -> DraftTree:
    """The draft tree of the root alone (token ``root``, P = 1, ``experts`` (1, L, k) checked or None)."""
    return DraftTree._of_arrays(np.full(1, -1, dtype=np.int64), np.ones(1), np.full(1, root, dtype=np.int64),
                                experts, num_experts)


def _cache_mask(target, num_experts: int) -> np.ndarray:
    """The target's expert-cache residency, bool of shape (L, num_experts)."""
    if getattr(target.cache, "slots", None) == num_experts:  # a slot per expert: all resident, always
        return np.ones((target.cache.num_layers, num_experts), dtype=bool)
    if hasattr(target.cache, "resident_mask"):  # kept by the cache as it admits and evicts
        mask = target.cache.resident_mask()
        if mask.shape[1] == num_experts:
            return mask
    cached = target.cache.cached_experts()
    mask = np.zeros((len(cached), num_experts), dtype=bool)
    for layer, ids in enumerate(cached):
        mask[layer, ids] = True
    return mask


def _layer_counts(stats: dict, key: str) -> np.ndarray:
    return np.array([layer[key] for layer in stats["layers"]])


class SpecDecoder:
    """Speculative decoding on an offloaded MoE target with a chosen method.

    Parameters
    ----------
    target
        The offloaded target runtime (see the module docstring).
    drafter
        The draft model; may be None for ``ar``.
    method : Method or str
    tree : TreeSettings
    cost : CostModel or HostProfile
        Cost model used for selection (ms); for a model with fewer layers than the profile's
        target, pass ``profile.for_layers(L)``. In the host offload mode, a host-regime profile
        (:class:`specfit.core.cost.HostProfile`) scaled the same way.
    predictor
        Expert predictor (``specfit.models.predictors``); required by ``eagle3-scan`` and ``specfit``.
    reference
        For ``oracle``: a second target instance on the same weights whose KV mirrors ``target``;
        it computes the true routing of each drafted tree outside the timed path.
    temperature, top_p : float
        0 → greedy verification; > 0 → lossless sampling verification (:mod:`specfit.engine.verify`).
    seed : int
        Seed of the sampling verifier.
    rate_mode : bool
        Maximise A - λT with λ the running long-run rate (committed tokens over predicted ms of
        the cycles so far) instead of A/T (SPECFIT.md §3, "per-cycle ratio vs long-run rate").
    max_nodes : int, optional
        Verify-width budget passed to the selector.
    calibrate_every : int, optional
        Online cost model: every this many cycles (once at least ``L + 2`` have run), refit
        ``fixed_ms``, ``per_node_ms`` and ``per_expert_ms`` by NNLS (:func:`specfit.core.cost.calibrate`)
        from this decoder's measured cycles (nodes verified, experts transferred per layer, measured
        verify ms) and select with the fitted model; :attr:`calibration` holds the last fit.
    online : OnlineModel, optional
        Calibrated methods: what the engine has learned so far (calibrated acceptance, the
        predictor's priced error, the AR gate's measured utility; :mod:`specfit.engine.online`),
        shared by the decoders of one deployment so that each generation starts from it (default:
        a fresh one). Learning never changes what is verified to be correct: output stays lossless.
    shadows : bool
        Calibrated methods: let AR steps draft and select a tree they do not verify, learned from what
        decoding commits next, in place of the warm-up's and the explorations' drafted cycles until the
        shadows say drafting may pay (default True; used only where the gate has its AR twin;
        docs/SPECFIT.md §3, "Drafting in the AR step's shadow"). False: every learning cycle drafts.

    Raises
    ------
    SpecFitInputError
        If the method needs a drafter, predictor or reference that is missing, or the drafter's
        ``aux_layer_ids`` differ from the target's ``aux_layers`` (the head would read the wrong
        features), or ``calibrate_every`` is given with a host-regime profile.
    """

    def __init__(self, target, drafter=None, method: Method | str = "specfit", *, tree: TreeSettings = TreeSettings(),
                 cost: CostModel | None = None, predictor=None, reference=None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, rate_mode: bool = False, max_nodes: int | None = None,
                 calibrate_every: int | None = None, online: OnlineModel | None = None, shadows: bool = True):
        self.method = get_method(method) if isinstance(method, str) else method
        m = self.method
        if m.drafts and drafter is None:
            raise SpecFitInputError("drafter", f"method {m.name} drafts a tree and needs a drafter")
        if m.cost_aware and cost is None:
            raise SpecFitInputError("cost", f"method {m.name} selects under the cost model and needs one")
        if m.needs_predictor and predictor is None:
            raise SpecFitInputError("predictor", f"method {m.name} needs an expert predictor")
        if m.needs_reference and reference is None:
            raise SpecFitInputError("reference", "method oracle needs a reference target for the true routing")
        if temperature < 0:
            raise SpecFitInputError("temperature", f"must be >= 0, got {temperature}")
        head_aux, target_aux = getattr(drafter, "aux_layer_ids", None), getattr(target, "aux_layers", None)
        if m.drafts and head_aux is not None and target_aux is not None and tuple(head_aux) != tuple(target_aux):
            raise SpecFitInputError("aux_layers", f"the head reads target features after layers {tuple(head_aux)} "
                                    f"(its aux_layer_ids) but the target returns layers {tuple(target_aux)} (its "
                                    f"aux_layers); load the target with aux_layers={tuple(head_aux)}")
        self.target, self.drafter, self.tree, self.cost = target, drafter, tree, cost
        self.predictor, self.reference = predictor, reference
        self.temperature, self.top_p, self.rate_mode, self.max_nodes = temperature, top_p, rate_mode, max_nodes
        self.seed, self.shadows = seed, bool(shadows)
        self.generator = torch.Generator().manual_seed(seed)  # moved to the logits' device at first use
        self.solver = None
        if m.selector:  # a selector blind to the cost verifies a fixed-size tree: EAGLE's total_tokens
            options = {} if m.cost_aware else {"total_tokens": tree.total_tokens}
            if "time_limit_s" in inspect.signature(solver_class(m.selector)).parameters:
                options["time_limit_s"] = self.SOLVE_TIME_LIMIT_S
            self.solver = get_solver(m.selector, **options)
        self.num_experts = int(target.spec.num_experts)
        if m.drafts:  # a drafted tree's coverage accounting and the stop rule's bound run compiled: compiled, or
            from specfit.core.kernels import item_words_kernel, ratio_bound_kernel  # loaded from numba's cache, here,

            item_words_kernel()  # so that no cycle pays it
            ratio_bound_kernel()
        self._lam_tokens = 0.0
        self._lam_ms = 0.0
        if calibrate_every is not None:
            check_positive_int("calibrate_every", calibrate_every)
            if isinstance(cost, HostProfile):
                raise SpecFitInputError("calibrate_every", "fits a transfer-regime cost model (nodes, copied experts, "
                                        "verify ms); it is not available with a host-regime profile")
        self.calibrate_every = calibrate_every
        self.calibration = None
        self._measured: list[tuple[int, list[int], float]] = []
        #: What the engine learns online (calibrated methods only), and its calibrated acceptance.
        self.online = (online if online is not None else OnlineModel(tree.depth)) if m.calibrated else None
        self.acceptance = self.online.acceptance if self.online is not None else None
        self._root_new = None  # this cycle's predicted uncached root experts per layer (L,)
        self._predict_s = 0.0  # this cycle's wall seconds in the expert predictor (_predict)
        self._cache = self._root = None  # this cycle's cache mask, and its root tree with its cost model
        self._untimed_s = 0.0  # this cycle's CPU s of head and reference forwards (not host work)
        self._drafted = None  # this cycle's whole drafted tree (_Drafted)
        self._level_host_ms = 0.0  # this cycle's host CPU ms in its draft levels
        self._selected_depth = 0  # this cycle's deepest verified node (0: the root alone)
        self._unobserved: list = []  # committed (tokens, routing) the predictor has not observed yet (int64 arrays)
        self._calls = (None,)  # the predictor's calls (_predictor_calls), made on the first prediction
        self._after_verify = None  # the last cycle's _learn arguments, run during the next verify
        self._ar_next = None  # (Ŝ,) when the next cycle is an AR step decided ahead (OnlineModel.decide_ahead)
        self._twin = None  # the AR twin's cache (specfit.engine.twin), made at the first generation
        self._twin_key = None  # the runtime cache it replays: (id, slots, policy)
        self._twin_path = None  # the last cycle's committed forwards' routing (τ, L, k), not yet replayed
        self._shadows: list[_Shadow] = []  # shadow cycles drafted, their outcome not yet known (oldest first)
        self._shadow_base = False  # whether this generation's AR steps could carry shadows (_set_shadowing)

    #: Per solve, for selectors that take a time limit: only a branch and bound can be slow (the exact
    #: solver under budgets or in the host regime, where rare trees took seconds in the grid); past it the
    #: selector returns the best selection found so far (SPECFIT.md §3). A verify is 3-100 ms.
    SOLVE_TIME_LIMIT_S = 0.005

    # -- one generation ------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, eos_id: int | None = None) -> Generation:
        """Decode up to ``max_new_tokens`` new tokens after ``prompt_ids``.

        Parameters
        ----------
        prompt_ids : sequence of int or LongTensor
            (T,) or (1, T), T >= 1. Batch size 1 only: a (B, T) batch with B > 1 is refused.
        max_new_tokens : int, >= 1
        eos_id : int, optional
            Stop after this token is committed.

        Returns
        -------
        Generation

        Raises
        ------
        SpecFitInputError
            On an empty prompt, a batch of more than one sequence, non-integer ids, a
            non-positive ``max_new_tokens`` or one that runs past the target's
            ``spec.max_position_embeddings`` (when the target has one).
        """
        prompt = prompt_list(prompt_ids)
        if not prompt:
            raise SpecFitInputError("prompt_ids", "must contain at least one token")
        check_positive_int("max_new_tokens", max_new_tokens)
        context = getattr(getattr(self.target, "spec", None), "max_position_embeddings", None)
        if context is not None:
            check_context("max_new_tokens", len(prompt), max_new_tokens, context)
        self._lam_tokens = self._lam_ms = 0.0
        t0 = time.perf_counter()
        for t in (self.target, self.reference):
            if t is not None:
                t.reset()
        drafter_ready = False
        self._unobserved.clear()
        if len(prompt) > 1:
            out = self.target.prefill(torch.tensor(prompt[:-1]))
            if self.reference is not None:
                self.reference.prefill(torch.tensor(prompt[:-1]))
            if self.predictor is not None:
                self.predictor.reset()
                self.predictor.observe(np.asarray(prompt[:-1]), out.routing.numpy(), None)
            if self.drafter is not None:
                self.drafter.prefill(torch.tensor(prompt[:-1]), out.aux_hidden)
                drafter_ready = True
        elif self.predictor is not None:
            self.predictor.reset()
        self._sync_twin()
        self._shadows.clear()
        if self.online is not None:  # an AR step carries a shadow cycle only where the twin prices its tokens
            self._shadow_base = (self.shadows and self._twin is not None and self.drafter is not None
                                 and isinstance(self.cost, CostModel) and self.method.level_by_level)
            self._set_shadowing()
        t1 = time.perf_counter()
        root, new, cycles = prompt[-1], [], []
        while len(new) < max_new_tokens and not (eos_id is not None and eos_id in new):
            rec, committed, aux, path_tokens = self._cycle(root, drafter_ready)
            if self.drafter is not None:
                if drafter_ready:
                    self.drafter.commit(torch.tensor(path_tokens), aux)
                else:
                    self.drafter.prefill(torch.tensor(path_tokens), aux)
                    drafter_ready = True
            cycles.append(rec)
            self._recalibrate(rec)
            new += committed
            root = committed[-1]
        if self._after_verify is None:  # nothing reads the last cycle's AR twin ms; the next prefill syncs the twin
            self._twin_path = None
        if self.online is not None and (self.online.deferred or self._after_verify) and cycles:
            c0 = time.thread_time()  # left to hide them behind
            self.online.flush()
            self._learn_last_cycle()
            cycles[-1].host_cpu_ms += (time.thread_time() - c0) * 1e3
        if self._shadows:  # their continuation ends here: never resolved
            self.online.drop_shadows(len(self._shadows))
            self._shadows.clear()
        if eos_id is not None and eos_id in new:
            new = new[:new.index(eos_id) + 1]
        return Generation(new[:max_new_tokens], cycles, time.perf_counter() - t1, t1 - t0)

    def _recalibrate(self, rec: CycleRecord) -> None:
        if self.calibrate_every is None:
            return
        self._measured.append((rec.nodes_verified, rec.transferred, rec.verify_ms))
        if len(self._measured) >= len(rec.transferred) + 2 and len(self._measured) % self.calibrate_every == 0:
            nodes, misses, ms = zip(*self._measured)
            fit = calibrate(nodes, misses, ms, name="online")  # keep the profile's draft and host level costs
            self.calibration = replace(fit, cost=replace(fit.cost, draft_level_ms=self.cost.draft_level_ms,
                                                         host_level_ms=self.cost.host_level_ms))
            self.cost = self.calibration.cost

    def _cycle(self, root: int, drafter_ready: bool):
        m, rec = self.method, CycleRecord()
        stats0 = self.target.cache.stats()
        selection = None
        self._reference_verified = False  # oracle: did the reference already verify this cycle's tree?
        self._cache, self._root_new, self._root, self._untimed_s = None, None, None, 0.0
        self._predict_s = 0.0  # this cycle's wall seconds in the expert predictor (_predict)
        self._drafted, self._selected_depth = None, 0
        c0 = time.thread_time()
        ahead = self._ar_next is not None and drafter_ready  # an AR step decided in the last learning slot
        if ahead:
            rec.decision = "ar"  # (consumed, with its Ŝ then recorded, in the learning slot below)
        elif m.drafts and drafter_ready:
            tree, selection, items = self._draft_and_select(root, None, rec)
        shadow = None
        if rec.decision == "shadow" and selection is not None:  # an AR step; the tree is learned from later
            shadow, selection = self._shadow_of(tree, selection, items, rec), None
        # verify the selected subtree in one target forward (an AR step: the root alone); its tokens and
        # parents are host work the verify's launch waits for
        keep, sub_tokens, sub_parents = [0], [root], [-1]
        if selection is not None:
            keep = list(selection.nodes)
            sub_tokens, sub_parents = _verify_inputs(tree, keep)
        rec.host_cpu_ms += (time.thread_time() - c0 - self._untimed_s) * 1e3  # (+ the learning's unhidden part)
        rec.predict_ms = self._predict_s * 1e3
        shadow_host_ms = 0.0
        if shadow is not None:  # the shadow's host work runs while the device computes the AR step (below)
            shadow_host_ms, rec.host_cpu_ms, rec.hidden_host_ms = rec.host_cpu_ms + rec.hidden_host_ms, 0.0, 0.0
        drafted = self._drafted if selection is not None else None
        if selection is not None:
            rec.expected_tokens, rec.predicted_ms = selection.expected_tokens, selection.predicted_ms
            raw = drafted.raw[drafted.full_ids[keep[1:]]]  # the draft's own path probabilities
            rec.expected_tokens_raw = 1.0 + float(raw.sum())
            rec.predicted_new = items.new_per_layer(keep).tolist()
        learn_s = self._learn_last_cycle()  # while the device verifies (on a GPU the verify is launched first)
        if self.online is not None and self.online.deferred:  # in the same slot: earlier verifies' acceptance
            c0 = time.thread_time()
            self.online.flush()
            learn_s += time.thread_time() - c0
        if self.online is not None and selection is not None and tree.n > 1:  # in the same slot: the next gate's
            c0 = time.thread_time()  # inputs, from the tree and the cache its accounting used
            self._prepare_gate(tree, items.cache)
            learn_s += time.thread_time() - c0
        if rec.decision in ("ar", "shadow"):  # in the same slot after an AR step: the gate's next decision, its learning done
            c0 = time.thread_time()
            if ahead:  # this AR step, decided in the last slot: consumed now that it is launched
                rec.speedup_estimate = self._ar_next[0]
                self.online.take_ar_ahead()
            self.online.decide_ahead()  # an AR step next: the next cycle's start reads a flag, as ar's start does
            self._ar_next = (self.online.speedup,) if self.online.ahead == "ar" else None
            learn_s += time.thread_time() - c0
        t0 = time.perf_counter()
        out = self.target.verify(torch.tensor(sub_tokens), sub_parents)
        logits = out.logits
        rec.verify_ms = (time.perf_counter() - t0) * 1e3
        if learn_s:
            hidden = min(learn_s * 1e3, self._shortest_verify_ms())
            rec.host_cpu_ms += learn_s * 1e3 - hidden
            rec.hidden_host_ms += hidden
        t0 = time.perf_counter()
        if self.temperature > 0:
            if self.generator.device != logits.device:  # torch.multinomial needs both on one device
                self.generator = torch.Generator(device=logits.device).manual_seed(self.seed)
            acc = verify_sampling(sub_tokens, sub_parents, logits, temperature=self.temperature, top_p=self.top_p,
                                  generator=self.generator)
        else:
            acc = verify_greedy(sub_tokens, sub_parents, logits)
        self.target.commit(acc.path)
        if self.acceptance is not None and drafted is not None and drafted.n > 1:
            c0 = time.thread_time()  # host work of the cycle (host_cpu_ms), like the drafting's
            # in the whole drafted tree's ids (pruned nodes too: they were drafted, only not priced)
            full = drafted.full_ids[np.asarray(keep)]
            self._selected_depth = int(drafted.depth[full].max())
            # learned while the device computes the next cycle's verify (OnlineModel.defer)
            self.online.defer(self._learn_acceptance, drafted, full, acc, sub_parents)
            rec.host_cpu_ms += (time.thread_time() - c0) * 1e3
        if self.reference is not None:
            if self._reference_verified:  # it verified the whole drafted tree: commit in its node ids
                self.reference.commit([keep[v] for v in acc.path])
            else:  # an AR step, or every expert resident (no true routing needed): mirror the verify
                self.reference.verify(torch.tensor(sub_tokens), sub_parents)
                self.reference.commit(acc.path)
        rec.accept_ms = (time.perf_counter() - t0) * 1e3
        routing = out.routing.numpy()
        if self.predictor is not None:  # observed when next predicted (an AR step predicts nothing)
            self._unobserved.append((np.array([sub_tokens[v] for v in acc.path], np.int64),
                                     np.ascontiguousarray(routing[acc.path], np.int64)))
        if self._twin is not None:  # replayed with the next learning, during the next verify
            self._twin_path = routing[acc.path]
        stats1 = self.target.cache.stats()
        rec.transferred = (_layer_counts(stats1, "misses") - _layer_counts(stats0, "misses")).tolist()
        rec.transfer_ms = stats1["total"]["transfer_ms"] - stats0["total"]["transfer_ms"]
        if stats1.get("offload") in ("host", "auto"):
            rec.host = {k: (_layer_counts(stats1, f"host_{k}") - _layer_counts(stats0, f"host_{k}")).tolist()
                        for k in ("computed", "rows")}
        rec.compute_ms = max(rec.verify_ms - rec.transfer_ms, 0.0)
        rec.true_experts = [int(np.unique(routing[:, l]).size) for l in range(routing.shape[1])]
        rec.nodes_verified = len(keep)
        rec.accepted = acc.accepted
        rec.committed = len(acc.new_tokens)
        if rec.decision in ("ar", "shadow"):  # T(AR) of its measured counts: what the rate mode's λ counts
            rec.predicted_ms = self.cost.cycle_ms(1, *self._uncached(rec))
            if self._shadow_base:  # its H2D ms: what the next shadows' head forwards hide behind
                self.online.observe_ar_h2d(rec.predicted_ms - self._shortest_verify_ms())
                self._set_shadowing()
        if shadow is not None:  # up to the AR step's modeled ms less what it already hides
            hidden = min(shadow_host_ms, max(rec.predicted_ms - rec.hidden_host_ms, 0.0))
            rec.hidden_host_ms += hidden
            rec.host_cpu_ms += shadow_host_ms - hidden
        if self._shadows or shadow is not None:  # the forwards and tokens the pending shadows are resolved by
            if shadow is not None:
                self._shadows.append(shadow)
            for sh in self._shadows:
                sh.routing.extend(routing[acc.path])
                sh.tokens.extend(acc.new_tokens)
        if self.online is not None and self._cache is not None:  # learned during the next cycle's verify
            drafted_cycle = rec.decision != "ar" and rec.levels > 0 and self._root_new is not None
            if drafted_cycle:  # counted now: the gate's next decision reads it
                self.online.observe_selection(rec.nodes_verified - 1, self._selected_depth)
            self._after_verify = (rec, self._cache, routing, self._root_new, self._level_host_ms, self._selected_depth,
                                  rec.host_cpu_ms - self._level_host_ms, drafted_cycle)
        self._lam_tokens += rec.committed
        self._lam_ms += rec.predicted_ms
        path_tokens = [sub_tokens[v] for v in acc.path]
        return rec, acc.new_tokens, out.aux_hidden[acc.path], path_tokens

    def _learn_acceptance(self, drafted: "_Drafted", full: np.ndarray, acc, sub_parents: list) -> None:
        """Teach the acceptance calibrator one verify: its Bernoulli trials (under greedy verification
        every drafted child of an accepted node, verified or not: :func:`greedy_trials`; else the
        verified ones: :func:`verify_trials`) and its path outcome (:meth:`AcceptanceCalibrator.observe_paths`).
        ``full``: the verified nodes' ids in ``drafted`` (root first); ``acc`` the verify's acceptance."""
        if self.temperature == 0:
            n = drafted.n
            old, ok = greedy_trials(drafted.parents[:n], drafted.tokens[:n], full[acc.path], acc.bonus_token)
        else:
            nodes, ok = verify_trials(sub_parents, acc.path)
            old = full[nodes]
        self.acceptance._learn_verify(drafted.q[old], drafted.depth[old], np.asarray(ok, dtype=bool), drafted.rank[old],
                                      drafted.cal[full[1:]], drafted.depth[full[1:]], acc.accepted)  # as update, _observe_paths

    def _set_shadowing(self) -> None:
        """Let AR steps carry shadow cycles (:attr:`OnlineModel.shadowing`) where the engine can resolve them
        (``self._shadow_base``: the AR twin, a transfer-regime cost, a level-by-level method) and the recent
        AR steps' modeled H2D ms hide a whole tree's head forwards (``depth * draft_level_ms``; before
        any AR step, assumed to): where they copy too little, a shadow's levels would be paid as a real
        cycle's, and learning drafts for real as before."""
        mean = self.online.ar_h2d_ms()
        need = self.tree.depth * (self.cost.draft_level_ms or 0.0)
        self.online.shadowing = bool(self._shadow_base and (mean is None or mean >= need))

    def _shadow_of(self, tree: DraftTree, selection, items, rec: CycleRecord) -> _Shadow:
        """Keep this cycle's drafted tree and selection as a shadow cycle (``rec.decision == "shadow"``):
        the cycle verifies the root alone, and what the selection would have committed and cost is learned
        once decoding has committed the tokens after its root (:meth:`_resolve_shadow`). Its head forwards
        move to ``rec.shadow_levels``: on a GPU they run while the AR step copies its experts."""
        d, keep = self._drafted, np.asarray(selection.nodes, dtype=np.int64)
        experts = tree.experts[keep] if tree.num_layers else np.zeros((keep.size, 0, 0), dtype=np.int64)
        sh = _Shadow(d, d.full_ids[keep], np.array(experts), np.array(items.cache, dtype=bool), rec.levels,
                     rec.levels_ahead)
        rec.shadow_levels, rec.levels, rec.levels_ahead = rec.levels + rec.levels_ahead, 0, 0
        self.online.observe_shadow_selection(keep.size - 1)
        return sh

    def _resolve_shadows(self) -> None:
        """Learn every pending shadow cycle whose outcome is known now (oldest first); keep the others."""
        self._shadows = [sh for sh in self._shadows if not self._resolve_shadow(sh)]

    def _resolve_shadow(self, sh: _Shadow) -> bool:
        """Learn one shadow cycle if decoding has committed enough tokens after its root; False if not yet.

        Its outcome is the verify's (:func:`shadow_outcome`): the calibrator learns every drafted child of
        an accepted node (:func:`greedy_trials` along the committed continuation) and the path correction
        from the selection's nodes and the draft tokens it would have accepted. Its counterfactual T_d is
        a drafted cycle's (:meth:`_drafted_cycle_ms`) with the verify priced on the true experts of the
        forwards it would have committed (the committed ones: the same prefix routes the same way) and the
        predicted experts of its other nodes against the cache its selection saw, each of those
        charged the predictor's learned node correction; T_AR is the AR twin's for the same τ tokens.
        Both go to Ŝ_sh (:meth:`OnlineModel.observe_shadow`)."""
        d = sh.drafted
        n = d.n
        out = shadow_outcome(d.parents[:n], d.tokens[:n], sh.tokens)
        if out is None:
            return False
        path, bonus = out
        on_s = np.zeros(n, dtype=bool)
        on_s[sh.selected] = True
        tau = 1  # the selection's τ: its accepted draft tokens + the bonus token
        while tau < len(path) and on_s[path[tau]]:
            tau += 1
        if len(sh.ar_ms) < tau:
            return False
        old, ok = greedy_trials(d.parents[:n], d.tokens[:n], path, bonus)
        self.acceptance._learn_verify(d.q[old], d.depth[old], np.asarray(ok, dtype=bool), d.rank[old],
                                      d.cal[sh.selected[1:]], d.depth[sh.selected[1:]], tau - 1)
        needed = np.zeros_like(sh.cache)
        rejected = ~np.isin(sh.selected, path[:tau])
        if needed.size:
            layer = np.arange(needed.shape[0])[:, None]
            for r in sh.routing[:tau]:
                needed[layer, r] = True
            ex = sh.experts[rejected]
            needed[np.broadcast_to(layer[None], ex.shape), ex] = True
        counts = (needed & ~sh.cache).sum(axis=1)
        extra, m = 0.0, self.online.node_correction()
        if m is not None and rejected.any():
            extra = int(rejected.sum()) * max(0.0, float(self.cost.per_expert_array(m.size) @ m))
        cycle_ms = (self.cost.cycle_ms(int(sh.selected.size), counts) + extra + sh.levels * self._level_ms()
                    + sh.levels_ahead * (self.cost.draft_level_ms or 0.0) + self.online.host_cycle_ms())
        self.online.observe_shadow(draft_nodes=int(sh.selected.size) - 1, cycle_ms=cycle_ms,
                                   ar_tokens_ms=float(sum(sh.ar_ms[:tau])))
        return True

    def _learn_last_cycle(self) -> float:
        """Run the last cycle's :meth:`_learn` if it is still queued; its thread CPU seconds (0 if none).

        A cycle's outcome is learned while the next cycle's verify runs on the device (SPECFIT.md §3,
        "Whole-cycle objective"): up to :meth:`_shortest_verify_ms` of it is hidden there
        (``rec.hidden_host_ms``), so the next cycle's gate and selection see the online model one
        cycle late."""
        if self._after_verify is None and self._twin_path is None:
            return 0.0
        args, self._after_verify = self._after_verify, None
        c0 = time.thread_time()
        twin_ms = self._replay_twin()
        if self._shadows:
            self._resolve_shadows()
        if args is not None:
            self._learn(*args, twin_ms)
            online = self.online
            if online.root_weight and isinstance(self.cost, CostModel):  # the next corrected cost's terms, here
                online.weighted_corrections(self.cost.per_expert_array(online.root_error.size))
        return time.thread_time() - c0

    def _sync_twin(self) -> None:
        """After a prefill: give the AR twin the runtime cache's state (made, or made again, for the
        cache the target holds now: its slots and policy).

        Only a calibrated method in the transfer regime whose runtime cache reports its eviction state
        (:meth:`DeviceExpertCache.recency`), holds 0 or at least ``top_k`` slots but not every expert,
        and evicts by LRU or LFU gets one; the gate's counterfactual is otherwise the root's AR step
        against the engine's cache, τ times. (With fewer slots than a token's experts the runtime copies
        a forward's experts in rounds, which the twin does not replay exactly.)"""
        self._twin_path = None
        if self.online is None:  # no gate: nothing reads the twin
            return
        cache = getattr(self.target, "cache", None)
        slots = getattr(cache, "slots", None)
        policy = getattr(getattr(cache, "policy", None), "name", getattr(cache, "policy", None))
        key = (id(cache), slots, policy)
        if self._twin is None or self._twin_key != key:
            self._twin, self._twin_key = None, key
            k = int(getattr(getattr(self.target, "spec", None), "top_k", self.num_experts))
            ok = (hasattr(cache, "recency") and policy in ("lru", "lfu")
                  and getattr(self.target, "offload", "transfer") == "transfer"
                  and isinstance(slots, (int, np.integer)) and (slots == 0 or k <= slots < self.num_experts))
            if not ok:
                return
        state = cache.recency()
        if self._twin is None:
            self._twin = ARTwinCache(len(state[0]), self.num_experts, slots, policy)
        self._twin.sync(*state)

    def _replay_twin(self) -> float | None:
        """Step the AR twin through the last cycle's committed forwards (every cycle's, AR steps the
        online model does not learn from included: :meth:`_learn_last_cycle` runs each cycle).

        Returns
        -------
        float or None
            ms plain AR decoding would have paid for the last cycle's committed tokens (τ one-token
            steps, each priced by the cost's ``cycle_ms`` on the twin's misses); None without a twin.
        """
        if self._twin_path is None:
            return None
        path, self._twin_path = self._twin_path, None
        ms = [self._ar_step_ms(self._twin.step(r)) for r in path]
        for sh in self._shadows:  # each forward's AR ms, in order, for the shadows it continues
            if len(sh.ar_ms) < len(sh.routing):
                sh.ar_ms.extend(ms[:len(sh.routing) - len(sh.ar_ms)])
        return sum(ms)

    def _shortest_verify_ms(self) -> float:
        """The cost model's shortest verify, ms: the root alone with every expert cached."""
        return float(self.cost.cycle_ms(1, ()))

    def _learn(self, rec: CycleRecord, cache: np.ndarray, routing: np.ndarray, root_new, level_host_ms: float,
               selected_depth: int, rest_ms: float, drafted_cycle: bool, ar_tokens_ms: float | None = None) -> None:
        """Teach the online model one cycle's outcome: the root's true against predicted uncached
        experts, and for a drafted cycle its time (:meth:`_drafted_cycle_ms`) against plain AR decoding's
        for its committed tokens (:meth:`OnlineModel.observe`). ``cache``, ``root_new`` (the root's predicted uncached experts per
        layer, None if not predicted), ``level_host_ms`` and ``selected_depth``: the cycle's, as it left
        them; ``rest_ms``: its host CPU ms outside its levels; ``drafted_cycle``: whether it was a drafted
        cycle with predicted root experts, counted at its verify (:meth:`OnlineModel.observe_selection`);
        ``ar_tokens_ms``: AR decoding's ms for the committed tokens in the AR twin's cache
        (:meth:`_replay_twin`), None without a twin: then τ AR steps of the root in the engine's cache."""
        layer = np.arange(cache.shape[0])[:, None]
        root_true = (~cache[layer, routing[0]]).sum(axis=1)  # (L,) the root's true uncached experts
        rec.ar_step_ms = self._ar_step_ms(root_true)
        if ar_tokens_ms is not None:
            rec.ar_tokens_ms = ar_tokens_ms
        if rec.decision != "ar" and rec.levels:
            self.online.observe_host(rec.levels, level_host_ms, rest_ms)
        if root_new is None:
            return
        if not drafted_cycle:
            self.online.observe(root_predicted_new=root_new, root_true_new=root_true)
            return
        predicted = rec.predicted_new if len(rec.predicted_new) == root_true.size else np.zeros(root_true.size)
        counts = self._uncached(rec)
        uncached = np.add(rec.host["computed"], rec.transferred) if rec.host else rec.transferred  # host + copied
        self.online.observe(root_predicted_new=root_new, root_true_new=root_true,
                            selected_predicted_new=predicted, transferred=uncached,
                            draft_nodes=rec.nodes_verified - 1, committed=rec.committed,
                            cycle_ms=self._drafted_cycle_ms(rec, counts), ar_ms=rec.ar_step_ms,
                            ar_tokens_ms=ar_tokens_ms, selected_depth=selected_depth, counted=True)

    def _drafted_cycle_ms(self, rec: CycleRecord, counts: tuple) -> float:
        """T_d of a drafted cycle for Ŝ, ms: its verify priced on the measured ``counts``, its draft
        levels at :meth:`_level_ms` and :meth:`OnlineModel.host_cycle_ms`: the host ms the selection
        charges, decayed means that already hold this cycle's measurement. This cycle's raw CPU time
        alone made the gate chaotic at break-even (the same run drafted 49% to 77% of its cycles; see
        docs/SPECFIT.md §3)."""
        verify = self.cost.cycle_ms(rec.nodes_verified, *counts)
        return (verify + rec.levels * self._level_ms() + rec.levels_ahead * (self.cost.draft_level_ms or 0.0)
                + self.online.host_cycle_ms())

    @staticmethod
    def _uncached(rec: CycleRecord) -> tuple:
        """The verify's measured counts per layer, the arguments of the cost's ``cycle_ms`` after the
        node count: transfer mode, the experts copied (twice: rows are unused); host and auto mode,
        the experts computed on the host, their (token, expert) rows and the experts copied (0 in
        the host mode)."""
        if rec.host:
            return rec.host["computed"], rec.host["rows"], rec.transferred
        return rec.transferred, rec.transferred

    def _ar_step_ms(self, root_true: np.ndarray) -> float:
        """T of this cycle's counterfactual AR step, whose root needs ``root_true`` uncached experts
        per layer, shape (L,) (one row each): in the auto offload mode the split of
        :meth:`HostProfile.split` the runtime would choose, otherwise the cost's ``cycle_ms``."""
        if getattr(self.target, "offload", "transfer") == "auto" and isinstance(self.cost, HostProfile):
            return self.cost.split_cycle_ms(1, [[1] * int(u) for u in root_true])
        return self.cost.cycle_ms(1, root_true)

    def _draft_and_select(self, root: int, cache: np.ndarray, rec: CycleRecord):
        """Grow the draft tree level by level and select its verified subtree.

        For a calibrated method the tree carries calibrated path probabilities (the raw ones, and
        every drafted node, are kept in ``self._drafted``), the levels drafted so far are a cost of the
        cycle (whole-cycle objective) and the AR gate may skip drafting (SPECFIT.md §3). For a
        level-by-level method with an exact selector the tree holds only the drafted nodes that can
        belong to an optimal selection (:func:`specfit.solvers.stop.selectable`).

        Returns ``(tree, selection, items)``: the :class:`DraftTree` drafted, the
        :class:`~specfit.solvers.Selection` and the tree's coverage accounting against ``cache``;
        ``(None, None, None)`` when the AR gate skipped drafting.
        """
        m, ts, online = self.method, self.tree, self.online
        self._root = None  # built at most once in this call (_root_tree)
        depth = online.draft_depth(ts.depth) if online is not None else ts.depth  # warm-up cap
        # The first level is launched before the cycle's host work (the root's prediction, its cost, the
        # AR gate's sound bound), which then runs while the device computes it (_hide_behind_first_level).
        # The gate decides first where it may take the AR step: on measured utility alone (cheap, no root
        # needed), or where the sound bound last said no draft can beat the AR step.
        speculate = (online is not None and online.ahead is None and online._asks_sound_bound()
                     and online.sound_said_draft)

        def gate() -> str:  # the AR gate's decision, recorded
            rec.speedup_estimate = online.speedup
            rec.decision = online.decide(lambda: self._sound_gate(root, self._cache_now(cache)))
            return rec.decision

        if online is not None and not speculate and gate() == "ar":
            return None, None, None
        levels = self.drafter.draft_levels(root, ts.top_k, depth)
        first = self._next_level(levels, rec)  # launched: on a GPU its forward (and the one after it) runs now
        behind = (time.thread_time(), self._untimed_s)  # the host work behind the first level starts here
        if speculate and gate() == "ar":  # asked behind the level (the root predicted there): the launch is paid
            self._hide_behind_first_level(rec, behind)
            levels.close()
            rec.levels_ahead = min(depth, 2) if getattr(self.drafter, "launches_ahead", False) else 1
            return None, None, None
        cache = self._cache_now(cache)
        rate = None
        if self.rate_mode and self._lam_ms > 0:
            rate = 1000.0 * self._lam_tokens / self._lam_ms
        # every expert resident: no node brings an expert, so none is predicted (T(S) has no expert term)
        experts_known = m.needs_experts and not cache.all()  # predicted, or (oracle) the true routing
        predicted = m.needs_predictor and experts_known
        with_hidden = predicted and getattr(self.predictor, "uses_hidden", True)  # gathered only for a reader
        predict_s0 = self._predict_s  # the predictor's calls below are predict_ms, not tree_ms
        t0 = time.perf_counter()
        if predicted:  # the AR gate may have built it already
            tree, cost = self._root_tree(root, cache)
        else:  # the oracle's experts: a placeholder until the true routing is known
            experts = np.zeros((1, cache.shape[0], int(self.target.spec.top_k)), dtype=np.int64) if experts_known else None
            tree = _root_only(root, experts, self.num_experts)
            cost = self._cycle_cost(tree, cache) if experts_known else self.cost
        rec.tree_ms += (time.perf_counter() - t0) * 1e3
        d = self._drafted = _Drafted.of_root(root, 1 + sum(ts.level_width(j) for j in range(1, ts.depth + 1)))
        if not experts_known:  # no expert term: an empty layer axis
            if m.needs_experts:  # all resident: the root brings none either
                self._root_new = np.zeros(cache.shape[0], dtype=np.int64)
            cache = np.zeros((0, self.num_experts), dtype=bool)
        cal = self.acceptance
        level_ms = self._level_ms() if m.calibrated else 0.0
        host_ms = self.online.host_cycle_ms() if m.calibrated else 0.0  # paid by any drafted cycle
        width = ts.level_width(ts.depth) if m.calibrated else None  # most nodes a further level adds
        node_ms = cost.min_node_ms_for(cache) if m.level_by_level else None  # per-node bound of T this cycle
        # the stop rule (solvers.stop.should_stop) stops iff P_f <= stop_ms * R* / 1000: its per-node ms, once per cycle
        stop_ms = stop_node_ms(cost, level_ms=level_ms, level_width=width, min_node_ms=node_ms) if m.level_by_level else None
        root_ms = cost.cycle_ms(1, tree.items(cache).root_new_per_layer)  # T(root alone) = T(AR)
        # Nodes in no optimal selection are dropped before they are predicted or priced (solvers.stop.selectable)
        # against R_lo <= R*: the root alone with every level paid, or a selection found so far. The oracle's
        # T(root alone) is known once the reference has routed the first level.
        prune = m.level_by_level and self.solver.exact
        max_sunk, rate_lo, root_known = host_ms + depth * level_ms, 0.0, not (m.oracle and experts_known)
        selection = None
        # kept levels wait in `pending` until a selection needs their experts: one predictor call per solve,
        # not per level (the stop rule and the pruning read only P and the cost)
        pending, n_tree, pp_sum = [], tree.n, float(tree.path_prob.sum())
        self._hide_behind_first_level(rec, behind)
        u_levels, untimed0 = time.thread_time(), self._untimed_s  # the levels' host work, for the online model
        # a drafter that launches each level before the one above it is read (Eagle3Drafter.launches_ahead):
        # each level's host work runs while the next level's forward is on the device (_hide_behind_levels)
        level_host, body = [], None  # host CPU s of each level's work; (thread time, untimed s) at its start
        while True:
            if body is not None:
                level_host.append(time.thread_time() - body[0] - (self._untimed_s - body[1]))
                body = None
            level = self._next_level(levels, rec) if rec.levels else first
            if level is None:  # the levels ended: a selection of this level's tree and sunk ms, if any, stands
                break
            selection = None  # a new level was paid: an earlier selection's sunk ms is stale
            rec.levels += 1
            body = (time.thread_time(), self._untimed_s)
            t0 = time.perf_counter()
            parents, tokens, head_pp = _level_arrays(level)
            if prune:
                if rate is not None:
                    rate_lo = rate
                elif root_known:
                    rate_lo = max(rate_lo, 1000.0 / (root_ms + max_sunk))
            threshold = selectable_threshold(node_ms, rate_lo) if prune else -np.inf
            if cal is not None and parents.size:  # calibrated conditionals along the path, corrected per depth
                kept, kept_parents, pp_kept, pp_sum, p_f = d.add_calibrated(cal, parents, tokens, head_pp, threshold,
                                                                            n_tree, pp_sum)
            else:
                kept, kept_parents, pp_kept, pp_sum, p_f = d.add_raw(parents, tokens, head_pp, threshold, n_tree, pp_sum)
            if kept.size:  # an index tensor copies: the drafter may reuse its hidden buffer
                hidden = level.hidden[torch.from_numpy(kept)] if with_hidden and level.hidden is not None else None
                pending.append((kept_parents, pp_kept, tokens[kept], hidden))
            n_tree += kept.size
            rec.tree_ms += (time.perf_counter() - t0) * 1e3
            if not kept.size:  # every deeper node descends from a dropped one: in no optimal selection either
                break
            if m.oracle and experts_known:  # outside the timed path; the root's true experts change T(root alone)
                self._grow(tree, pending, predicted, rec)
                u0 = time.thread_time()
                tree.set_experts(self._true_routing(tree))
                self._reference_verified = True
                self._untimed_s += time.thread_time() - u0
                root_ms, root_known = cost.cycle_ms(1, tree.items(cache).root_new_per_layer), True
            if m.level_by_level and rec.levels < depth:
                # The stop rule stops iff P_f <= (per_node_ms + level_ms / width) * R*. R* <= 1000 (1 + sum P) /
                # (T(root alone) + sunk), as every subtree holds the root, and R* <= ratio_upper_bound (each node
                # adds >= node_ms too); predict and solve only when both bounds let the rule fire (rate mode needs
                # no R*). Sunk: the cycle's host ms and the levels drafted.
                sunk = host_ms + rec.levels * level_ms
                bound = 1000.0 * pp_sum / (root_ms + sunk)
                if rate is not None and p_f <= stop_ms * rate / 1000.0:
                    break
                if rate is None and p_f <= stop_ms * bound / 1000.0 and p_f <= stop_ms * _ratio_upper_bound(
                        np.concatenate([tree.path_prob[1:]] + [pp for _, pp, _, _ in pending]),
                        root_ms + sunk, node_ms) / 1000.0:
                    self._grow(tree, pending, predicted, rec)
                    selection = self._select(tree, cache, rate, rec, cost, sunk)
                    if prune:  # the same subtree, every level paid, is still there at the end of the cycle
                        rate_lo = max(rate_lo, 1000.0 * selection.expected_tokens
                                      / (selection.predicted_ms - sunk + max_sunk))
                    if p_f <= stop_ms * selection.throughput / 1000.0:  # rate mode broke out above
                        break
        if body is not None:
            level_host.append(time.thread_time() - body[0] - (self._untimed_s - body[1]))
        u_end, untimed_end = time.thread_time(), self._untimed_s
        levels.close()
        self._grow(tree, pending, predicted, rec)
        self._level_host_ms = (time.thread_time() - u_levels - (self._untimed_s - untimed0)) * 1e3
        rec.nodes_drafted, rec.nodes_pruned = d.n - 1, d.n - tree.n
        rec.tree_ms = max(rec.tree_ms - (self._predict_s - predict_s0) * 1e3, 0.0)
        if selection is None:
            selection = self._select(tree, cache, rate, rec, cost, host_ms + rec.levels * level_ms)
        items = tree.items(cache)
        if getattr(self.drafter, "launches_ahead", False):
            final_s = time.thread_time() - u_end - (self._untimed_s - untimed_end)
            self._hide_behind_levels(rec, level_host, final_s, depth)
        return tree, selection, items

    def _hide_behind_levels(self, rec: CycleRecord, level_host: list, final_s: float, depth: int) -> None:
        """Book the host work the draft levels' forwards hide, for a drafter that launches each level
        before the one above it is read (``launches_ahead``): level j's host work (``level_host[j-1]``,
        s) runs while level j+1's forward is on the device, so up to ``draft_level_ms`` of it is hidden;
        a cycle that stopped before ``depth`` levels left one level launched and unused
        (``rec.levels_ahead`` = 1, a draft level in the modeled cycle and in the gate's T_d), which hides
        up to ``draft_level_ms`` of its last level's work and the cycle's final work (``final_s``: the
        last prediction, the selection). The hidden ms move from ``rec.host_cpu_ms`` and the levels'
        host ms (the online model's per-level cost, :meth:`_level_ms`) to ``rec.hidden_host_ms``
        (SPECFIT.md §3, "Host work hidden by the device")."""
        slot = (self.cost.draft_level_ms or 0.0) / 1e3
        if not level_host or slot <= 0.0:
            return
        hidden = sum(min(h, slot) for h in level_host[:-1])
        rec.levels_ahead = int(rec.levels < depth)
        if rec.levels_ahead:
            hidden += min(level_host[-1] + final_s, slot)
        self._untimed_s += hidden  # out of host_cpu_ms (the cycle's thread time less its untimed parts)
        rec.hidden_host_ms += hidden * 1e3
        self._level_host_ms = max(self._level_host_ms - hidden * 1e3, 0.0)

    def _next_level(self, levels, rec: CycleRecord):
        """The drafter's next level (None when its levels ended); the head forward's time is the cycle's
        ``draft_ms`` and is left out of its host CPU time (device work)."""
        t0, u0 = time.perf_counter(), time.thread_time()
        level = next(levels, None)
        rec.draft_ms += (time.perf_counter() - t0) * 1e3
        self._untimed_s += time.thread_time() - u0
        return level

    def _hide_behind_first_level(self, rec: CycleRecord, start: tuple) -> None:
        """Book the host work done after the cycle's first draft level was launched and before its
        outputs are read (the root's prediction and cost model, the AR gate's sound bound, the stop
        rule's constants; on a GPU the head forward runs meanwhile): its CPU time since ``start``
        (``(thread time, untimed s)`` at the launch), up to the profile's ``draft_level_ms``, is
        ``rec.hidden_host_ms``, off the critical path; the rest is host time of the cycle outside its
        levels (``host_cpu_ms``; SPECFIT.md §3, "Whole-cycle objective")."""
        spent = time.thread_time() - start[0] - (self._untimed_s - start[1])
        hidden = min(spent, (self.cost.draft_level_ms or 0.0) / 1e3)
        self._untimed_s += spent  # out of the levels' host time (a cost per cycle, not per level) ...
        rec.host_cpu_ms += (spent - hidden) * 1e3  # ... what the head forward did not hide is the cycle's
        rec.hidden_host_ms += hidden * 1e3

    def _grow(self, tree: DraftTree, pending: list, predicted: bool, rec: CycleRecord) -> None:
        """Append the ``pending`` levels (each ``(parents, path_prob, tokens, hidden)``, parents as ids of
        ``tree`` or of an earlier pending level) to ``tree`` and empty the list. Their experts: predicted
        in one call when ``predicted`` (one predictor call per selection instead of one per level; one per
        level if some levels carry hidden states and others not, so each gets the states it has), zeros
        when the tree has experts (the oracle's placeholder), else none. Timed into ``rec.tree_ms``."""
        if not pending:
            return
        t0 = time.perf_counter()
        parents, pp, tokens, hidden = zip(*pending)  # all checked; a parent may be in an earlier pending level
        parents, pp, tokens = np.concatenate(parents), np.concatenate(pp), np.concatenate(tokens)
        experts = None
        if predicted:
            if all(h is not None for h in hidden):
                experts = self._predict(tokens, torch.cat(hidden).float().cpu().numpy())
            elif all(h is None for h in hidden):
                experts = self._predict(tokens, None)
            else:  # some levels with hidden states, some without: each level's own, one call each
                experts = np.concatenate([self._predict(tok, None if h is None else h.float().cpu().numpy())
                                          for _, _, tok, h in pending])
            if experts.shape[1:] != tree.experts.shape[1:]:
                raise SpecFitInputError("experts", f"the predictor's must have shape (m, L, k) = (m,) + "
                                        f"{tree.experts.shape[1:]}, got {experts.shape}")
        elif tree.experts is not None:
            experts = np.zeros((len(parents),) + tree.experts.shape[1:], dtype=np.int64)
        tree._append_level(parents, pp, tokens, experts)
        pending.clear()
        rec.tree_ms += (time.perf_counter() - t0) * 1e3

    def _cache_now(self, cache: np.ndarray | None) -> np.ndarray:
        """The expert-cache mask (L, E) at the cycle's start (read once per cycle; ``cache`` if given)."""
        if cache is not None:
            self._cache = cache
        elif self._cache is None:
            self._cache = _cache_mask(self.target, self.num_experts)
        return self._cache

    def _predict(self, tokens: np.ndarray, hidden) -> np.ndarray:
        """The predictor's experts (m, L, k) for ``tokens`` (m,), after it observed every committed token
        (its wall time is the cycle's ``predict_ms``); checked (:func:`check_experts`) unless the predictor
        declares ``valid_output`` (the built-in ones). The committed tokens not yet observed are observed
        first, in the same call where the predictor has ``observe_and_predict``. ``tokens`` and the committed
        tokens and routing are int64 C-contiguous arrays the engine made, so a predictor that takes them as
        they are (``predict_ids``, ``observe_and_predict_ids``: the frequency predictor) is called without its
        per-call checks of type and layout (:meth:`_predictor_calls`)."""
        t0 = time.perf_counter()
        calls = self._calls
        if calls[0] is not self.predictor:
            calls = self._calls = self._predictor_calls()
        _, fused, predict, valid = calls
        observed = None
        if self._unobserved:
            toks, rows = zip(*self._unobserved)
            self._unobserved.clear()  # several cycles' tokens (AR steps before this one) joined; one cycle's as is
            observed = (np.concatenate(toks), np.concatenate(rows)) if len(toks) > 1 else (toks[0], rows[0])
        if observed is not None and fused is not None:
            experts = fused(*observed, tokens, hidden)
        else:
            if observed is not None:
                self.predictor.observe(*observed, None)
            experts = predict(tokens, hidden)
        if not valid:
            experts = check_experts(experts, len(tokens), self.num_experts, copy=False)
        self._predict_s += time.perf_counter() - t0
        return experts

    def _predictor_calls(self) -> tuple:
        """``(predictor, fused, predict, valid)`` for :meth:`_predict`, kept until ``self.predictor`` is
        replaced: its fused observe-and-predict (None without one) and its predict, each the ``*_ids``
        variant where it has one; ``valid`` its ``valid_output`` flag."""
        p = self.predictor
        fused = getattr(p, "observe_and_predict_ids", None) or getattr(p, "observe_and_predict", None)
        predict = getattr(p, "predict_ids", None) or p.predict
        return p, fused, predict, getattr(p, "valid_output", False) is True

    def _root_tree(self, root: int, cache: np.ndarray) -> tuple[DraftTree, CostModel]:
        """This cycle's root-only draft tree with the root's predicted experts, and the cycle's cost
        model (:meth:`_cycle_cost`); built once per cycle, shared by the AR gate and the drafting."""
        if self._root is None:
            experts = self._predict(np.array([root], np.int64), None)[:1]
            tree = _root_only(root, experts, self.num_experts)
            self._root = (tree, self._cycle_cost(tree, cache))
        return self._root

    def _level_ms(self) -> float:
        """ms one draft level costs a calibrated method: the profile's ``draft_level_ms`` (the head
        forward) and the measured host ms per level (:meth:`OnlineModel.host_level_ms`, the profile's
        ``host_level_ms`` before any drafted cycle)."""
        return (self.cost.draft_level_ms or 0.0) + self.online.host_level_ms(self.cost.host_level_ms or 0.0)

    def _cycle_cost(self, tree: DraftTree, cache: np.ndarray) -> CostModel:
        """The cost model of this cycle's selection: the engine's, with the predictor's learned error
        priced in for calibrated methods (:meth:`OnlineModel.corrected_cost`; for a host-regime
        profile the draft nodes' part only); records the root's predicted uncached experts for the
        online model."""
        self._root_new = np.asarray(tree.items(cache).root_new_per_layer)
        if self.online is None:
            return self.cost
        return self.online.corrected_cost(self.cost, self._root_new)

    def _sound_gate(self, root: int, cache: np.ndarray) -> bool:
        """The AR gate's sound part: False only if no draft can beat this cycle's AR step (T(root
        alone) with its predicted experts, under the corrected cost) within the model
        (:func:`draft_can_beat_ar`); True before any drafted cycle.

        The mass bound of depth j is :meth:`~specfit.core.acceptance.AcceptanceCalibrator.mass_bound`
        with the drafter's level widths (``top_k`` then ``top_k**2``). The expert bound is the smallest
        expert ms of a single draft node (beyond the cache and the root) over the online model's last
        drafted cycles.
        """
        online = self.online
        if not online.min_expert_ms:
            return True
        if not self.method.needs_predictor or cache.all():  # oracle: root experts unknown; all resident: none
            return True
        tree, cost = self._root_tree(root, cache)
        ar_ms = cost.cycle_ms(1, tree.items(cache).root_new_per_layer)
        mass = self.acceptance.mass_bound(self._gate_widths())
        return draft_can_beat_ar(ar_ms, mass, self._level_ms(), cost.min_node_ms, min(online.min_expert_ms))

    def _prepare_gate(self, tree: DraftTree, cache: np.ndarray) -> None:
        """What the next cycle's AR gate (:meth:`_sound_gate`) reads, computed while this cycle's verify
        runs (booked as learning: hidden up to the shortest verify): this drafted ``tree``'s cheapest node's
        expert ms against ``cache`` (the one its accounting used) into the online model's window, and the
        calibrator's mass bound (kept by
        :meth:`~specfit.core.acceptance.AcceptanceCalibrator.mass_bound` until its tables change; they
        changed at this cycle's first draft level and change next at the next drafted cycle's, after its
        gate)."""
        self.online.min_expert_ms.append(self._cheapest_node_expert_ms(tree, cache))
        self.acceptance.mass_bound(self._gate_widths())

    def _gate_widths(self) -> list[int]:
        """The drafter's most nodes per depth 1..D (``top_k``, then ``top_k ** 2``): the mass bound's widths."""
        return [self.tree.level_width(j) for j in range(1, self.tree.depth + 1)]

    def _cheapest_node_expert_ms(self, tree: DraftTree, cache: np.ndarray) -> float:
        """Smallest expert ms a single draft node of ``tree`` adds to the root's beyond the cost's
        ``min_node_ms`` (:meth:`CostModel.node_added_ms`; 0 without experts)."""
        if tree.num_layers == 0:
            return 0.0
        exp = tree.experts
        have = cache.copy()
        layer = np.arange(exp.shape[1])[:, None]
        have[layer, exp[0]] = True  # the root's experts are paid by the AR step too
        new = (~have[layer[None], exp[1:]]).sum(axis=2)  # (n-1, L); a node's k ids per layer are distinct
        rows = (~cache[layer[None], exp[1:]]).sum(axis=2)  # (n-1, L): each node's uncached experts
        return float(self.cost.node_added_ms(tree.items(cache).root_new_per_layer, new, rows).min())

    def _select(self, tree: DraftTree, cache: np.ndarray, rate: float | None, rec: CycleRecord,
                cost: CostModel | None, sunk_ms: float = 0.0):
        """Solve the selection under ``cost`` (None: a cost-blind selector); ``sunk_ms`` (the levels
        drafted this cycle) is added to ``fixed_ms``: a cost of the cycle that does not depend on the
        selection (whole-cycle objective). Through :meth:`Solver.solve_tree` (the same selection as
        ``solve`` of the instance, without building it where the solver can)."""
        t0 = time.perf_counter()
        cost = cost if cost is not None else CostModel(1.0, 0.0, 0.0)
        # cache: the one the tree's coverage accounting uses
        sel = self.solver.solve_tree(tree, cost, cache, rate=rate, sunk_ms=sunk_ms, max_nodes=self.max_nodes)
        rec.solve_ms += (time.perf_counter() - t0) * 1e3
        return sel

    def _true_routing(self, tree: DraftTree) -> np.ndarray:
        """True routing of every drafted node (n, L, k) from the reference target (oracle only)."""
        return self.reference.verify(torch.tensor(tree.tokens), tree.parents.tolist()).routing.numpy()
