"""What the engine learns online from its own verifies, across the generations of one deployment.

Three things the cycle's objective needs and no datasheet gives (issue 9, SPECFIT.md §3):

* **Calibrated acceptance** (:class:`specfit.core.acceptance.AcceptanceCalibrator`): draft path
  probabilities → acceptance probabilities.
* **The expert predictor's error, priced.** The selection prices the *predicted* experts of its nodes;
  the verify pays for the *true* ones. Two per-layer corrections, learned from every verify:

      e_l = E[ |true root experts \\ C|_l - |predicted root experts \\ C|_l ]          (the root)
      m_l = E[ (transferred_l - |true root experts \\ C|_l)
               - (|predicted union of S \\ C|_l - |predicted root experts \\ C|_l) ] per draft node

  (C the cache at the cycle's start). The selection then uses ``fixed_ms + Σ_l w_l e_l`` (never below
  the cost of a root with no uncached expert, nor below 0) and ``per_node_ms + max(0, Σ_l w_l m_l)``
  (:meth:`OnlineModel.corrected_cost`): a draft node costs, on average, the experts the predictor
  missed. The solver stays exact for this corrected model; the stop rule's proof needs only that
  every node costs at least ``per_node_ms``, which the correction keeps. A host-regime profile
  (``offload="host"``/``"auto"``) gets the node correction as a per-draft-node term outside its
  per-layer max (``HostProfile.node_extra_ms``): the missed experts computed on the host.
* **The AR gate's measured utility.** Every drafted cycle carries its own counterfactual: plain AR
  decoding would have committed the same τ tokens in τ one-token forwards (the root and the accepted
  draft nodes, routed as the verify routed them), so what they cost in AR decoding's own expert cache,
  replayed by the engine (the AR twin, :mod:`specfit.engine.twin`), is known exactly after the fact:
  ``T_AR(d) = Σ_i (fixed_ms + per_node_ms + Σ_l w_l misses_l(token i))``. Without a twin (host and
  auto offload modes, every expert resident, fewer slots than a token's experts, a cache that does not
  report its eviction state) it is
  τ AR steps of the root against the engine's cache (in the host regime the host-regime profile prices
  the root's experts and rows). ``T_d``, the drafted cycle's time, is its verify priced on the measured counts, its draft
  levels and its host CPU time (predictor, tree, solver) as the selection charges it: the decayed
  means of the measured host ms per level and per cycle (:meth:`OnlineModel.host_level_ms`,
  :meth:`OnlineModel.host_cycle_ms`; one cycle's own CPU time is noisy, and at break-even the noise
  alone flipped the gate between runs). Drafting pays when the cycle's
  τ tokens took less than AR decoding would have:

      Ŝ = Σ_d T_AR(d) / Σ_d T_d        (decayed sums over drafted cycles d)

  the measured speedup of drafting over AR (Cascade, arXiv 2506.20675, gates speculation by its
  measured utility in the same way). :meth:`OnlineModel.decide` drafts for the first
  :attr:`OnlineModel.WARMUP` drafted cycles (acceptance and the predictor's error are being learned:
  they do not enter Ŝ) and the :attr:`OnlineModel.MIN_DRAFTED` after them, then iff Ŝ > 1, and, while
  it keeps taking the AR step, explores after ``explore_after`` AR steps: a burst of
  :attr:`OnlineModel.EXPLORE_BURST` drafted cycles, cut short by a cycle that verifies the root alone
  (the first cycles after AR steps pay for experts the AR steps' cache lacks, so one cycle alone
  under-measures drafting) (``explore_after`` 4, doubling after each
  exploration that leaves Ŝ below :attr:`OnlineModel.EXPLORE_MARGIN` or whose last cycle's selection
  verified the root alone, up to :attr:`EXPLORE_MAX`; 16 after one that leaves Ŝ at or above it with
  draft nodes verified, where an exploring cycle costs at most 5% of an AR step; an exploration's
  outcome sets the interval once its last cycle is learned, at the second decision after it): a
  bounded share of exploring cycles.
* **Shadow cycles** (:attr:`OnlineModel.shadowing`, set by the engine where it has the AR twin): an AR
  step that drafts and selects a tree without verifying it, whose outcome the engine learns from the
  tokens decoding commits next (``SpecDecoder._resolve_shadow``): the calibrator's trials, and Ŝ_sh
  (:attr:`OnlineModel.shadow_speedup`: the AR twin's ms for the tokens its selection would have committed
  over the drafted cycle it would have been). The warm-up's first cycles and the explorations are shadow
  cycles until Ŝ_sh clears real drafting (:attr:`OnlineModel.cleared`); a real exploration that backs
  off sends the next ones to the shadow again (docs/SPECFIT.md §3, "Drafting in the AR step's shadow").

* **The host's own cost, measured.** The predictor, the tree and the solver run on the host CPU every
  drafted cycle. The engine measures that CPU time (``time.thread_time``) per draft level and for the
  rest of the cycle; :meth:`OnlineModel.host_level_ms` replaces the profile's ``host_level_ms`` (a
  prior from benchmarks) in the level cost of the selection, the stop rule and the gate, and
  :meth:`OnlineModel.host_cycle_ms` is a cost every drafted cycle pays whatever it verifies (added to
  the selection's sunk ms, like the levels already drafted). A verify's acceptance learning is queued
  (:meth:`OnlineModel.defer`) and run while the device computes the next cycle's verify; the part of it
  the verify hides is not host time on the critical path, nor is the part of a drafted cycle's own host
  work its first draft level's forward hides (the root's prediction and cost,
  ``SpecDecoder._hide_behind_first_level``), nor the part of each
  level's host work the next level's forward hides when the drafter launches levels ahead
  (``SpecDecoder._hide_behind_levels``: the measured ms per level are what stays on the critical path). The engine's learning
  of a cycle's outcome (:meth:`OnlineModel.observe`, :meth:`OnlineModel.observe_host`) runs while the
  next cycle's verify is on the device, so the gate and the selection see it one cycle late; what the
  gate counts is recorded at once (:meth:`OnlineModel.observe_selection`).

Decayed sums forget with factor :attr:`OnlineModel.DECAY` per observation (an effective window of ~50
cycles; Ŝ's with :attr:`OnlineModel.SPEEDUP_DECAY`, ~20 drafted cycles), so the model follows a change
of prompt, domain or cache pressure.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Callable

import numpy as np

from specfit.core.acceptance import AcceptanceCalibrator
from specfit.core.cost import CostModel, HostProfile, check_ms


class OnlineModel:
    """The engine's online state, shared by the decoders of one deployment (module docstring).

    Parameters
    ----------
    depth : int
        Draft depth (the acceptance calibrator's depths).

    Attributes
    ----------
    acceptance : AcceptanceCalibrator
    drafted : int
        Drafted cycles observed.
    explorations : int
        Cycles drafted only to explore (the gate preferred the AR step).
    """

    #: Forgetting factor of the corrections' decayed sums, per observation (~50 cycles).
    DECAY = 0.98
    #: Forgetting factor of Ŝ's sums, per drafted cycle (~20 cycles): the gate follows what drafting
    #: is worth now, not while acceptance was still being learned. 0.9 (~10 cycles) let noise alone take
    #: Ŝ below 1 in 7-14% of the drafted cycles of runs whose drafting paid 1.18-1.28 × (0.95: 2-5%;
    #: docs/SPECFIT.md §3, BENCHMARKS.md "Issue 9, eleventh round").
    SPEEDUP_DECAY = 0.95
    #: Drafted cycles that calibrate acceptance and the predictor's error before Ŝ measures any.
    WARMUP = 10
    #: Drafted cycles measured before the gate trusts Ŝ (one unlucky cycle must not stop drafting).
    MIN_DRAFTED = 10
    #: AR steps before the first exploration, and the most between two explorations.
    EXPLORE_FIRST = 4
    EXPLORE_MAX = 128
    #: Consecutive cycles one exploration drafts (fewer if one verifies the root alone): the first
    #: cycles after AR steps pay for the draft nodes' experts the AR steps' cache lacks.
    EXPLORE_BURST = 4
    #: Ŝ at or above which the gate does not back off between explorations (if they verify draft nodes):
    #: drafting then loses at most 1 - EXPLORE_MARGIN of an AR step per exploring cycle, and one burst
    #: per EXPLORE_FIRST * EXPLORE_BURST AR steps (one cycle in 5) explores.
    EXPLORE_MARGIN = 0.95
    #: Drafted cycles over which the sound gate's cheapest-node expert bound is taken.
    GATE_WINDOW = 4
    #: Shadow cycles after the first :attr:`WARMUP` (which only calibrate) that may clear real drafting
    #: before the shadow warm-up's end: as soon as this many have measured Ŝ_sh > 1 with drafts verified.
    SHADOW_EARLY = 4

    def __init__(self, depth: int):
        self.acceptance = AcceptanceCalibrator(max_depth=depth)
        self.root_error = None  # (L,) decayed sum of true - predicted uncached root experts
        self.root_weight = 0.0
        self.node_extra = None  # (L,) decayed sum of unpredicted experts of draft nodes
        self.node_weight = 0.0
        self._weighted = None  # (w, Σ w e, Σ w m): corrected_cost's terms until the corrections change
        self.gain_ms = 0.0  # decayed sum of T_AR(d), AR decoding's ms for the cycle's tokens, over drafted cycles
        self.spent_ms = 0.0  # decayed sum of T over drafted cycles
        self.drafted = 0
        self.explorations = 0
        self.skips = 0
        self.explore_after = self.EXPLORE_FIRST
        self.verified_draft = False  # did the last drafted cycle's selection verify a draft node?
        self.selected_depth = None  # the deepest node the last drafted cycle's selection verified (root 0)
        self.burst_left = 0  # exploring cycles left in the current burst
        self.burst_unjudged = False  # an exploration has started whose outcome has not set explore_after yet
        self.ahead: str | None = None  # the next cycle's decision, made ahead (:meth:`decide_ahead`)
        #: The sound bound's last answer in :meth:`decide` (True before any): while it is True the engine
        #: launches a cycle's first draft level before asking it (SPECFIT.md §3).
        self.sound_said_draft = True
        self.min_expert_ms: deque = deque(maxlen=self.GATE_WINDOW)
        self.host_ms = [0.0, 0.0, 0.0, 0.0]  # decayed sums: level host ms, levels, rest-of-cycle host ms, cycles
        #: Whether this deployment's AR steps can carry a shadow cycle (set by the engine per generation:
        #: a calibrated method in the transfer regime with the AR twin, not every expert resident).
        self.shadowing = False
        self.shadows = 0  # shadow cycles drafted
        self.shadow_resolved = 0  # shadow cycles whose outcome is known (observe_shadow)
        self.shadow_pending = 0  # drafted, not yet resolved
        self.shadow_gain_ms = 0.0  # decayed sum of T_AR over resolved shadow cycles (after the first WARMUP)
        self.shadow_spent_ms = 0.0  # decayed sum of their counterfactual T_d
        self.shadow_measured = 0  # resolved shadow cycles in those sums
        self.shadow_selected_draft = False  # did the last shadow cycle's selection hold a draft node?
        self.shadow_verified_draft = False  # ... the last resolved one's
        #: None until judged; True while the shadows (or a real exploration near break-even) say real
        #: drafting may pay: then the warm-up and explorations draft for real; False: they are shadows.
        self.cleared: bool | None = None
        self.burst_shadow = False  # the current or last exploration is a burst of shadow cycles
        self.ar_h2d = [0.0, 0.0]  # decayed sums: AR steps' modeled H2D ms, AR steps
        #: Learning deferred to the next cycle's verify (:meth:`defer`), oldest first.
        self.deferred: list = []

    def defer(self, learn: Callable, *args) -> None:
        """Queue ``learn(*args)`` (a verify's acceptance learning) until :meth:`flush`.

        The engine runs the queue while the device computes the next cycle's verify (``SpecDecoder._cycle``,
        with the last cycle's :meth:`observe`) and at the end of a generation: on a GPU the learning is
        then off the critical path, up to the shortest verify. A selection and the AR gate's sound bound
        (:meth:`AcceptanceCalibrator.mass_bound`) see the calibration of every verify but the last one
        (SPECFIT.md §3, "Whole-cycle objective").
        """
        self.deferred.append((learn, args))

    def flush(self) -> None:
        """Run the deferred learning (:meth:`defer`) in the order it was queued."""
        queue, self.deferred = self.deferred, []
        for learn, args in queue:
            learn(*args)

    @property
    def speedup(self) -> float | None:
        """Ŝ, the measured speedup of drafting over the AR step (module docstring); None before a drafted cycle."""
        return self.gain_ms / self.spent_ms if self.spent_ms > 0 else None

    @property
    def shadow_speedup(self) -> float | None:
        """Ŝ_sh, the shadow cycles' measured speedup of drafting over the AR step (None before one is
        measured): their T_AR over their counterfactual T_d, decayed like Ŝ (SPECFIT.md §3, "Drafting in
        the AR step's shadow")."""
        return self.shadow_gain_ms / self.shadow_spent_ms if self.shadow_spent_ms > 0 else None

    def observe_shadow_selection(self, draft_nodes: int) -> None:
        """Count one shadow cycle at its selection: ``draft_nodes`` the draft nodes its selection holds
        (root excluded). Its outcome comes later (:meth:`observe_shadow`)."""
        self.shadows += 1
        self.shadow_pending += 1
        self.shadow_selected_draft = draft_nodes > 0

    def observe_shadow(self, *, draft_nodes: int, cycle_ms: float, ar_tokens_ms: float) -> None:
        """Learn one resolved shadow cycle (SPECFIT.md §3, "Drafting in the AR step's shadow").

        Parameters
        ----------
        draft_nodes : int
            Draft nodes its selection held (root excluded).
        cycle_ms : float
            Its counterfactual T_d, ms: the selection's verify priced on the true experts of the
            accepted path and the predicted experts of the others, its draft levels and host ms.
        ar_tokens_ms : float
            What plain AR decoding paid for the tokens the selection would have committed (the AR twin), ms.
        """
        self.shadow_pending = max(self.shadow_pending - 1, 0)
        self.shadow_resolved += 1
        self.shadow_verified_draft = draft_nodes > 0
        if self.shadow_resolved <= self.WARMUP:  # calibrating: not what drafting will be worth
            return
        g = self.SPEEDUP_DECAY
        self.shadow_gain_ms = g * self.shadow_gain_ms + float(ar_tokens_ms)
        self.shadow_spent_ms = g * self.shadow_spent_ms + float(cycle_ms)
        self.shadow_measured += 1

    def observe_ar_h2d(self, ms: float) -> None:
        """Record one AR step's modeled H2D ms (its copied experts' ms): what a shadow's head forwards hide behind."""
        d = self.DECAY
        self.ar_h2d = [d * self.ar_h2d[0] + float(ms), d * self.ar_h2d[1] + 1.0]

    def ar_h2d_ms(self) -> float | None:
        """Mean modeled H2D ms of the recent AR steps (decayed; None before one)."""
        return self.ar_h2d[0] / self.ar_h2d[1] if self.ar_h2d[1] > 0 else None

    def drop_shadows(self, count: int) -> None:
        """Forget ``count`` pending shadow cycles whose outcome will never be known (a generation ended)."""
        self.shadow_pending = max(self.shadow_pending - int(count), 0)

    def _shadows_clear(self) -> bool:
        """Whether the shadow cycles say real drafting may pay: Ŝ_sh >= :attr:`EXPLORE_MARGIN` and the last
        resolved shadow's selection verified a draft node (a shadow whose exact selection kept the root
        alone found nothing worth verifying)."""
        s = self.shadow_speedup
        return s is not None and s >= self.EXPLORE_MARGIN and self.shadow_verified_draft

    def root_correction(self) -> np.ndarray | None:
        """``e_l``, mean true minus predicted uncached root experts per layer (None before a verify)."""
        return None if self.root_weight == 0 else self.root_error / self.root_weight

    def node_correction(self) -> np.ndarray | None:
        """``m_l``, mean unpredicted uncached experts per verified draft node and layer (None before one)."""
        return None if self.node_weight == 0 else self.node_extra / self.node_weight

    def weighted_corrections(self, w: np.ndarray) -> tuple[float | None, float | None]:
        """``(Σ_l w_l e_l, Σ_l w_l m_l)``, ms, the corrections' terms of :meth:`corrected_cost` for the
        per-expert ms ``w`` (L,) (None where a correction is not learned yet): kept until the corrections
        change (:meth:`observe`) or another ``w`` array is given. The engine asks for them in the learning
        slot, behind the next verify, so that a cycle's corrected cost takes one dot product, not three."""
        memo = self._weighted
        if memo is not None and memo[0] is w:
            return memo[1], memo[2]
        e, m = self.root_correction(), self.node_correction()
        out = (w, float(w @ e) if e is not None else None, float(w @ m) if m is not None else None)
        self._weighted = out
        return out[1], out[2]

    def observe_host(self, levels: int, level_ms: float, rest_ms: float) -> None:
        """Record one drafted cycle's measured host CPU ms: ``level_ms`` over its ``levels`` draft
        levels (prediction, tree, calibration, the stop rule's solves) and ``rest_ms`` for the rest
        (the root's prediction, the final solve, learning)."""
        d = self.DECAY  # four floats: cheaper than an array, the same sums
        self.host_ms = [d * s + x for s, x in zip(self.host_ms, (float(level_ms), float(levels), float(rest_ms), 1.0))]

    def host_level_ms(self, prior: float) -> float:
        """Measured host CPU ms per draft level (decayed mean); ``prior`` before any drafted cycle."""
        return self.host_ms[0] / self.host_ms[1] if self.host_ms[1] > 0 else float(prior)

    def host_cycle_ms(self) -> float:
        """Measured host CPU ms a drafted cycle pays outside its levels (decayed mean; 0 before any)."""
        return self.host_ms[2] / self.host_ms[3] if self.host_ms[3] > 0 else 0.0

    def corrected_cost(self, cost: CostModel, root_new_per_layer) -> CostModel:
        """``cost`` with the predictor's learned error priced in (module docstring).

        Parameters
        ----------
        cost : CostModel or HostProfile
            The engine's cost model (per-layer ``per_expert_ms`` for the model's L layers). A
            host-regime profile (scaled to L layers) gets the node correction alone, outside its
            per-layer max: ``node_extra_ms = max(0, (R / L) (host_per_expert_ms + host_per_row_ms) Σ_l m_l)``,
            each missed expert computed on the host for the one row of the node that needs it, in
            every layer whichever part binds (an upper bound on what it adds); the root's error is
            paid by the AR step alike and is left out there.
        root_new_per_layer : array-like of int, shape (L,)
            This cycle's predicted uncached root experts per layer, ``|predicted root experts \\ C|_l``;
            the root correction never takes T(root alone) below ``fixed_ms + per_node_ms``.

        Returns
        -------
        CostModel or HostProfile
            ``max(0, fixed_ms + max(Σ_l w_l e_l, -Σ_l w_l root_new_l))`` (a cost model's ``fixed_ms`` is
            >= 0: an over-predicting predictor's correction stops there) and
            ``per_node_ms + max(0, Σ_l w_l m_l)``, the rest of ``cost`` unchanged; a host-regime
            profile with ``node_extra_ms`` as above.
        """
        if isinstance(cost, HostProfile):
            m = self.node_correction()
            if m is None:
                return cost
            c = cost.reference_layers / m.size if m.size else 0.0
            extra = c * (cost.host_per_expert_ms + cost.host_per_row_ms) * float(m.sum())
            return replace(cost, node_extra_ms=max(0.0, extra))
        if not self.root_weight and not self.node_weight:
            return cost
        w = cost.per_expert_array((self.root_error if self.root_weight else self.node_extra).size)
        we, wm = self.weighted_corrections(w)
        root_ms = float(w @ np.asarray(root_new_per_layer, dtype=np.float64))
        fixed = cost.fixed_ms + (max(we, -root_ms) if we is not None else 0.0)
        per_node = cost.per_node_ms + (max(0.0, wm) if wm is not None else 0.0)
        fixed = max(fixed, 0.0)
        if fixed + per_node <= 0:  # a cost model's cycle takes time: keep the uncorrected fixed_ms
            fixed = cost.fixed_ms
        return cost._with_costs(check_ms("fixed_ms", fixed), check_ms("per_node_ms", per_node))

    def observe_selection(self, draft_nodes: int, selected_depth: int) -> None:
        """Count one verified drafted cycle: what the gate and the warm-up's depth cap read next cycle
        (:meth:`decide`, :meth:`draft_depth`). The engine calls it right after the verify and
        :meth:`observe` (with ``counted=True``) while the next verify runs (SPECFIT.md §3).

        Parameters
        ----------
        draft_nodes : int
            Draft nodes the cycle verified (root excluded; 0: the root alone).
        selected_depth : int
            Depth of the deepest verified node (0: the root alone).
        """
        self.verified_draft, self.selected_depth = draft_nodes > 0, int(selected_depth)
        self.drafted += 1

    def observe(self, *, root_predicted_new, root_true_new, selected_predicted_new=None, transferred=None,
                draft_nodes: int = 0, committed: int = 1, cycle_ms: float | None = None,
                ar_ms: float | None = None, ar_tokens_ms: float | None = None, selected_depth: int = 0,
                counted: bool = False) -> None:
        """Learn from one verified cycle.

        Parameters
        ----------
        root_predicted_new, root_true_new : array_like, shape (L,)
            Uncached experts of the root per layer: predicted, and true (the verify's routing of
            the root against the cache at the cycle's start).
        selected_predicted_new, transferred : array_like, shape (L,), optional
            Drafted cycles: the selection's predicted uncached experts, and the experts the verify
            really copied, per layer.
        draft_nodes : int
            Draft nodes verified (root excluded).
        committed : int
            τ of the cycle (accepted draft tokens + bonus).
        cycle_ms, ar_ms : float, optional
            Drafted cycles: the cycle's time (verify of the measured counts + its draft levels + its
            host ms, module docstring) and its counterfactual AR step's (the root alone with its true experts), ms.
        ar_tokens_ms : float, optional
            Drafted cycles: what plain AR decoding would have paid for the cycle's ``committed`` tokens
            in its own expert cache (the AR twin, :mod:`specfit.engine.twin`), ms; default
            ``committed * ar_ms``.
        selected_depth : int
            Drafted cycles: the depth of the deepest verified node (0: the root alone).
        counted : bool
            Drafted cycles: :meth:`observe_selection` already counted this cycle (else this call does).
        """
        d = self.DECAY
        err = np.asarray(root_true_new, dtype=np.float64) - np.asarray(root_predicted_new, dtype=np.float64)
        self.root_error = err if self.root_error is None else d * self.root_error + err
        self.root_weight = d * self.root_weight + 1.0
        self._weighted = None
        if cycle_ms is None:
            return
        if not counted:
            self.observe_selection(draft_nodes, selected_depth)
        if draft_nodes > 0:
            extra = ((np.asarray(transferred, dtype=np.float64) - np.asarray(root_true_new, dtype=np.float64))
                     - (np.asarray(selected_predicted_new, dtype=np.float64)
                        - np.asarray(root_predicted_new, dtype=np.float64)))
            self.node_extra = extra if self.node_extra is None else d * self.node_extra + extra
            self.node_weight = d * self.node_weight + draft_nodes
        if self.drafted <= self.WARMUP:  # learning: not what drafting will be worth
            return
        g = self.SPEEDUP_DECAY
        gain = committed * float(ar_ms) if ar_tokens_ms is None else float(ar_tokens_ms)
        self.gain_ms = g * self.gain_ms + gain
        self.spent_ms = g * self.spent_ms + float(cycle_ms)

    def draft_depth(self, depth: int) -> int:
        """Levels a drafted cycle may draft: ``depth``, capped during the warm-up (the first
        :attr:`WARMUP` + :attr:`MIN_DRAFTED` drafted cycles) at one level past the deepest node the last
        drafted cycle's selection verified (no cap on the first).

        The warm-up drafts whatever the gate would say, to learn; a cycle learns acceptance only from
        the children of its accepted nodes (:mod:`specfit.core.acceptance`), so levels far below what
        the exact selection verifies teach nothing and cost their draft and host time. Where the
        selections keep the root alone (drafting cannot pay at this cache pressure) the warm-up then
        drafts one level per cycle instead of all; where they verify deep trees the cap grows by one
        level per cycle. It lifts when the warm-up ends (docs/SPECFIT.md §3, "Measured utility").

        Parameters
        ----------
        depth : int
            The tree settings' draft depth (levels), >= 1.

        Returns
        -------
        int
            Levels to draft this cycle, in [1, depth].
        """
        if self.drafted >= self.WARMUP + self.MIN_DRAFTED or self.selected_depth is None:
            return depth
        return min(depth, self.selected_depth + 1)

    def decide(self, sound_can_draft: Callable[[], bool] = lambda: True) -> str:
        """The AR gate's decision for this cycle (module docstring).

        Parameters
        ----------
        sound_can_draft : callable
            Called only when Ŝ > 1; returns False when the sound bound
            (:func:`specfit.solvers.stop.draft_can_beat_ar`) proves that no draft beats this cycle's
            AR step within the model.

        Returns
        -------
        str
            ``"draft"`` (Ŝ > 1, or fewer than :attr:`WARMUP` + :attr:`MIN_DRAFTED` drafted cycles), ``"explore"`` (a draft although the AR
            step is measured better: up to :attr:`EXPLORE_BURST` in a row after ``explore_after`` AR
            steps), ``"shadow"`` (an AR step that drafts and selects a tree in its shadow, to learn
            without paying a verify: where :attr:`shadowing` holds and real drafting is not
            :attr:`cleared`, in place of the warm-up's drafted cycles and of the explorations) or ``"ar"``.
        """
        if self.ahead is not None:
            decision, self.ahead = self.ahead, None
            return decision
        s = self.speedup
        warm = s is None or self.drafted < self.WARMUP + self.MIN_DRAFTED
        shadow = self.shadowing and self.cleared is not True
        if warm and not shadow:
            return "draft"
        if warm and self.cleared is None:  # the warm-up in the AR steps' shadow, not judged yet
            early = (self.shadow_measured >= self.SHADOW_EARLY and self.shadow_verified_draft
                     and self.shadow_speedup > 1.0)
            if self.shadows < self.WARMUP + self.MIN_DRAFTED and not early:
                return "shadow"
            if not early and self.shadow_pending:  # its last cycles are not resolved yet
                self.skips += 1
                return "ar"
            self.cleared = early or self._shadows_clear()
            if self.cleared:
                return "draft"  # the real warm-up
            self.skips, self.explore_after, self.burst_left, self.burst_unjudged = 0, self.EXPLORE_FIRST, 0, False
        if not warm and self._asks_sound_bound():
            self.sound_said_draft = bool(sound_can_draft())
            if self.sound_said_draft:
                self.skips, self.explore_after, self.burst_left = 0, self.EXPLORE_FIRST, 0
                self.burst_unjudged = False
                return "draft"
        going_on = self.shadow_selected_draft if self.burst_shadow else self.verified_draft
        if self.burst_left > 0 and going_on:  # an exploration goes on while it verifies drafts
            self.burst_left -= 1
            return self._explore()
        self.burst_left = 0
        if self.burst_unjudged and self.skips > 0 and not (self.burst_shadow and self.shadow_pending):
            # the burst is over and its last cycle learned (learning runs one cycle late, during the next
            # cycle's verify: here from the second decision after the burst on; a shadow burst's cycles
            # once their outcomes are known): it sets the interval
            self.burst_unjudged = False
            if self.burst_shadow:
                if self._shadows_clear():  # drafting may pay: measure it for real, now
                    self.cleared = True
                    if warm:
                        return "draft"  # the real warm-up
                    self.skips = self.explore_after = self.EXPLORE_FIRST
                else:
                    self.explore_after = min(2 * self.explore_after, self.EXPLORE_MAX)
            elif s < self.EXPLORE_MARGIN or not self.verified_draft:
                # drafting measured clearly slower, or the burst's last cycle's own exact selection kept
                # the root alone (the model found no draft worth verifying): explore ever more rarely,
                # in the AR steps' shadow where they can carry one
                self.explore_after = min(2 * self.explore_after, self.EXPLORE_MAX)
                self.cleared = False if self.shadowing else self.cleared
            else:  # nearly break-even with drafts verified: each exploring cycle costs at most 1 - Ŝ of a
                # cycle; one burst per EXPLORE_FIRST * EXPLORE_BURST AR steps keeps one cycle in 5 exploring
                self.explore_after = self.EXPLORE_FIRST * self.EXPLORE_BURST
        if self.skips >= self.explore_after:
            self.burst_shadow = self.shadowing and self.cleared is not True
            self.burst_left = self.EXPLORE_BURST - 1
            self.skips = 0
            self.burst_unjudged = True
            return self._explore()
        self.skips += 1
        return "ar"

    def _explore(self) -> str:
        """One exploring cycle of the current burst: ``"shadow"`` in a shadow burst, else ``"explore"`` (counted)."""
        if self.burst_shadow:
            return "shadow"
        self.explorations += 1
        return "explore"

    def take_ar_ahead(self) -> bool:
        """True, consuming it, if the decision made ahead (:meth:`decide_ahead`) is an AR step: the engine
        then takes the AR step without entering its drafting path (what :meth:`decide` would return)."""
        if self.ahead == "ar":
            self.ahead = None
            return True
        return False

    def decide_ahead(self) -> None:
        """Make the next cycle's decision now, if it needs nothing of that cycle: :meth:`decide` then
        returns it. The sound bound (``sound_can_draft``) is consulted only when Ŝ > 1 after the
        warm-up and needs the next root and cache, so then nothing is decided ahead.

        The engine calls it in an AR step's learning slot, after learning the cycle before
        (``SpecDecoder._learn_last_cycle``): the host work a GPU does while the verify it launched runs,
        booked as hidden up to the shortest verify (``CycleRecord.hidden_host_ms``; on the CPU the verify
        runs after it, synchronously). After an AR step nothing else the gate reads changes before the
        next decision (only a drafted cycle is counted after its verify), so the decision is the one
        :meth:`decide` would make at the next cycle's start, and a run of AR steps puts no host time for
        the gate on the modeled critical path (SPECFIT.md §3, "Exploration, and what the rule guarantees").
        """
        if self.ahead is None and not self._asks_sound_bound():
            self.ahead = self.decide()

    def _asks_sound_bound(self) -> bool:
        """Whether :meth:`decide` would consult the sound bound now: Ŝ > 1 after the warm-up."""
        s = self.speedup
        return s is not None and s > 1.0 and self.drafted >= self.WARMUP + self.MIN_DRAFTED
