"""The SpecFit decoding cycle; every method of SPECFIT.md §6 is a configuration of it.

One cycle (:meth:`SpecDecoder._cycle`; ARCHITECTURE.md, "Read first"):

    the policy decides (specfit.engine.policy) → draft one level → stop? (from P and the cost)
    → predict the kept nodes' experts → select → verify the selected subtree in one target forward
    → accept a root path + bonus token → compact the target KV, commit to the drafter → cycle record

With ``prefetch=True`` a drafted cycle first asks the expert cache to copy the root's predicted experts,
which on a GPU run beside the head forwards (:meth:`SpecDecoder._prefetch_root`, :mod:`specfit.core.prefetch`).

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
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import torch

from specfit.core.acceptance import greedy_trials, verify_trials
from specfit.core.cost import CostModel, HostProfile
from specfit.core.errors import SpecFitInputError, check_context, check_positive_int, check_single_sequence, lookup
from specfit.core.lookahead import expert_demand, tree_expert_demand
from specfit.core.prefetch import overlap_ms, prefetch_budget
from specfit.core.tree import DraftTree, check_experts
from specfit.engine.clock import Clock, MeasuredClock
from specfit.engine.online import OnlineModel, missed_expert_ms
from specfit.engine.policy import DraftPolicy, make_policy
from specfit.engine.twin import ARTwinCache
from specfit.engine.verify import Sampling
from specfit.solvers import get_solver
from specfit.solvers.base import solver_class
from specfit.solvers.stop import draft_can_beat_ar, ratio_upper_bound_unchecked, selectable_threshold, stop_node_ms


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
    lookahead_levels : int
        Head levels of the lookahead draft an AR step drafts (0: none): with an expert cache that evicts
        by lookahead (``--eviction lookahead``), a step that verifies the root alone and drafts no tree
        first drafts this many levels below the root, never verified, and their nodes' predicted experts,
        weighted by their path probabilities, are the cache's demand during the step
        (:meth:`SpecDecoder._lookahead_chain`). Timing only, never outputs.
    lookahead_top_k : int
        Children per expanded node and nodes expanded per level of the lookahead draft (1: a chain of the
        head's most likely tokens; more: a small EAGLE-2 tree).

    The properties below say what a method needs; callers test them, never method names.
    """

    name: str
    drafts: bool
    selector: str | None
    level_by_level: bool = False
    oracle: bool = False
    uses_cache: bool = True
    calibrated: bool = False
    lookahead_levels: int = 0
    lookahead_top_k: int = 1

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
        """True iff the method predicts the draft nodes' (or its lookahead draft's) experts with an expert predictor."""
        return (self.needs_experts and not self.oracle) or self.lookahead_levels > 0

    @property
    def needs_drafter(self) -> bool:
        """True iff the method runs the draft head: to grow a draft tree, or its AR steps' lookahead draft."""
        return self.drafts or self.lookahead_levels > 0

    @property
    def needs_reference(self) -> bool:
        """True iff the method needs a reference target for the true routing (the oracle)."""
        return self.oracle


#: Levels and width of the lookahead draft of ``ar+lookahead`` and of specfit's AR steps
#: (``Method.lookahead_levels``, ``Method.lookahead_top_k``): a small tree of 6 + 36 nodes, chosen by
#: measurement (BENCHMARKS.md, "Engine-driven lookahead": wider beat deeper at 16 and 32 slots).
LOOKAHEAD_LEVELS = 2
LOOKAHEAD_TOP_K = 6

METHODS: dict[str, Method] = {
    "ar": Method("ar", drafts=False, selector=None),
    "ar+lookahead": Method("ar+lookahead", drafts=False, selector=None, lookahead_levels=LOOKAHEAD_LEVELS,
                           lookahead_top_k=LOOKAHEAD_TOP_K),
    "eagle3-vanilla": Method("eagle3-vanilla", drafts=True, selector="eagle", uses_cache=False),
    "eagle3": Method("eagle3", drafts=True, selector="eagle"),
    "eagle3-scan": Method("eagle3-scan", drafts=True, selector="scan"),
    "specfit": Method("specfit", drafts=True, selector="exact", level_by_level=True, calibrated=True,
                      lookahead_levels=LOOKAHEAD_LEVELS, lookahead_top_k=LOOKAHEAD_TOP_K),
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
    depth 6 for the proxy)."""

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


@dataclass(frozen=True)
class SelectionSettings:
    """What shapes the verified subtree: the draft ``tree``'s settings, the ``cost`` model that prices
    it (None for a cost-blind method), the ``solver`` that selects it (None for ``ar``), whether it
    maximises the long-run rate (``rate_mode``) and the verify-width budget ``max_nodes`` (None: none)."""

    tree: TreeSettings
    cost: CostModel | HostProfile | None
    solver: object
    rate_mode: bool = False
    max_nodes: int | None = None


@dataclass(frozen=True)
class Mechanisms:
    """Engine mechanisms a decoder can switch (:class:`SpecDecoder`'s arguments of the same names):
    ``prefetch`` the root's predicted experts while the head drafts (off by default), the stop rule's
    sound ``stop_bounds`` before a solve, and ``batch_predict`` (one predictor call per solve)."""

    prefetch: bool = False
    stop_bounds: bool = True
    batch_predict: bool = True


@dataclass
class _TwinState:
    """The AR twin (:mod:`specfit.engine.twin`) and the shadow cycles it prices.

    Attributes: ``shadows`` the decoder's setting (AR steps may carry shadow cycles); ``wanted`` its
    ``twin`` setting (False: no generation makes one); ``cache`` the
    twin's :class:`~specfit.engine.twin.ARTwinCache` (None until a generation has one) and ``key`` the
    runtime cache it replays, ``(id, slots, policy)``; ``can_shadow`` whether this generation's AR steps
    can carry shadow cycles (the twin, a transfer-regime cost, a level-by-level method: :meth:`SpecDecoder._prefill`).
    """

    shadows: bool
    wanted: bool = True
    cache: ARTwinCache | None = None
    key: tuple | None = None
    can_shadow: bool = False


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
    """What one cycle did and cost. Counts are of this cycle; ms are wall-clock unless said otherwise.

    Attributes
    ----------
    levels : int
        Draft levels drafted (0 for an AR step and a shadow cycle).
    levels_ahead : int
        Head forwards launched and not used: 1 when a drafter that launches each level ahead
        (``launches_ahead``) stopped before the cycle's depth; 1, or 2 with ``launches_ahead``, when the
        gate's sound bound, asked behind the first level, took the AR step. Paid in the modeled cycle.
    shadow_levels : int
        For ``decision == "shadow"``: the head forwards its tree took (its levels and one launched ahead);
        they run while the device copies the AR step's experts, so the modeled time charges only what
        exceeds the step's H2D ms (``eval/modeled.py``).
    nodes_drafted : int
        Nodes the head drafted (root excluded).
    nodes_pruned : int
        Drafted nodes in no optimal selection (:func:`specfit.solvers.stop.selectable`): never predicted
        nor priced.
    nodes_verified : int
        Nodes verified (root included).
    accepted : int
        Draft tokens accepted.
    committed : int
        Tokens committed: accepted + the bonus token (this cycle's τ).
    expected_tokens : float
        A(S) of the selection (with calibrated acceptance for calibrated methods).
    expected_tokens_raw : float
        A(S) from the draft's raw path probabilities.
    predicted_ms : float
        T(S), ms: the whole cycle for calibrated methods (the draft levels' ``level_ms`` and the measured
        host ms, :meth:`SpecDecoder._level_ms`); for an AR step T(AR) of its measured counts.
    decision : str
        The policy's decision (:data:`specfit.engine.policy.Decision`): ``"draft"``; ``"ar"`` when it
        skipped drafting (SPECFIT.md §3, "The AR step as a candidate"); ``"explore"`` when it drafted only
        to measure drafting again; ``"shadow"`` for an AR step that drafted and selected a tree in its
        shadow (SPECFIT.md §3, "Drafting in the AR step's shadow").
    ar_step_ms : float
        The counterfactual AR step: T(root alone) with the root's true experts against the cache at the
        cycle's start, ms (calibrated methods, else 0).
    speedup_estimate : float or None
        The gate's measured speedup of drafting over AR, Ŝ, when it decided (None before any).
    predicted_new, true_experts, transferred : list of int, length L
        Per MoE layer: uncached experts the selector predicted for the verified subtree; distinct experts
        the verified nodes really routed to; experts the runtime copied host-to-device.
    draft_ms, predict_ms, tree_ms, solve_ms : float
        Measured ms: head forwards; the expert predictor's calls; the rest of each level's host work (tree
        building, calibration, pruning); the selection.
    verify_ms, transfer_ms, compute_ms, accept_ms : float
        Measured ms: the whole target forward; its H2D part (the expert cache's timer); ``verify_ms -
        transfer_ms``; acceptance and commit.
    host_cpu_ms : float
        CPU ms of the engine's thread on the host side of the cycle (predictor, tree, calibration, gate,
        solver; head and target forwards excluded), from :meth:`specfit.engine.clock.Clock.cpu`: unlike
        wall-clock ms it does not grow with other processes' load. With a counted clock
        (:class:`specfit.engine.clock.CountedClock`) the same parts priced from their counts instead.
    hidden_host_ms : float
        Host CPU ms the device hides (not in ``host_cpu_ms``; what exceeds each slot is): the work before
        the first draft level is read, while that level computes (up to the profile's ``draft_level_ms``);
        each level's work while the next computes (a drafter that launches ahead); the last cycle's
        learning while this cycle verifies (up to the shortest verify) (SPECFIT.md §3, "Host work hidden
        by the device").
    host_thread_ms : float
        This machine's measured CPU ms of the host work ``host_cpu_ms`` and ``hidden_host_ms`` stand for
        (the cycle's thread time up to its accept step less the forwards (head, target, reference), the
        accept step and the commit), from :meth:`specfit.engine.clock.Clock.thread`: reported, never decided on.
    ar_tokens_ms : float
        What plain AR decoding would have paid for this cycle's committed tokens that the output keeps (none
        past ``max_new_tokens``), one step each in its own expert cache (the AR twin, :mod:`specfit.engine.twin`; calibrated methods in the transfer regime
        with a runtime cache, on the cycles the online model learns from, else 0).
    host : dict
        Host and auto offload modes: per MoE layer the experts computed on the host (``"computed"``) and
        their (token, expert) rows (``"rows"``); empty in the transfer mode (in the auto mode
        ``transferred`` counts the experts it chose to copy).
    prefetch : dict
        With ``SpecDecoder(prefetch=True)``, per MoE layer the experts prefetched before the cycle's head
        forwards (``"experts"``; copies, not in ``transferred``) and those of them the verify used
        (``"used"``); empty otherwise, and then left out of :meth:`to_json`.
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
    host_thread_ms: float = 0.0
    ar_tokens_ms: float = 0.0
    host: dict = field(default_factory=dict)
    prefetch: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The record as a JSON object (field name → value); ``prefetch`` only when the engine prefetched."""
        out = asdict(self)
        if not out["prefetch"]:
            del out["prefetch"]
        return out


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
            *cal.kernel_tables(), self.parents, self.tokens, self.depth, self.raw, self.q, self.cal, self.pp,
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
    return DraftTree.of_arrays(np.full(1, -1, dtype=np.int64), np.ones(1), np.full(1, root, dtype=np.int64),
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


def verify_ms(cost: CostModel | HostProfile, num_nodes: int, uncached, routed=None, rows=None, copied=None) -> float:
    """Modeled ms of one verify (SPECFIT.md §3, T(S)): the one price the engine puts on a forward it
    learns from, a drafted verify, a shadow cycle's, an AR step and the AR twin's steps alike.

    Parameters
    ----------
    cost : CostModel or HostProfile
        The engine's cost model.
    num_nodes : int
        Tokens verified, root included (1 for an AR step).
    uncached : array_like of int, shape (L,)
        Experts per MoE layer the verify needs that the device does not hold: copied H2D (transfer
        mode), computed on the host (host and auto mode). Each costs its copy (or host compute) and its read.
    routed : array_like of int, shape (L,), optional
        Every expert the verified nodes route to per layer, |U_l(S)|: each is read once from device
        memory (``read_ms``), a host-computed one excepted. Default: ``max(uncached_l, experts_per_token)``,
        exact for one node.
    rows, copied : array_like of int, shape (L,), optional
        Host and auto mode: the host experts' (token, expert) rows (default one each) and the experts
        the auto mode copied H2D (default none).

    Raises
    ------
    SpecFitInputError
        If a count array's shape differs from ``uncached``'s."""
    if isinstance(cost, HostProfile):
        resident = None
        if routed is not None:  # the routed experts neither computed on the host nor copied: resident reads
            resident = np.asarray(routed, dtype=np.float64) - np.asarray(uncached, dtype=np.float64)
            if copied is not None:
                resident = resident - np.asarray(copied, dtype=np.float64)
            resident = np.maximum(resident, 0.0)
        return cost.cycle_ms(num_nodes, uncached, rows, copied, resident)
    return cost.cycle_ms(num_nodes, uncached, None, routed)


def _layer_counts(stats: dict, key: str) -> np.ndarray:
    return np.array([layer[key] for layer in stats["layers"]])


@dataclass
class CycleOutcome:
    """What one cycle hands back to the generation: its ``record``, the ``committed`` token ids (accepted
    draft tokens + bonus token), and for the drafter's commit the accepted path's target features
    ``aux_hidden`` (τ, 3H; None without a drafter) and its tokens ``path_tokens`` (the root first, τ of them)."""

    record: CycleRecord
    committed: list[int]
    aux_hidden: "torch.Tensor | None"
    path_tokens: list[int]


@dataclass
class _CycleState:
    """What the running cycle knows; made anew at each cycle's start.

    Attributes: ``cache`` the expert-cache mask (L, E) at the cycle's start (read once, None until
    read); ``root_new`` the root's predicted uncached experts per layer (L,); ``root`` the root-only tree
    with the cycle's cost model; ``untimed_s`` CPU s of head and reference forwards (not host work);
    ``predict_s`` wall s in the expert predictor; ``drafted`` the whole drafted tree (:class:`_Drafted`);
    ``level_host_ms`` host CPU ms in the draft levels; ``selected_depth`` the deepest verified node (0: the
    root alone); ``reference_verified`` whether the oracle's reference verified this cycle's tree;
    ``device_thread_s`` thread CPU s of the forwards and the accept step (left out of ``host_thread_ms``);
    ``root_experts`` the root's predicted experts (1, L, k) once predicted; ``prefetched`` per MoE layer the
    experts this cycle prefetched (None: no prefetch); ``ar_cache`` the cache mask before that prefetch;
    ``twin_demand`` ``(demand,)`` the lookahead demand the AR twin replays this cycle's tokens with (None:
    the twin's last one stays; :meth:`SpecDecoder._set_lookahead`).
    """

    cache: np.ndarray | None = None
    root_new: np.ndarray | None = None
    root: tuple | None = None
    untimed_s: float = 0.0
    predict_s: float = 0.0
    drafted: "_Drafted | None" = None
    level_host_ms: float = 0.0
    selected_depth: int = 0
    reference_verified: bool = False
    device_thread_s: float = 0.0
    root_experts: np.ndarray | None = None
    prefetched: list | None = None
    twin_demand: tuple | None = None
    ar_cache: np.ndarray | None = None


@dataclass
class _Carry:
    """What one cycle leaves the next, within one generation.

    Attributes: ``lam_tokens``, ``lam_ms`` the committed tokens and predicted ms so far (the rate mode's
    λ); ``unobserved`` committed ``(tokens, routing)`` int64 arrays the predictor has not observed yet;
    ``learning`` the last cycle's outcome, learned during the next verify (:class:`_Learning`);
    ``ar_next`` ``(Ŝ,)`` when the next cycle is an AR step decided ahead; ``twin_path`` the last cycle's
    committed forwards' routing (τ, L, k), not yet replayed in the AR twin, and ``twin_demand`` the lookahead
    demand it replays them with (:attr:`_CycleState.twin_demand`); ``budget`` the new tokens the
    generation still keeps before this cycle (``max_new_tokens`` less those committed), ``kept`` the
    last cycle's budget (at most that many of its committed tokens stay in the output); ``shadows`` the shadow cycles
    drafted whose outcome is not known yet (oldest first); ``copied`` whether the last forward copied an
    expert (an AR step drafts its lookahead only after one).
    """

    lam_tokens: float = 0.0
    lam_ms: float = 0.0
    unobserved: list = field(default_factory=list)
    learning: "_Learning | None" = None
    ar_next: tuple | None = None
    twin_path: np.ndarray | None = None
    twin_demand: tuple | None = None
    budget: int | None = None
    kept: int | None = None
    shadows: list = field(default_factory=list)
    copied: bool = True


@dataclass
class _Learning:
    """A cycle's outcome queued for the online model (:meth:`SpecDecoder._learn`, run while the next
    cycle's verify is on the device): its ``record``, the ``cache`` (L, E) at its start, the verify's
    ``routing`` (n, L, k), the root's predicted uncached experts ``root_new`` (L,) or None, the host CPU
    ms of its levels ``level_host_ms`` and of the rest ``rest_ms``, its ``selected_depth``, and whether
    it was a drafted cycle counted at its verify (``drafted_cycle``); ``ar_cache`` the cache before the
    cycle's prefetch (None: no prefetch), against which its counterfactual AR step is priced (an AR step has
    no idle window to prefetch in)."""

    record: CycleRecord
    cache: np.ndarray
    routing: np.ndarray
    root_new: np.ndarray | None
    level_host_ms: float
    selected_depth: int
    rest_ms: float
    drafted_cycle: bool
    ar_cache: np.ndarray | None = None


@dataclass
class _Growing:
    """The draft tree one cycle grows: the priced ``tree``, the ``cache`` its accounting uses (no layer
    axis when no expert is priced), the cycle's ``cost``, every ``drafted`` node, whether the kept nodes'
    experts are ``predicted`` (and with the head's hidden states, ``with_hidden``), whether experts are
    priced at all (``experts_known``), the kept levels ``pending`` until a selection needs their experts
    (one predictor call per solve, not per level), the priced node count ``n_tree`` and ``pp_sum`` ΣP."""

    tree: DraftTree
    cache: np.ndarray
    cost: CostModel
    drafted: "_Drafted"
    predicted: bool
    experts_known: bool
    with_hidden: bool
    n_tree: int
    pp_sum: float
    pending: list = field(default_factory=list)


@dataclass
class _StopRule:
    """The stop rule's and the pruning's terms for one cycle (ms; rates in tokens/s): the long-run
    ``rate`` (rate mode, else None), a level's ``level_ms``, the cycle's ``host_ms``, the per-node bound
    ``node_ms``, the rule's per-node ``stop_ms`` (:func:`specfit.solvers.stop.stop_node_ms`), T(root
    alone) ``root_ms`` (known: ``root_known``), whether to ``prune``, ``max_sunk`` (host ms and every
    level) and ``rate_lo`` the lower bound on R* the pruning uses."""

    rate: float | None
    level_ms: float
    host_ms: float
    node_ms: float | None
    stop_ms: float | None
    root_ms: float
    prune: bool
    max_sunk: float
    root_known: bool
    rate_lo: float = 0.0


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
        the cycles so far) instead of A/T (SPECFIT.md §3, "per-cycle ratio vs long-run rate"). With
        every expert resident it pays about 1% of modeled tok/s over the ratio (BENCHMARKS.md, "Engine
        mechanisms: what each pays").
    max_nodes : int, optional
        Verify-width budget passed to the selector.
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
        With 16 cache slots shadows pay about 1% of modeled tok/s over learning from real drafts
        (BENCHMARKS.md, "Engine mechanisms: what each pays").
    policy : str or DraftPolicy, optional
        Whether and how far each cycle drafts (:mod:`specfit.engine.policy`): ``"gate"`` (the calibrated
        methods' default: the AR gate on measured utility), ``"always"`` (the other methods' default) or
        ``"never"`` (every cycle an AR step). With ``online`` given, its policy is used and this must be None.
    clock : Clock, optional
        The clocks the engine reads (:mod:`specfit.engine.clock`; default the measured ones).
        :class:`~specfit.engine.clock.FrozenClock` makes every decision independent of the machine's timing.
    twin, stop_bounds, batch_predict : bool
        Mechanisms on by default, switched off one at a time to measure what each pays (``python -m
        specfit.eval.mechanisms``; BENCHMARKS.md, "Engine mechanisms: what each pays"); outputs are lossless
        either way. ``twin``: the gate prices AR steps on an AR twin of the expert cache (:meth:`_sync_twin`;
        False: against the engine's cache, τ AR steps, and no shadow cycles). ``stop_bounds``: the stop rule
        predicts and solves a level only where its two bounds let it fire (:meth:`_stop_rule`; False: at every
        level). ``batch_predict``: the expert predictor runs once per solve for the levels drafted since
        (:meth:`_grow`; False: once per draft level, as it is drafted).

    Attributes
    ----------
    method, target, drafter, predictor, reference, online, policy, clock
        As given (``policy``: the online model's for a calibrated method).
    mechanisms : Mechanisms
        ``prefetch``, ``stop_bounds`` and ``batch_predict`` as given.
    sampling : specfit.engine.verify.Sampling
        ``temperature``, ``top_p``, ``seed`` and the sampling verifier's generator.
    selecting : SelectionSettings
        ``tree``, ``cost``, the ``solver``, ``rate_mode`` and ``max_nodes`` (``tree``, ``cost`` and
        ``solver`` are also read as attributes of the decoder).

    Raises
    ------
    SpecFitInputError
        If the method needs a drafter, predictor or reference that is missing, or the drafter's
        ``aux_layer_ids`` differ from the target's ``aux_layers`` (the head would read the wrong
        features), or a ``policy`` the method cannot take.
    """

    def __init__(self, target, drafter=None, method: Method | str = "specfit", *, tree: TreeSettings = TreeSettings(),
                 cost: CostModel | None = None, predictor=None, reference=None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, rate_mode: bool = False, max_nodes: int | None = None,
                 online: OnlineModel | None = None, shadows: bool = True, policy: str | DraftPolicy | None = None,
                 clock: Clock | None = None, prefetch: bool = False, twin: bool = True, stop_bounds: bool = True,
                 batch_predict: bool = True):
        self.method = get_method(method) if isinstance(method, str) else method
        m = self.method
        if m.needs_drafter and drafter is None:
            raise SpecFitInputError("drafter", f"method {m.name} drafts {'a tree' if m.drafts else 'a lookahead draft'} "
                                    "and needs a drafter")
        if m.cost_aware and cost is None:
            raise SpecFitInputError("cost", f"method {m.name} selects under the cost model and needs one")
        if m.needs_predictor and predictor is None:
            raise SpecFitInputError("predictor", f"method {m.name} needs an expert predictor")
        if m.needs_reference and reference is None:
            raise SpecFitInputError("reference", "method oracle needs a reference target for the true routing")
        sampling = Sampling(temperature, top_p, seed)  # refuses a temperature < 0
        head_aux, target_aux = getattr(drafter, "aux_layer_ids", None), getattr(target, "aux_layers", None)
        if m.needs_drafter and head_aux is not None and target_aux is not None and tuple(head_aux) != tuple(target_aux):
            raise SpecFitInputError("aux_layers", f"the head reads target features after layers {tuple(head_aux)} "
                                    f"(its aux_layer_ids) but the target returns layers {tuple(target_aux)} (its "
                                    f"aux_layers); load the target with aux_layers={tuple(head_aux)}")
        self.target, self.drafter, self.predictor, self.reference = target, drafter, predictor, reference
        self.sampling = sampling  # greedy or lossless sampling, with its generator
        solver = None
        if m.selector:  # a selector blind to the cost verifies a fixed-size tree: EAGLE's total_tokens
            options = {} if m.cost_aware else {"total_tokens": tree.total_tokens}
            params = inspect.signature(solver_class(m.selector)).parameters
            if "max_visits" in params:  # a limit that stops every machine at the same search node
                options["max_visits"] = self.SOLVE_MAX_VISITS
            elif "time_limit_s" in params:
                options["time_limit_s"] = self.SOLVE_TIME_LIMIT_S
            solver = get_solver(m.selector, **options)
        self.selecting = SelectionSettings(tree, cost, solver, rate_mode, max_nodes)
        if m.drafts:  # a drafted tree's coverage accounting and the stop rule's bound run compiled: compiled, or
            from specfit.core.kernels import item_words_kernel, ratio_bound_kernel  # loaded from numba's cache, here,

            item_words_kernel()  # so that no cycle pays it
            ratio_bound_kernel()
        if online is not None and policy is not None:
            raise SpecFitInputError("policy", "give it to the OnlineModel (OnlineModel(depth, policy)), not both")
        if not m.calibrated and policy is not None and make_policy(policy).name == "gate":
            raise SpecFitInputError("policy", f"the gate learns from calibrated methods; {m.name} takes "
                                    "'always' or 'never'")
        #: What the engine learns online (calibrated methods only), and its calibrated acceptance.
        self.online = ((online if online is not None else OnlineModel(tree.depth, policy or "gate"))
                       if m.calibrated else None)
        #: Whether and how far each cycle drafts (the online model's for a calibrated method).
        self.policy = self.online.policy if self.online is not None else make_policy(policy or "always")
        self.clock = clock if clock is not None else MeasuredClock()
        self._now = _CycleState()  # what the running cycle knows (made anew by each cycle)
        self._carry = _Carry()  # what one cycle leaves the next
        self._calls = (None,)  # the predictor's calls (_predictor_calls), made on the first prediction
        self._twin = _TwinState(bool(shadows), bool(twin))  # the AR twin, made at the first generation that can have one
        if not isinstance(prefetch, (bool, np.bool_)):
            raise SpecFitInputError("prefetch", f"must be True or False, got {prefetch!r}")
        #: The switched mechanisms: prefetch while the head drafts (:meth:`_prefetch_root`), the stop rule's
        #: bounds, the predictor batched per solve.
        self.mechanisms = Mechanisms(bool(prefetch), bool(stop_bounds), bool(batch_predict))

    @property
    def tree(self) -> TreeSettings:
        """The draft-tree settings (:attr:`selecting`)."""
        return self.selecting.tree

    @property
    def cost(self) -> CostModel | HostProfile | None:
        """The cost model of the selection (:attr:`selecting`)."""
        return self.selecting.cost

    @property
    def solver(self):
        """The selector (:mod:`specfit.solvers`; None for ``ar``) (:attr:`selecting`)."""
        return self.selecting.solver

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer of the target (``target.spec.num_experts``)."""
        return int(self.target.spec.num_experts)

    @property
    def acceptance(self):
        """The online model's calibrated acceptance (:class:`~specfit.core.acceptance.AcceptanceCalibrator`);
        None for a method that is not calibrated."""
        return self.online.acceptance if self.online is not None else None

    #: Per solve, search nodes of a branch and bound (the exact solver under budgets or in the host regime,
    #: where rare trees took seconds in the grid); past it the solver returns the best selection found so
    #: far (SPECFIT.md §3). Deterministic, unlike a wall-clock limit: the same selection on any machine.
    #: About 5 ms of this VM's Python (~10 µs a node on the oracle's 85-node trees); a verify is 3-100 ms.
    SOLVE_MAX_VISITS = 500
    #: Per solve, for a selector with a time limit and no node limit (``cpsat``), seconds.
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
        t0 = self.clock.wall()
        drafter_ready = self._prefill(prompt)
        t1 = self.clock.wall()
        root, new, cycles = prompt[-1], [], []
        while len(new) < max_new_tokens and not (eos_id is not None and eos_id in new):
            self._carry.budget = max_new_tokens - len(new)
            out = self._cycle(root, drafter_ready)
            if self.drafter is not None:  # the drafter's commit of the accepted path
                if drafter_ready:
                    self.drafter.commit(torch.tensor(out.path_tokens), out.aux_hidden)
                else:
                    self.drafter.prefill(torch.tensor(out.path_tokens), out.aux_hidden)
                    drafter_ready = True
            cycles.append(out.record)
            new += out.committed
            root = out.committed[-1]
        self._finish(cycles)
        if eos_id is not None and eos_id in new:
            new = new[:new.index(eos_id) + 1]
        return Generation(new[:max_new_tokens], cycles, self.clock.wall() - t1, t1 - t0)

    def _prefill(self, prompt: list[int]) -> bool:
        """Reset the target (and the reference), prefill every prompt token but the last (the first
        cycle's root) into the target, the reference, the predictor and the drafter, and sync the AR twin;
        whether the drafter holds the prompt (False for a one-token prompt: the first cycle drafts nothing)."""
        self._carry.lam_tokens = self._carry.lam_ms = 0.0
        self._carry.copied = True  # the prefill copied the prompt's experts
        for t in (self.target, self.reference):
            if t is not None:
                t.reset()
        if hasattr(self.target.cache, "set_lookahead"):  # no demand left from the last generation's tree
            self.target.cache.set_lookahead(None)
        drafter_ready = False
        self._carry.unobserved.clear()
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
        self._carry.shadows.clear()
        self.policy.set_resident(bool(_cache_mask(self.target, self.num_experts).all()))
        if self.online is not None:  # an AR step carries a shadow cycle only where the twin prices its tokens
            self._twin.can_shadow = (self._twin.shadows and self._twin.cache is not None and self.drafter is not None
                                     and isinstance(self.cost, CostModel) and self.method.level_by_level)
            self._set_shadowing()
        return drafter_ready

    def _finish(self, cycles: list[CycleRecord]) -> None:
        """End a generation: run the learning still queued (booked as the last cycle's host time: no
        verify is left to hide it behind) and forget the shadow cycles whose outcome will never be known."""
        if self._carry.learning is None:  # nothing reads the last cycle's AR twin ms; the next prefill syncs the twin
            self._carry.twin_path = self._carry.kept = None
        if self.online is not None and (self.online.deferred or self._carry.learning) and cycles:
            c0, th0 = self.clock.cpu(), self.clock.thread()  # left to hide them behind
            self.online.flush()
            self._learn_last_cycle()
            cycles[-1].host_cpu_ms += (self.clock.cpu() - c0) * 1e3
            cycles[-1].host_thread_ms += (self.clock.thread() - th0) * 1e3
        if self._carry.shadows:  # their continuation ends here: never resolved
            self.policy.drop_shadows(len(self._carry.shadows))
            self._carry.shadows.clear()

    def _cycle(self, root: int, drafter_ready: bool) -> "CycleOutcome":
        """One cycle, in the order things happen: decide, draft level by level with the stop rule
        (predicting and selecting as the rule asks), verify the selection in one target forward (the
        root alone for an AR step) with the last cycle's learning behind it, accept a root path and a
        bonus token, commit, record. Returns the cycle's :class:`CycleOutcome`."""
        rec, now = CycleRecord(), _CycleState()
        self._now = now
        stats0 = self.target.cache.stats()
        th0 = self.clock.thread()
        c0 = self.clock.cpu()
        self.clock.charge("cycle")
        # decide → draft → predict → select (an AR step decided in the last learning slot skips drafting)
        ahead = self._carry.ar_next is not None and drafter_ready
        tree = selection = items = shadow = None
        if ahead:
            rec.decision = "ar"  # (consumed, with its Ŝ then recorded, in the learning slot below)
        elif self.method.drafts and drafter_ready:
            tree, selection, items = self._draft_and_select(root, None, rec)
        if rec.decision == "shadow" and selection is not None:  # an AR step; the tree is learned from later
            shadow, selection = self._shadow_of(tree, selection, items, rec), None
        # the verify's inputs: the selected subtree, or the root alone (host work the verify's launch waits for)
        keep, sub_tokens, sub_parents = [0], [root], [-1]
        if selection is not None:
            keep = list(selection.nodes)
            sub_tokens, sub_parents = _verify_inputs(tree, keep)
        self._set_lookahead(tree, keep, root, rec, drafter_ready)  # host work of the cycle, timed with it
        rec.host_cpu_ms += (self.clock.cpu() - c0 - now.untimed_s) * 1e3  # (+ the learning's unhidden part)
        rec.predict_ms = now.predict_s * 1e3
        shadow_host_ms = 0.0
        if shadow is not None:  # the shadow's host work runs while the device computes the AR step (below)
            shadow_host_ms, rec.host_cpu_ms, rec.hidden_host_ms = rec.host_cpu_ms + rec.hidden_host_ms, 0.0, 0.0
        drafted = now.drafted if selection is not None else None
        if selection is not None:
            rec.expected_tokens, rec.predicted_ms = selection.expected_tokens, selection.predicted_ms
            raw = drafted.raw[drafted.full_ids[keep[1:]]]  # the draft's own path probabilities
            rec.expected_tokens_raw = 1.0 + float(raw.sum())
            rec.predicted_new = items.new_per_layer(keep).tolist()
        # verify, the last cycle's learning in its shadow (on a GPU the verify is launched first)
        learn_s = self._learning_slot(rec, tree if selection is not None else None, items, ahead)
        t0, d0 = self.clock.wall(), self.clock.thread()
        out = self.target.verify(torch.tensor(sub_tokens), sub_parents)
        rec.verify_ms = (self.clock.wall() - t0) * 1e3
        if learn_s:
            hidden = min(learn_s * 1e3, self._shortest_verify_ms())
            rec.host_cpu_ms += learn_s * 1e3 - hidden
            rec.hidden_host_ms += hidden
        # accept a root path and a bonus token; commit
        t0 = self.clock.wall()
        acc = self.sampling.accept(sub_tokens, sub_parents, out.logits)
        self.target.commit(acc.path)
        now.device_thread_s += self.clock.thread() - d0  # the verify, the accept step and the commit
        if self.acceptance is not None and drafted is not None and drafted.n > 1:
            self._queue_acceptance_learning(rec, drafted, keep, acc, sub_parents)
        d0 = self.clock.thread()
        self._commit_reference(keep, acc, sub_tokens, sub_parents)
        now.device_thread_s += self.clock.thread() - d0
        rec.accept_ms = (self.clock.wall() - t0) * 1e3
        rec.host_thread_ms = (self.clock.thread() - th0 - now.device_thread_s) * 1e3  # the host work up to here
        # record
        routing = out.routing.numpy()
        if now.prefetched is not None:  # which prefetched experts the verified nodes routed to
            rec.prefetch["used"] = [len(set(ids).intersection(routing[:, layer].ravel().tolist()))
                                    for layer, ids in enumerate(now.prefetched)]
        self._observe_committed(sub_tokens, acc, routing)
        self._record_verify(rec, stats0, routing, keep, acc)
        self._carry.copied = sum(rec.transferred) > 0
        if rec.decision in ("ar", "shadow") and self.cost is not None:  # T(AR) of its counts: the rate mode's λ
            rec.predicted_ms = verify_ms(self.cost, 1, *self._uncached(rec)) + self._prefetch_ms(rec)
            if self._twin.can_shadow:  # its H2D ms: what the next shadows' head forwards hide behind
                self.policy.observe_ar_h2d(rec.predicted_ms - verify_ms(self.cost, 1, np.zeros(len(rec.transferred)),
                                                                        rec.true_experts))
                self._set_shadowing()
        if shadow is not None:  # up to the AR step's modeled ms less what it already hides
            hidden = min(shadow_host_ms, max(rec.predicted_ms - rec.hidden_host_ms, 0.0))
            rec.hidden_host_ms += hidden
            rec.host_cpu_ms += shadow_host_ms - hidden
        self._continue_shadows(shadow, routing, acc)
        self._queue_learning(rec, routing)
        self._carry.lam_tokens += rec.committed
        self._carry.lam_ms += rec.predicted_ms
        aux = out.aux_hidden[acc.path] if self.drafter is not None else None  # only a drafter reads them
        return CycleOutcome(rec, acc.new_tokens, aux, [sub_tokens[v] for v in acc.path])

    def _set_lookahead(self, tree: DraftTree | None, keep: list, root: int = -1, rec: CycleRecord | None = None,
                       drafter_ready: bool = False) -> None:
        """Give a lookahead expert cache (``cache.policy.uses_lookahead``) the predicted demand of the
        tokens after this cycle's verify: :func:`~specfit.core.lookahead.tree_expert_demand` of the drafted
        ``tree`` less the verified nodes ``keep`` (a shadow cycle verifies the root alone: every other
        node counts), each node's predicted experts weighted by its path probability (calibrated for a
        calibrated method). An AR step without a tree drafts a lookahead draft below ``root`` where the
        method has one (``Method.lookahead_levels``; :meth:`_lookahead_chain`, its head forwards in
        ``rec``) and the last forward copied an expert (after a forward that copied none the step likely
        evicts nothing, and the draft would be paid in full: its head forwards hide behind copies), else
        keeps the last tree's demand (its nodes still predict the next tokens); a tree
        without predicted experts clears it (the base policy's eviction). Timing only, never outputs.

        The AR twin (a lookahead cache: ``ar+lookahead``'s) replays the cycle's committed tokens with the
        AR step's lookahead draft, or with the whole ``tree`` (its verified nodes are the tokens after the
        root: :mod:`specfit.engine.twin`)."""
        cache = self.target.cache
        if not self._looks_ahead():
            return
        twin = self._twin.cache is not None
        if tree is None:  # an AR step without a tree: its lookahead draft, or the last tree's demand
            slots = getattr(cache, "slots", None)
            if (self.method.lookahead_levels and drafter_ready and rec is not None and self.predictor is not None
                    and self._carry.copied and isinstance(slots, (int, np.integer)) and 0 < slots < self.num_experts):
                demand = self._lookahead_chain(root, rec)
                cache.set_lookahead(demand)
                self._now.twin_demand = (demand,) if twin else None
            return
        if tree.experts is None or tree.n <= len(keep) or tree.experts.shape[1] != cache.num_layers:
            cache.set_lookahead(None)
            self._now.twin_demand = (None,) if twin else None
        else:
            cache.set_lookahead(tree_expert_demand(tree, exclude=keep))
            self._now.twin_demand = (tree_expert_demand(tree),) if twin else None

    def _looks_ahead(self) -> bool:
        """Whether the target's expert cache evicts by a lookahead demand (``cache.policy.uses_lookahead``)."""
        return getattr(getattr(self.target.cache, "policy", None), "uses_lookahead", False)

    def _lookahead_chain(self, root: int, rec: CycleRecord) -> np.ndarray | None:
        """An AR step's lookahead: the head drafts ``Method.lookahead_levels`` levels below ``root``
        (``draft_levels(root, Method.lookahead_top_k, depth)``: a chain for top_k 1, else a small tree),
        the predictor predicts their nodes' experts, and :func:`~specfit.core.lookahead.expert_demand`
        weights them by the head's path probabilities P_v. Returns the (L, E) demand (None if the drafter
        yielded no level).

        The head forwards are ``rec.shadow_levels`` (priced like a shadow cycle's: they run while the AR
        step copies its experts, so only what exceeds its H2D ms is charged, eval/modeled.py) and the
        cycle's ``draft_ms``; the prediction and the demand are host work of the cycle."""
        depth = self.method.lookahead_levels
        uses_hidden = getattr(self.predictor, "uses_hidden", True)
        levels = self.drafter.draft_levels(root, self.method.lookahead_top_k, depth)
        tokens, pp, hidden = [], [], []
        for _ in range(depth):
            level = self._next_level(levels, rec)
            if level is None:
                break
            _, tok, p = _level_arrays(level)
            tokens.append(tok)
            pp.append(p)
            hidden.append(level.hidden.float().cpu().numpy() if uses_hidden and level.hidden is not None else None)
        levels.close()
        rec.shadow_levels += len(tokens)
        if not tokens:  # a drafter that yielded no level: no demand (the base policy's eviction)
            return None
        tokens = np.concatenate(tokens)
        h = np.concatenate(hidden) if hidden and all(x is not None for x in hidden) else None
        return expert_demand(np.clip(np.concatenate(pp), 0.0, 1.0), self._predict(tokens, h), self.num_experts)

    def _learning_slot(self, rec: CycleRecord, tree: DraftTree | None, items, ahead: bool) -> float:
        """The host work run while this cycle's verify is on the device, its thread CPU seconds: the last
        cycle's learning (:meth:`_learn_last_cycle`), the earlier verifies' acceptance learning
        (:meth:`OnlineModel.flush`), the next gate's inputs from this drafted ``tree`` (and the cache its
        accounting used, ``items.cache``), and after an AR step the policy's next decision made ahead."""
        learn_s = self._learn_last_cycle()
        if self.online is not None and self.online.deferred:
            c0 = self.clock.cpu()
            self.online.flush()
            learn_s += self.clock.cpu() - c0
        if self.online is not None and tree is not None and tree.n > 1:
            c0 = self.clock.cpu()
            self._prepare_gate(tree, items.cache)
            learn_s += self.clock.cpu() - c0
        if rec.decision in ("ar", "shadow"):  # the policy's next decision, its learning done
            c0 = self.clock.cpu()
            if ahead:  # this AR step, decided in the last slot: consumed now that it is launched
                rec.speedup_estimate = self._carry.ar_next[0]
                self.policy.take_ar_ahead()
            self.policy.decide_ahead()  # an AR step next: the next cycle's start reads a flag, as ar's start does
            self._carry.ar_next = (self.policy.speedup,) if self.policy.decided_ahead() == "ar" else None
            learn_s += self.clock.cpu() - c0
        return learn_s

    def _queue_acceptance_learning(self, rec: CycleRecord, drafted: "_Drafted", keep: list, acc,
                                   sub_parents: list) -> None:
        """Queue the verify's acceptance learning (:meth:`OnlineModel.defer`: it runs while the device
        computes the next verify), in the whole drafted tree's ids (pruned nodes too: they were drafted,
        only not priced); host work of the cycle, like the drafting's."""
        c0 = self.clock.cpu()
        full = drafted.full_ids[np.asarray(keep)]
        self._now.selected_depth = int(drafted.depth[full].max())
        self.online.defer(self._learn_acceptance, drafted, full, acc, sub_parents)
        rec.host_cpu_ms += (self.clock.cpu() - c0) * 1e3

    def _commit_reference(self, keep: list, acc, sub_tokens: list, sub_parents: list) -> None:
        """Keep the oracle's reference target's KV equal to the target's."""
        if self.reference is None:
            return
        if self._now.reference_verified:  # it verified the whole drafted tree: commit in its node ids
            self.reference.commit([keep[v] for v in acc.path])
        else:  # an AR step, or every expert resident (no true routing needed): mirror the verify
            self.reference.verify(torch.tensor(sub_tokens), sub_parents)
            self.reference.commit(acc.path)

    def _observe_committed(self, sub_tokens: list, acc, routing: np.ndarray) -> None:
        """Hand the committed tokens and their routing to the predictor (observed when it next predicts)
        and to the AR twin (replayed with the next learning, during the next verify)."""
        if self.predictor is not None:
            self._carry.unobserved.append((np.array([sub_tokens[v] for v in acc.path], np.int64),
                                     np.ascontiguousarray(routing[acc.path], np.int64)))
        self._carry.kept = self._carry.budget
        if self._twin.cache is not None:
            self._carry.twin_path, self._carry.twin_demand = routing[acc.path], self._now.twin_demand

    def _record_verify(self, rec: CycleRecord, stats0: dict, routing: np.ndarray, keep: list, acc) -> None:
        """The verify's counts into ``rec``: experts copied (and computed on the host), its H2D ms, the
        verified nodes' true experts, nodes verified, tokens accepted and committed."""
        stats1 = self.target.cache.stats()
        rec.transferred = [a["misses"] - b["misses"] for a, b in zip(stats1["layers"], stats0["layers"])]
        rec.transfer_ms = stats1["total"]["transfer_ms"] - stats0["total"]["transfer_ms"]
        if stats1.get("offload") in ("host", "auto"):
            rec.host = {k: (_layer_counts(stats1, f"host_{k}") - _layer_counts(stats0, f"host_{k}")).tolist()
                        for k in ("computed", "rows")}
        rec.compute_ms = max(rec.verify_ms - rec.transfer_ms, 0.0)
        n, L, k = routing.shape  # distinct experts per layer
        if n == 1:
            rec.true_experts = [len(set(row)) for row in routing[0].tolist()]
        else:  # 1 + the changes along each layer's sorted ids
            by_layer = np.sort(routing.transpose(1, 0, 2).reshape(L, n * k), axis=1)
            rec.true_experts = (1 + np.count_nonzero(np.diff(by_layer, axis=1), axis=1)).tolist()
        rec.nodes_verified = len(keep)
        rec.accepted = acc.accepted
        rec.committed = len(acc.new_tokens)

    def _continue_shadows(self, shadow: "_Shadow | None", routing: np.ndarray, acc) -> None:
        """Add this cycle's ``shadow`` to the pending ones and give each the committed forwards and tokens
        its outcome is resolved by."""
        if shadow is not None:
            self._carry.shadows.append(shadow)
        for sh in self._carry.shadows:
            sh.routing.extend(routing[acc.path])
            sh.tokens.extend(acc.new_tokens)

    def _queue_learning(self, rec: CycleRecord, routing: np.ndarray) -> None:
        """Queue this cycle's outcome for the online model (:meth:`_learn`, run during the next verify);
        a drafted cycle is counted by the policy now: its next decision reads it."""
        now = self._now
        if self.online is None or now.cache is None:
            return
        drafted_cycle = rec.decision != "ar" and rec.levels > 0 and now.root_new is not None
        if drafted_cycle:
            self.policy.observe_selection(rec.nodes_verified - 1, now.selected_depth)
        self._carry.learning = _Learning(rec, now.cache, routing, now.root_new, now.level_host_ms, now.selected_depth,
                                       rec.host_cpu_ms - now.level_host_ms, drafted_cycle, now.ar_cache)

    def _learn_acceptance(self, drafted: "_Drafted", full: np.ndarray, acc, sub_parents: list) -> None:
        """Teach the acceptance calibrator one verify: its Bernoulli trials (under greedy verification
        every drafted child of an accepted node, verified or not: :func:`greedy_trials`; else the
        verified ones: :func:`verify_trials`) and its path outcome (:meth:`AcceptanceCalibrator.observe_paths`).
        ``full``: the verified nodes' ids in ``drafted`` (root first); ``acc`` the verify's acceptance."""
        self.clock.charge("learn_node", drafted.n)
        if self.sampling.temperature == 0:
            n = drafted.n
            old, ok = greedy_trials(drafted.parents[:n], drafted.tokens[:n], full[acc.path], acc.bonus_token)
        else:
            nodes, ok = verify_trials(sub_parents, acc.path)
            old = full[nodes]
        self.acceptance.learn_verify(drafted.q[old], drafted.depth[old], np.asarray(ok, dtype=bool), drafted.rank[old],
                                      drafted.cal[full[1:]], drafted.depth[full[1:]], acc.accepted)  # as update, _observe_paths

    def _set_shadowing(self) -> None:
        """Let AR steps carry shadow cycles (:meth:`DraftPolicy.set_shadowing`) where the engine can resolve them
        (``_TwinState.can_shadow``: the AR twin, a transfer-regime cost, a level-by-level method) and the recent
        AR steps' modeled H2D ms hide a whole tree's head forwards (``depth * draft_level_ms``; before
        any AR step, assumed to): where they copy too little, a shadow's levels would be paid as a real
        cycle's, and learning drafts for real as before."""
        mean = self.policy.ar_h2d_ms()
        need = self.tree.depth * (self.cost.draft_level_ms or 0.0)
        self.policy.set_shadowing(bool(self._twin.can_shadow and (mean is None or mean >= need)))

    def _shadow_of(self, tree: DraftTree, selection, items, rec: CycleRecord) -> _Shadow:
        """Keep this cycle's drafted tree and selection as a shadow cycle (``rec.decision == "shadow"``):
        the cycle verifies the root alone, and what the selection would have committed and cost is learned
        once decoding has committed the tokens after its root (:meth:`_resolve_shadow`). Its head forwards
        move to ``rec.shadow_levels``: on a GPU they run while the AR step copies its experts."""
        d, keep = self._now.drafted, np.asarray(selection.nodes, dtype=np.int64)
        experts = tree.experts[keep] if tree.num_layers else np.zeros((keep.size, 0, 0), dtype=np.int64)
        sh = _Shadow(d, d.full_ids[keep], np.array(experts), np.array(items.cache, dtype=bool), rec.levels,
                     rec.levels_ahead)
        rec.shadow_levels, rec.levels, rec.levels_ahead = rec.levels + rec.levels_ahead, 0, 0
        self.policy.observe_shadow_selection(keep.size - 1)
        return sh

    def _resolve_shadows(self) -> None:
        """Learn every pending shadow cycle whose outcome is known now (oldest first); keep the others."""
        self._carry.shadows = [sh for sh in self._carry.shadows if not self._resolve_shadow(sh)]

    def _resolve_shadow(self, sh: _Shadow) -> bool:
        """Learn one shadow cycle if decoding has committed enough tokens after its root; False if not yet.

        Its outcome is the verify's (:func:`shadow_outcome`): the calibrator learns every drafted child of
        an accepted node (:func:`greedy_trials` along the committed continuation) and the path correction
        from the selection's nodes and the draft tokens it would have accepted. Its counterfactual T_d is
        a drafted cycle's (:meth:`_drafted_cycle_ms`) with the verify priced on the true experts of the
        forwards it would have committed (the committed ones: the same prefix routes the same way) and the
        predicted experts of its other nodes against the cache its selection saw, each of those
        charged the predictor's learned node correction; T_AR is the AR twin's for the same τ tokens.
        Both go to Ŝ_sh (:meth:`UtilityGate.observe_shadow`)."""
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
        self.clock.charge("learn_node", n)
        old, ok = greedy_trials(d.parents[:n], d.tokens[:n], path, bonus)
        self.acceptance.learn_verify(d.q[old], d.depth[old], np.asarray(ok, dtype=bool), d.rank[old],
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
        extra = int(rejected.sum()) * self.online.node_correction_ms(self.cost)
        cycle_ms = (verify_ms(self.cost, int(sh.selected.size), counts, needed.sum(axis=1)) + extra
                    + sh.levels * self._level_ms()
                    + sh.levels_ahead * (self.cost.draft_level_ms or 0.0) + self.online.host_cycle_ms())
        self.policy.observe_shadow(draft_nodes=int(sh.selected.size) - 1, cycle_ms=cycle_ms,
                                   ar_tokens_ms=float(sum(sh.ar_ms[:tau])))
        return True

    def _learn_last_cycle(self) -> float:
        """Run the last cycle's :meth:`_learn` if it is still queued; its thread CPU seconds (0 if none).

        A cycle's outcome is learned while the next cycle's verify runs on the device (SPECFIT.md §3,
        "Whole-cycle objective"): up to :meth:`_shortest_verify_ms` of it is hidden there
        (``rec.hidden_host_ms``), so the next cycle's gate and selection see the online model one
        cycle late. Deferring pays the learning's host ms off the critical path, up to the shortest verify
        per cycle (part of the hidden host ms, (BENCHMARKS.md, "Engine mechanisms: what each pays"))."""
        if self._carry.learning is None and self._carry.twin_path is None:
            return 0.0
        args, self._carry.learning = self._carry.learning, None
        c0 = self.clock.cpu()
        self.clock.charge("learn")
        twin_ms = self._replay_twin()
        if self._carry.shadows:
            self._resolve_shadows()
        if args is not None:
            self._learn(args, twin_ms)
            online = self.online
            if online.root_weight and isinstance(self.cost, CostModel):  # the next corrected cost's terms, here
                online.weighted_corrections(missed_expert_ms(self.cost, online.root_error.size))
        return self.clock.cpu() - c0

    def _sync_twin(self) -> None:
        """After a prefill: give the AR twin the runtime cache's state (made, or made again, for the
        cache the target holds now: its slots and policy).

        Only a calibrated method in the transfer regime whose runtime cache reports its eviction state
        (:meth:`DeviceExpertCache.recency`), holds 0 or at least ``top_k`` slots but not every expert,
        and evicts by LRU, LFU or a lookahead on either (the twin then is ``ar+lookahead``'s cache) gets one; the gate's counterfactual is otherwise the root's AR step
        against the engine's cache, τ times. (With fewer slots than a token's experts the runtime copies
        a forward's experts in rounds, which the twin does not replay exactly.)"""
        self._carry.twin_path = None
        if self.online is None or not self._twin.wanted:  # no gate: nothing reads the twin; or none wanted
            return
        cache = getattr(self.target, "cache", None)
        slots = getattr(cache, "slots", None)
        policy = getattr(getattr(cache, "policy", None), "name", None)
        key = (id(cache), slots, policy)
        twin = self._twin
        if twin.cache is None or twin.key != key:
            twin.cache, twin.key = None, key
            k = int(getattr(getattr(self.target, "spec", None), "top_k", self.num_experts))
            ok = (hasattr(cache, "recency") and policy in ("lru", "lfu", "lookahead", "lookahead-lfu")
                  and getattr(self.target, "offload", "transfer") == "transfer"
                  and isinstance(slots, (int, np.integer)) and (slots == 0 or k <= slots < self.num_experts))
            if not ok:
                return
        state = cache.recency()
        if twin.cache is None:
            twin.cache = ARTwinCache(len(state[0]), self.num_experts, slots, policy)
        twin.cache.sync(*state)
        twin.cache.set_lookahead(None)  # the engine's cache has no demand at a generation's start

    def _replay_twin(self) -> float | None:
        """Step the AR twin through the last cycle's committed forwards (every cycle's, AR steps the
        online model does not learn from included: :meth:`_learn_last_cycle` runs each cycle).

        Under a lookahead cache the twin evicts by the cycle's lookahead demand (:meth:`_set_lookahead`);
        the lookahead draft's head forwards are not in its ms (hidden behind the copies at 16-32 slots,
        eval/modeled.py).

        Returns
        -------
        float or None
            ms plain AR decoding would have paid for the last cycle's committed tokens that the output
            keeps (one-token steps, each priced by the cost's ``cycle_ms`` on the twin's misses; tokens
            past ``max_new_tokens`` gain nothing); None without a twin.
        """
        if self._carry.twin_path is None:
            return None
        path, self._carry.twin_path = self._carry.twin_path, None
        kept, self._carry.kept = self._carry.kept, None  # None: every token of the path is kept
        if self._carry.twin_demand is not None:
            self._twin.cache.set_lookahead(self._carry.twin_demand[0])
        self._carry.twin_demand = None
        ms = [self._ar_step_ms(self._twin.cache.step(r)) for r in path]
        for sh in self._carry.shadows:  # each forward's AR ms, in order, for the shadows it continues
            if len(sh.ar_ms) < len(sh.routing):
                sh.ar_ms.extend(ms[:len(sh.routing) - len(sh.ar_ms)])
        return sum(ms[:kept])  # the tokens past max_new_tokens are dropped: no gain

    def _shortest_verify_ms(self) -> float:
        """The cost model's shortest verify, ms: the root alone with every expert cached."""
        return float(verify_ms(self.cost, 1, ()))

    def _learn(self, c: "_Learning", ar_tokens_ms: float | None = None) -> None:
        """Teach the online model one cycle's outcome ``c``: the root's true against predicted uncached
        experts, and for a drafted cycle its time (:meth:`_drafted_cycle_ms`) against plain AR decoding's
        for its committed tokens (:meth:`OnlineModel.observe`). ``ar_tokens_ms``: AR decoding's ms for the
        committed tokens in the AR twin's cache (:meth:`_replay_twin`), None without a twin: then τ AR
        steps of the root in the engine's cache."""
        rec, cache, routing, root_new = c.record, c.cache, c.routing, c.root_new
        layer = np.arange(cache.shape[0])[:, None]
        root_true = (~cache[layer, routing[0]]).sum(axis=1)  # (L,) the root's true uncached experts
        rec.ar_step_ms = self._ar_step_ms(root_true if c.ar_cache is None else (~c.ar_cache[layer, routing[0]]).sum(axis=1))
        if ar_tokens_ms is not None:
            rec.ar_tokens_ms = ar_tokens_ms
        if rec.decision != "ar" and rec.levels:
            self.online.observe_host(rec.levels, c.level_host_ms, c.rest_ms)
        if root_new is None:
            return
        if not c.drafted_cycle:
            self.online.observe(root_predicted_new=root_new, root_true_new=root_true)
            return
        predicted = rec.predicted_new if len(rec.predicted_new) == root_true.size else np.zeros(root_true.size)
        counts = self._uncached(rec)
        uncached = np.add(rec.host["computed"], rec.transferred) if rec.host else rec.transferred  # host + copied
        self.online.observe(root_predicted_new=root_new, root_true_new=root_true,
                            selected_predicted_new=predicted, transferred=uncached,
                            draft_nodes=rec.nodes_verified - 1, committed=min(rec.committed, self._carry.kept or rec.committed),
                            cycle_ms=self._drafted_cycle_ms(rec, counts), ar_ms=rec.ar_step_ms,
                            ar_tokens_ms=ar_tokens_ms, selected_depth=c.selected_depth, counted=True)

    def _drafted_cycle_ms(self, rec: CycleRecord, counts: tuple) -> float:
        """T_d of a drafted cycle for Ŝ, ms: its verify priced on the measured ``counts``, its draft
        levels at :meth:`_level_ms` and :meth:`OnlineModel.host_cycle_ms`: the host ms the selection
        charges, decayed means that already hold this cycle's measurement. This cycle's raw CPU time
        alone made the gate chaotic at break-even (the same run drafted 49% to 77% of its cycles; see
        docs/SPECFIT.md §3)."""
        verify = verify_ms(self.cost, rec.nodes_verified, *counts) + self._prefetch_ms(rec)
        return (verify + rec.levels * self._level_ms() + rec.levels_ahead * (self.cost.draft_level_ms or 0.0)
                + self.online.host_cycle_ms())

    @staticmethod
    def _uncached(rec: CycleRecord) -> tuple:
        """The verify's measured counts per layer, the arguments of :func:`verify_ms` after the node
        count: the uncached experts (transfer mode: copied; host and auto mode: computed on the host),
        every expert the verified nodes routed to (``rec.true_experts``), and in host and auto mode the
        host experts' (token, expert) rows and the experts copied (0 in the host mode)."""
        if rec.host:
            return rec.host["computed"], rec.true_experts, rec.host["rows"], rec.transferred
        return rec.transferred, rec.true_experts

    def _ar_step_ms(self, root_true: np.ndarray) -> float:
        """T of this cycle's counterfactual AR step, whose root needs ``root_true`` uncached experts
        per layer, shape (L,) (one row each): in the auto offload mode the split of
        :meth:`HostProfile.split` the runtime would choose, otherwise the cost's ``cycle_ms``."""
        if getattr(self.target, "offload", "transfer") == "auto" and isinstance(self.cost, HostProfile):
            return self.cost.split_cycle_ms(1, [[1] * int(u) for u in root_true])
        return verify_ms(self.cost, 1, root_true)  # one node: it reads its top_k experts per layer

    def _draft_and_select(self, root: int, cache: np.ndarray | None, rec: CycleRecord):
        """Decide, then grow the draft tree level by level and select its verified subtree.

        For a calibrated method the tree carries calibrated path probabilities (the raw ones, and
        every drafted node, are kept in the cycle's :class:`_Drafted`), the levels drafted so far are a
        cost of the cycle (whole-cycle objective) and the policy may skip drafting (SPECFIT.md §3). For
        a level-by-level method with an exact selector the tree holds only the drafted nodes that can
        belong to an optimal selection (:func:`specfit.solvers.stop.selectable`).

        A calibrated method drafts at most ``max(n - 1, 1)`` levels when ``n`` new tokens remain before
        ``max_new_tokens`` (deeper levels add only tokens the output drops; docs/SPECFIT.md §3, "Measured utility").

        Returns ``(tree, selection, items)``: the :class:`DraftTree` drafted, the
        :class:`~specfit.solvers.Selection` and the tree's coverage accounting against ``cache``;
        ``(None, None, None)`` when the policy took the AR step.
        """
        self._now.root = None  # built at most once in this call (_root_tree)
        depth = self.policy.draft_depth(self.tree.depth)  # the warm-up's cap
        if self.online is not None and self._carry.budget is not None:  # levels past the output's end gain nothing
            depth = min(depth, max(self._carry.budget - 1, 1))
        launched = self._decide_and_launch(root, cache, rec, depth)
        if launched is None:
            return None, None, None
        levels, first, behind = launched
        predict_s0 = self._now.predict_s  # the predictor's calls below are predict_ms, not tree_ms
        g, rule = self._start_drafting(root, cache, rec, depth)
        self._hide_behind_first_level(rec, behind)
        now = self._now
        u_levels, untimed0 = self.clock.cpu(), now.untimed_s  # the levels' host work, for the online model
        # a drafter that launches each level before the one above it is read (Eagle3Drafter.launches_ahead):
        # each level's host work runs while the next level's forward is on the device (_hide_behind_levels)
        level_host, body, selection = [], None, None  # host CPU s of each level's work; (cpu s, untimed s) at its start
        while True:
            if body is not None:
                level_host.append(self.clock.cpu() - body[0] - (now.untimed_s - body[1]))
                body = None
            level = self._next_level(levels, rec) if rec.levels else first
            if level is None:  # the levels ended: a selection of this level's tree and sunk ms, if any, stands
                break
            selection = None  # a new level was paid: an earlier selection's sunk ms is stale
            rec.levels += 1
            body = (self.clock.cpu(), now.untimed_s)
            p_f = self._add_level(level, g, rule, rec)
            if p_f is None:  # every deeper node descends from a dropped one: in no optimal selection either
                break
            if self.method.oracle and g.experts_known:  # the true routing, outside the timed path
                self._route_truly(g, rule, rec)
            if self.method.level_by_level and rec.levels < depth:
                stop, selection = self._stop_rule(g, rule, p_f, rec)
                if stop:
                    break
        if body is not None:
            level_host.append(self.clock.cpu() - body[0] - (now.untimed_s - body[1]))
        u_end, untimed_end = self.clock.cpu(), now.untimed_s
        levels.close()
        self._grow(g.tree, g.pending, g.predicted, rec)
        now.level_host_ms = (self.clock.cpu() - u_levels - (now.untimed_s - untimed0)) * 1e3
        rec.nodes_drafted, rec.nodes_pruned = g.drafted.n - 1, g.drafted.n - g.tree.n
        rec.tree_ms = max(rec.tree_ms - (now.predict_s - predict_s0) * 1e3, 0.0)
        if selection is None:
            selection = self._select(g.tree, g.cache, rule.rate, rec, g.cost, rule.host_ms + rec.levels * rule.level_ms)
        items = g.tree.items(g.cache)
        if getattr(self.drafter, "launches_ahead", False):
            final_s = self.clock.cpu() - u_end - (now.untimed_s - untimed_end)
            self._hide_behind_levels(rec, level_host, final_s, depth)
        return g.tree, selection, items

    def _decide_and_launch(self, root: int, cache: np.ndarray | None, rec: CycleRecord, depth: int):
        """The policy's decision (recorded in ``rec``) and, to draft, the launched drafting: ``(levels,
        first level, (cpu s, untimed s) at its launch)``; None for an AR step.

        The first level is launched before the cycle's host work (the root's prediction, its cost, the
        gate's sound bound), which then runs while the device computes it (:meth:`_hide_behind_first_level`).
        The policy decides before the launch where it may take the AR step on measured utility alone
        (cheap, no root needed), or where the sound bound last said no draft can beat the AR step; else
        behind the launched level, whose forward is then paid even by an AR step (``rec.levels_ahead``).
        Launching first pays the root's prediction, its cost and the sound bound off the critical path, up to
        one draft level's ms per cycle (part of the hidden host ms, (BENCHMARKS.md, "Engine mechanisms: what each pays"))."""
        policy = self.policy
        speculate = policy.decided_ahead() is None and policy.asks_sound_bound() and policy.sound_said_draft()

        def decide() -> str:
            rec.speedup_estimate = policy.speedup
            rec.decision = policy.decide(lambda: self._sound_gate(root, self._cache_now(cache)))
            return rec.decision

        if not speculate and decide() == "ar":
            return None
        if self.mechanisms.prefetch:  # queued before the head's first forward is launched, so the copies overlap it
            self._prefetch_root(root, cache, rec, depth)
        levels = self.drafter.draft_levels(root, self.tree.top_k, depth)
        first = self._next_level(levels, rec)  # launched: on a GPU its forward (and the one after it) runs now
        behind = (self.clock.cpu(), self._now.untimed_s)  # the host work behind the first level starts here
        if speculate and decide() == "ar":  # asked behind the level (the root predicted there): the launch is paid
            self._hide_behind_first_level(rec, behind)
            levels.close()
            rec.levels_ahead = min(depth, 2) if getattr(self.drafter, "launches_ahead", False) else 1
            return None
        return levels, first, behind

    def _start_drafting(self, root: int, cache: np.ndarray | None, rec: CycleRecord, depth: int):
        """The cycle's root tree and cost (:class:`_Growing`) and the stop rule's constants (:class:`_StopRule`)."""
        m, ts, now = self.method, self.tree, self._now
        self.clock.charge("drafted")
        cache = self._cache_now(cache)
        rate = 1000.0 * self._carry.lam_tokens / self._carry.lam_ms if self.selecting.rate_mode and self._carry.lam_ms > 0 else None
        # every expert resident and no read priced: no node brings an expert cost, so none is predicted
        experts_known = m.needs_experts and not self._expertless(cache)  # predicted, or (oracle) the true routing
        predicted = m.needs_predictor and experts_known
        t0 = self.clock.wall()
        if predicted:  # the gate may have built it already
            tree, cost = self._root_tree(root, cache)
        else:  # the oracle's experts: a placeholder until the true routing is known
            experts = np.zeros((1, cache.shape[0], int(self.target.spec.top_k)), dtype=np.int64) if experts_known else None
            tree = _root_only(root, experts, self.num_experts)
            cost = self._cycle_cost(tree, cache) if experts_known else self.cost
        rec.tree_ms += (self.clock.wall() - t0) * 1e3
        now.drafted = _Drafted.of_root(root, 1 + sum(ts.level_width(j) for j in range(1, ts.depth + 1)))
        if not experts_known:  # no expert term: an empty layer axis
            if m.needs_experts:  # all resident: the root brings none either
                now.root_new = np.zeros(cache.shape[0], dtype=np.int64)
            cache = np.zeros((0, self.num_experts), dtype=bool)
        g = _Growing(tree, cache, cost, now.drafted, predicted, experts_known,
                     with_hidden=predicted and getattr(self.predictor, "uses_hidden", True),  # gathered for a reader
                     n_tree=tree.n, pp_sum=float(tree.path_prob.sum()))
        level_ms = self._level_ms() if m.calibrated else 0.0
        host_ms = self.online.host_cycle_ms() if m.calibrated else 0.0  # paid by any drafted cycle
        width = ts.level_width(ts.depth) if m.calibrated else None  # most nodes a further level adds
        node_ms = cost.min_node_ms_for(cache) if m.level_by_level else None  # per-node bound of T this cycle
        # the stop rule (solvers.stop.should_stop) stops iff P_f <= stop_ms * R* / 1000: its per-node ms, once per cycle
        stop_ms = stop_node_ms(cost, level_ms=level_ms, level_width=width, min_node_ms=node_ms) if m.level_by_level else None
        rule = _StopRule(rate=rate, level_ms=level_ms, host_ms=host_ms, node_ms=node_ms, stop_ms=stop_ms,
                         root_ms=verify_ms(cost, 1, tree.items(cache).root_new_per_layer),  # T(root alone) = T(AR)
                         prune=m.level_by_level and self.solver.exact, max_sunk=host_ms + depth * level_ms,
                         root_known=not (m.oracle and experts_known))
        return g, rule

    def _add_level(self, level, g: "_Growing", rule: "_StopRule", rec: CycleRecord) -> float | None:
        """Add one drafted level to the cycle's :class:`_Drafted` and its kept nodes to ``g.pending``; the
        largest kept path probability P_f, or None when the level kept no node. Nodes in no optimal
        selection are dropped before they are predicted or priced (:func:`specfit.solvers.stop.selectable`)
        against R_lo <= R*: the root alone with every level paid, or a selection found so far (the
        oracle's T(root alone) is known once the reference has routed the first level)."""
        t0 = self.clock.wall()
        parents, tokens, head_pp = _level_arrays(level)
        self.clock.charge("level")
        self.clock.charge("level_node", len(parents))
        if rule.prune:
            if rule.rate is not None:
                rule.rate_lo = rule.rate
            elif rule.root_known:
                rule.rate_lo = max(rule.rate_lo, 1000.0 / (rule.root_ms + rule.max_sunk))
        threshold = selectable_threshold(rule.node_ms, rule.rate_lo) if rule.prune else -np.inf
        d = g.drafted
        if self.acceptance is not None and parents.size:  # calibrated conditionals along the path, per depth
            kept, kept_parents, pp_kept, g.pp_sum, p_f = d.add_calibrated(self.acceptance, parents, tokens, head_pp,
                                                                          threshold, g.n_tree, g.pp_sum)
        else:
            kept, kept_parents, pp_kept, g.pp_sum, p_f = d.add_raw(parents, tokens, head_pp, threshold, g.n_tree, g.pp_sum)
        if kept.size:  # an index tensor copies: the drafter may reuse its hidden buffer
            hidden = level.hidden[torch.from_numpy(kept)] if g.with_hidden and level.hidden is not None else None
            g.pending.append((kept_parents, pp_kept, tokens[kept], hidden))
        g.n_tree += kept.size
        rec.tree_ms += (self.clock.wall() - t0) * 1e3
        if not self.mechanisms.batch_predict:  # this level's experts now, not batched until the next solve
            self._grow(g.tree, g.pending, g.predicted, rec)
        return p_f if kept.size else None

    def _route_truly(self, g: "_Growing", rule: "_StopRule", rec: CycleRecord) -> None:
        """The oracle: give the tree the reference target's true routing (outside the timed path); the
        root's true experts change T(root alone)."""
        self._grow(g.tree, g.pending, g.predicted, rec)
        u0, d0 = self.clock.cpu(), self.clock.thread()
        g.tree.set_experts(self._true_routing(g.tree))
        self._now.reference_verified = True
        self._now.untimed_s += self.clock.cpu() - u0
        self._now.device_thread_s += self.clock.thread() - d0
        rule.root_ms, rule.root_known = verify_ms(g.cost, 1, g.tree.items(g.cache).root_new_per_layer), True

    def _stop_rule(self, g: "_Growing", rule: "_StopRule", p_f: float, rec: CycleRecord):
        """Whether drafting stops after this level, and the selection solved to ask (None if none).

        The stop rule stops iff P_f <= (per_node_ms + level_ms / width) * R* (:func:`specfit.solvers.stop.should_stop`).
        R* <= 1000 (1 + ΣP) / (T(root alone) + sunk), as every subtree holds the root, and R* <=
        :func:`~specfit.solvers.stop.ratio_upper_bound` (each node adds >= node_ms too); the kept levels
        are predicted and solved only when both bounds let the rule fire (rate mode needs no R*); with every
        expert resident the bounds cut the solver's host ms to about a third (BENCHMARKS.md, "Engine
        mechanisms: what each pays"). Sunk:
        the cycle's host ms and the levels drafted."""
        sunk = rule.host_ms + rec.levels * rule.level_ms
        if rule.rate is not None:
            return p_f <= rule.stop_ms * rule.rate / 1000.0, None
        bound = 1000.0 * g.pp_sum / (rule.root_ms + sunk)
        if self.mechanisms.stop_bounds and not (p_f <= rule.stop_ms * bound / 1000.0 and p_f <= rule.stop_ms * ratio_upper_bound_unchecked(
                np.concatenate([g.tree.path_prob[1:]] + [pp for _, pp, _, _ in g.pending]),
                rule.root_ms + sunk, rule.node_ms) / 1000.0):
            return False, None
        self._grow(g.tree, g.pending, g.predicted, rec)
        selection = self._select(g.tree, g.cache, None, rec, g.cost, sunk)
        if rule.prune:  # the same subtree, every level paid, is still there at the end of the cycle
            rule.rate_lo = max(rule.rate_lo, 1000.0 * selection.expected_tokens
                               / (selection.predicted_ms - sunk + rule.max_sunk))
        return p_f <= rule.stop_ms * selection.throughput / 1000.0, selection

    def _hide_behind_levels(self, rec: CycleRecord, level_host: list, final_s: float, depth: int) -> None:
        """Book the host work the draft levels' forwards hide, for a drafter that launches each level
        before the one above it is read (``launches_ahead``): level j's host work (``level_host[j-1]``,
        s) runs while level j+1's forward is on the device, so up to ``draft_level_ms`` of it is hidden;
        a cycle that stopped before ``depth`` levels left one level launched and unused
        (``rec.levels_ahead`` = 1, a draft level in the modeled cycle and in the gate's T_d), which hides
        up to ``draft_level_ms`` of its last level's work and the cycle's final work (``final_s``: the
        last prediction, the selection). The hidden ms move from ``rec.host_cpu_ms`` and the levels'
        host ms (the online model's per-level cost, :meth:`_level_ms`) to ``rec.hidden_host_ms``
        (SPECFIT.md §3, "Host work hidden by the device"). Hiding pays each level's host work off the
        critical path, up to one draft level's ms per level (part of the hidden host ms, (BENCHMARKS.md, "Engine mechanisms: what each pays"))."""
        slot = (self.cost.draft_level_ms or 0.0) / 1e3
        if not level_host or slot <= 0.0:
            return
        hidden = sum(min(h, slot) for h in level_host[:-1])
        rec.levels_ahead = int(rec.levels < depth)
        if rec.levels_ahead:
            hidden += min(level_host[-1] + final_s, slot)
        self._now.untimed_s += hidden  # out of host_cpu_ms (the cycle's thread time less its untimed parts)
        rec.hidden_host_ms += hidden * 1e3
        self._now.level_host_ms = max(self._now.level_host_ms - hidden * 1e3, 0.0)

    def _next_level(self, levels, rec: CycleRecord):
        """The drafter's next level (None when its levels ended); the head forward's time is the cycle's
        ``draft_ms`` and is left out of its host CPU time (device work)."""
        t0, u0, d0 = self.clock.wall(), self.clock.cpu(), self.clock.thread()
        level = next(levels, None)
        rec.draft_ms += (self.clock.wall() - t0) * 1e3
        self._now.untimed_s += self.clock.cpu() - u0
        self._now.device_thread_s += self.clock.thread() - d0
        return level

    def _hide_behind_first_level(self, rec: CycleRecord, start: tuple) -> None:
        """Book the host work done after the cycle's first draft level was launched and before its
        outputs are read (the root's prediction and cost model, the AR gate's sound bound, the stop
        rule's constants; on a GPU the head forward runs meanwhile): its CPU time since ``start``
        (``(thread time, untimed s)`` at the launch), up to the profile's ``draft_level_ms``, is
        ``rec.hidden_host_ms``, off the critical path; the rest is host time of the cycle outside its
        levels (``host_cpu_ms``; SPECFIT.md §3, "Whole-cycle objective")."""
        spent = self.clock.cpu() - start[0] - (self._now.untimed_s - start[1])
        hidden = min(spent, (self.cost.draft_level_ms or 0.0) / 1e3)
        self._now.untimed_s += spent  # out of the levels' host time (a cost per cycle, not per level) ...
        rec.host_cpu_ms += (spent - hidden) * 1e3  # ... what the head forward did not hide is the cycle's
        rec.hidden_host_ms += hidden * 1e3

    def _grow(self, tree: DraftTree, pending: list, predicted: bool, rec: CycleRecord) -> None:
        """Append the ``pending`` levels (each ``(parents, path_prob, tokens, hidden)``, parents as ids of
        ``tree`` or of an earlier pending level) to ``tree`` and empty the list. Their experts: predicted
        in one call when ``predicted`` (one predictor call per selection instead of one per level; one per
        level if some levels carry hidden states and others not, so each gets the states it has), zeros
        when the tree has experts (the oracle's placeholder), else none. Timed into ``rec.tree_ms``. Batching
        saves one predictor call per level the stop rule does not solve (not measured apart: BENCHMARKS.md,
        "Engine mechanisms: what each pays")."""
        if not pending:
            return
        t0 = self.clock.wall()
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
        tree.append_level(parents, pp, tokens, experts)
        pending.clear()
        rec.tree_ms += (self.clock.wall() - t0) * 1e3

    def _cache_now(self, cache: np.ndarray | None) -> np.ndarray:
        """The expert-cache mask (L, E) at the cycle's start (read once per cycle; ``cache`` if given)."""
        if cache is not None:
            self._now.cache = cache
        elif self._now.cache is None:
            self._now.cache = _cache_mask(self.target, self.num_experts)
        return self._now.cache

    def _predict(self, tokens: np.ndarray, hidden) -> np.ndarray:
        """The predictor's experts (m, L, k) for ``tokens`` (m,), after it observed every committed token
        (its wall time is the cycle's ``predict_ms``); checked (:func:`check_experts`) unless the predictor
        declares ``valid_output`` (the built-in ones). The committed tokens not yet observed are observed
        first, in the same call where the predictor has ``observe_and_predict``. ``tokens`` and the committed
        tokens and routing are int64 C-contiguous arrays the engine made, so a predictor that takes them as
        they are (``predict_ids``, ``observe_and_predict_ids``: the frequency predictor) is called without its
        per-call checks of type and layout (:meth:`_predictor_calls`)."""
        t0 = self.clock.wall()
        self.clock.charge("predict")
        self.clock.charge("predict_node", len(tokens))
        calls = self._calls
        if calls[0] is not self.predictor:
            calls = self._calls = self._predictor_calls()
        _, fused, predict, valid = calls
        observed = None
        if self._carry.unobserved:
            toks, rows = zip(*self._carry.unobserved)
            self._carry.unobserved.clear()  # several cycles' tokens (AR steps before this one) joined; one cycle's as is
            observed = (np.concatenate(toks), np.concatenate(rows)) if len(toks) > 1 else (toks[0], rows[0])
        if observed is not None and fused is not None:
            experts = fused(*observed, tokens, hidden)
        else:
            if observed is not None:
                self.predictor.observe(*observed, None)
            experts = predict(tokens, hidden)
        if not valid:
            experts = check_experts(experts, len(tokens), self.num_experts, copy=False)
        self._now.predict_s += self.clock.wall() - t0
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
        if self._now.root is None:
            experts = self._root_experts(root)
            tree = _root_only(root, experts, self.num_experts)
            self._now.root = (tree, self._cycle_cost(tree, cache))
        return self._now.root

    def _root_experts(self, root: int) -> np.ndarray:
        """The root's predicted experts (1, L, k), predicted once per cycle (the prefetch and the root tree share them)."""
        if self._now.root_experts is None:
            self._now.root_experts = self._predict(np.array([root], np.int64), None)[:1]
        return self._now.root_experts

    def _prefetch_levels(self, depth: int) -> int:
        """Head forwards a drafted cycle surely launches after its prefetch, the idle-link window it is
        budgeted for: a method that is not level-by-level drafts ``depth`` levels; a level-by-level one at
        least the first (and the one launched behind it by a drafter that ``launches_ahead``)."""
        if not self.method.level_by_level:
            return depth
        return min(depth, 2) if getattr(self.drafter, "launches_ahead", False) else 1

    def _prefetch_root(self, root: int, cache: np.ndarray | None, rec: CycleRecord, depth: int) -> None:
        """Prefetch the root's predicted experts before the cycle's first head forward is launched
        (``SpecDecoder(prefetch=True)``): the root is the one token every verify computes, its experts have
        path probability 1. Candidates are its predicted experts not resident, layer by layer (the verify
        reads layer 0 first), each layer's in the predictor's order; the cache copies those whose copy starts
        while the head forwards of :meth:`_prefetch_levels` keep the link idle
        (:func:`specfit.core.prefetch.prefetch_budget`) and evicts none of the root's predicted experts. On
        CUDA the copies run on the cache's copy stream beside the head forwards launched after this call; on
        the CPU they are made at once (timing only, never outputs). Skipped without a predictor, a transfer-
        regime cost with ``draft_level_ms``, or a cache with free choice (0 < slots < E). The cycle's mask and
        root cost see the prefetched experts as resident; ``rec.prefetch`` counts them (priced by
        :func:`specfit.core.prefetch.overlap_ms`)."""
        target = self.target.cache
        slots = getattr(target, "slots", None)
        if (self.predictor is None or not isinstance(self.cost, CostModel) or not self.cost.draft_level_ms
                or not hasattr(target, "prefetch_layers") or getattr(self.target, "offload", "transfer") != "transfer"
                or not isinstance(slots, (int, np.integer)) or not 0 < slots < self.num_experts):
            return
        mask = self._cache_now(cache)
        experts = self._root_experts(root)[0]  # (L, k)
        L = mask.shape[0]
        if experts.shape[0] != L:
            return
        cand = [(layer, e) for layer in range(L) for e in dict.fromkeys(experts[layer].tolist()) if not mask[layer, e]]
        n = prefetch_budget(self.cost, [layer for layer, _ in cand], L, self._prefetch_levels(depth) * self.cost.draft_level_ms)
        want = [[] for _ in range(L)]
        for layer, e in cand[:n]:
            want[layer].append(e)
        loaded = target.prefetch_layers(want, protect=experts.tolist())
        self._now.ar_cache = mask.copy()  # what an AR step, which has no idle window, would have found
        for layer, ids in enumerate(loaded):
            mask[layer, ids] = True
        self._now.prefetched = loaded
        self._now.root = None  # the root's cost again, against the cache with the prefetched experts
        rec.prefetch = {"experts": [len(ids) for ids in loaded], "used": [0] * L}

    def _prefetch_ms(self, rec: CycleRecord) -> float:
        """What the cycle's prefetch adds to its modeled ms (:func:`specfit.core.prefetch.overlap_ms` with and
        without it): the copies beyond the idle window of its head forwards; 0 without a prefetch."""
        pre = rec.prefetch.get("experts")
        if not pre or not isinstance(self.cost, CostModel):
            return 0.0
        serial = rec.levels + rec.levels_ahead
        excess, head = overlap_ms(self.cost, pre, rec.transferred, serial, rec.shadow_levels)
        return excess + head - overlap_ms(self.cost, [], rec.transferred, serial, rec.shadow_levels)[1]

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
        self._now.root_new = np.asarray(tree.items(cache).root_new_per_layer)
        if self.online is None:
            return self.cost
        return self.online.corrected_cost(self.cost, self._now.root_new)

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
        if not self.method.needs_predictor or self._expertless(cache):  # oracle: root experts unknown
            return True
        tree, cost = self._root_tree(root, cache)
        ar_ms = verify_ms(cost, 1, tree.items(cache).root_new_per_layer)
        mass = self.acceptance.mass_bound(self._gate_widths())
        return draft_can_beat_ar(ar_ms, mass, self._level_ms(), cost.min_node_ms, min(online.min_expert_ms))

    def _expertless(self, cache: np.ndarray) -> bool:
        """Whether T(S) has no expert term this cycle: every expert resident and no read priced (a
        transfer-regime cost with ``read_ms`` 0). With resident reads priced, each routed expert still
        costs its read, so the nodes' experts are predicted and priced even when the cache holds them all."""
        return bool(cache.all()) and not (isinstance(self.cost, CostModel) and self.cost.read_ms > 0)

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
        t0 = self.clock.wall()
        self.clock.charge("solve")
        self.clock.charge("solve_node", tree.n)
        cost = cost if cost is not None else CostModel(1.0, 0.0, 0.0)
        # cache: the one the tree's coverage accounting uses
        sel = self.solver.solve_tree(tree, cost, cache, rate=rate, sunk_ms=sunk_ms, max_nodes=self.selecting.max_nodes)
        rec.solve_ms += (self.clock.wall() - t0) * 1e3
        return sel

    def _true_routing(self, tree: DraftTree) -> np.ndarray:
        """True routing of every drafted node (n, L, k) from the reference target (oracle only)."""
        return self.reference.verify(torch.tensor(tree.tokens), tree.parents.tolist()).routing.numpy()
