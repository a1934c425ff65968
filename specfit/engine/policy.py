"""Draft policies: whether a cycle drafts, and how far (SPECFIT.md §3, "The AR step as a candidate").

A policy answers the engine once per cycle and learns from what the cycle did::

    decide(sound_can_draft) -> Decision     "draft" | "explore" | "shadow" | "ar"
    draft_depth(depth) -> int               levels a drafted cycle may draft
    observe_selection(...), observe_cycle(...), observe_shadow(...)   what the cycle did

The engine asks nothing else of it (:class:`DraftPolicy` lists the whole interface). Three policies:

* :class:`AlwaysDraft` — every cycle drafts to the tree settings' depth (the fixed-tree methods).
* :class:`NeverDraft` — every cycle is a plain AR step.
* :class:`UtilityGate` — the AR gate of the calibrated methods: it drafts while the measured speedup
  of drafting over the AR step, Ŝ = Σ T_AR / Σ T_d over drafted cycles (:mod:`specfit.engine.online`),
  says drafting pays, after a warm-up that calibrates acceptance and the predictor's error, and
  explores in bounded bursts while it takes AR steps. Where the engine can resolve them
  (:attr:`ShadowState.shadowing`), the warm-up's and the explorations' cycles are shadow cycles: AR
  steps that draft and select a tree without verifying it (SPECFIT.md §3, "Drafting in the AR step's
  shadow"). Its state is one typed object per concern (:class:`GateState`, :class:`ShadowState`) and
  round-trips through JSON (:meth:`UtilityGate.to_json`), so a deployment can save what it learned.

Measurements behind the gate's schedule are in SPECFIT.md §3 ("Measured utility", "Exploration, and
what the rule guarantees") and BENCHMARKS.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Callable, Literal

from specfit.core.errors import SpecFitInputError

#: A cycle's decision: draft and verify; draft only to measure drafting again; an AR step that drafts a
#: tree it does not verify (learned from later); a plain AR step.
Decision = Literal["draft", "explore", "shadow", "ar"]

DECISIONS = ("draft", "explore", "shadow", "ar")
POLICIES = ("gate", "always", "never")


class DraftPolicy:
    """The interface the engine reads; its default answers are those of :class:`AlwaysDraft`."""

    name = "always"

    @property
    def speedup(self) -> float | None:
        """The policy's measured speedup of drafting over AR (None when it measures none)."""
        return None

    def asks_sound_bound(self) -> bool:
        """Whether :meth:`decide` would call its ``sound_can_draft`` now (the engine then launches the
        cycle's first draft level before deciding only if the bound said "draft" last time)."""
        return False

    def sound_said_draft(self) -> bool:
        """The sound bound's last answer in :meth:`decide` (True before any)."""
        return True

    def decided_ahead(self) -> Decision | None:
        """The next cycle's decision when :meth:`decide_ahead` made it, else None."""
        return None

    def decide(self, sound_can_draft: Callable[[], bool] = lambda: True) -> Decision:
        """This cycle's decision; ``sound_can_draft()`` (priced lazily: it predicts the root) is False
        when no draft can beat this cycle's AR step within the model."""
        return "draft"

    def decide_ahead(self) -> None:
        """Make the next cycle's decision now if it needs nothing of that cycle (no-op by default)."""

    def take_ar_ahead(self) -> bool:
        """True, consuming it, if the decision made ahead is an AR step."""
        return False

    def draft_depth(self, depth: int) -> int:
        """Levels a drafted cycle may draft, at most ``depth`` (the tree settings')."""
        return depth

    def set_shadowing(self, on: bool) -> None:
        """Whether AR steps may carry shadow cycles now (the engine can resolve them)."""

    def set_resident(self, on: bool) -> None:
        """Whether every expert is resident in this generation (a drafted cycle's experts cost their reads
        alone, whatever the AR steps before it left in the cache)."""

    def observe_selection(self, draft_nodes: int, selected_depth: int) -> None:
        """Count a verified drafted cycle: ``draft_nodes`` verified (root excluded), its deepest node's depth."""

    def observe_cycle(self, *, gain_ms: float, spent_ms: float) -> None:
        """Learn a drafted cycle's worth: AR decoding's ms for its tokens (``gain_ms``) against its own (``spent_ms``)."""

    def observe_shadow_selection(self, draft_nodes: int) -> None:
        """Count a shadow cycle at its selection."""

    def observe_shadow(self, *, draft_nodes: int, cycle_ms: float, ar_tokens_ms: float) -> None:
        """Learn a resolved shadow cycle."""

    def observe_ar_h2d(self, ms: float) -> None:
        """Record an AR step's modeled H2D ms."""

    def ar_h2d_ms(self) -> float | None:
        """Mean modeled H2D ms of the recent AR steps (None when not recorded)."""
        return None

    def drop_shadows(self, count: int) -> None:
        """Forget ``count`` pending shadow cycles (a generation ended before their outcome)."""

    def to_json(self) -> dict:
        """The policy's learned state as plain JSON (``{"policy": name}`` for a stateless policy)."""
        return {"policy": self.name}


class AlwaysDraft(DraftPolicy):
    """Every cycle drafts, to the full depth: the fixed-tree methods, and the calibrated ones without a gate."""

    name = "always"


class NeverDraft(DraftPolicy):
    """Every cycle is a plain AR step (the root alone is verified)."""

    name = "never"

    def decide(self, sound_can_draft: Callable[[], bool] = lambda: True) -> Decision:
        """``"ar"``."""
        return "ar"


@dataclass
class GateState:
    """What the AR gate carries from cycle to cycle (and generation to generation).

    Attributes
    ----------
    drafted : int
        Verified drafted cycles counted (:meth:`UtilityGate.observe_selection`).
    explorations : int
        Cycles drafted only to explore (the gate preferred the AR step).
    skips : int
        AR steps since the last exploration or drafted decision.
    explore_after : int
        AR steps before the next exploration.
    verified_draft : bool
        Whether the last drafted cycle's selection verified a draft node.
    selected_depth : int or None
        The deepest node the last drafted cycle's selection verified (root 0; None before one).
    burst_left : int
        Exploring cycles left in the current burst.
    burst_unjudged : bool
        An exploration has started whose outcome has not set ``explore_after`` yet.
    burst_shadow : bool
        The current or last exploration is a burst of shadow cycles.
    ahead : str or None
        The next cycle's decision, made ahead (:meth:`UtilityGate.decide_ahead`).
    sound_said_draft : bool
        The sound bound's last answer (True before any).
    gain_ms, spent_ms : float
        Decayed sums over drafted cycles after the warm-up: AR decoding's ms for their tokens, and theirs.
    cleared : bool or None
        None until judged; True while the shadows (or a real exploration near break-even) say real
        drafting may pay: the warm-up and explorations then draft for real; False: they are shadows.
    """

    drafted: int = 0
    explorations: int = 0
    skips: int = 0
    explore_after: int = 4
    verified_draft: bool = False
    selected_depth: int | None = None
    burst_left: int = 0
    burst_unjudged: bool = False
    burst_shadow: bool = False
    ahead: str | None = None
    sound_said_draft: bool = True
    gain_ms: float = 0.0
    spent_ms: float = 0.0
    cleared: bool | None = None


@dataclass
class ShadowState:
    """What the gate knows of shadow cycles.

    Attributes
    ----------
    shadowing : bool
        Whether AR steps can carry a shadow cycle now (set by the engine per generation and AR step).
    drafted : int
        Shadow cycles drafted.
    resolved : int
        Shadow cycles whose outcome is known.
    pending : int
        Drafted, not yet resolved.
    gain_ms, spent_ms : float
        Decayed sums over resolved shadow cycles after the first :attr:`UtilityGate.WARMUP`: AR
        decoding's ms for the tokens each would have committed, and its counterfactual T_d.
    measured : int
        Resolved shadow cycles in those sums.
    selected_draft : bool
        Whether the last shadow cycle's selection held a draft node.
    verified_draft : bool
        Whether the last resolved one's did.
    ar_h2d_ms, ar_steps : float
        Decayed sums: AR steps' modeled H2D ms, and AR steps (what a shadow's head forwards hide behind).
    """

    shadowing: bool = False
    drafted: int = 0
    resolved: int = 0
    pending: int = 0
    gain_ms: float = 0.0
    spent_ms: float = 0.0
    measured: int = 0
    selected_draft: bool = False
    verified_draft: bool = False
    ar_h2d_ms: float = 0.0
    ar_steps: float = 0.0


class UtilityGate(DraftPolicy):
    """The AR gate on measured utility (module docstring; SPECFIT.md §3, "Measured utility").

    It drafts for the first :attr:`WARMUP` drafted cycles (acceptance and the predictor's error are
    being learned: they do not enter Ŝ) and the :attr:`MIN_DRAFTED` after them, then iff Ŝ > 1 and
    the sound bound (:func:`specfit.solvers.stop.draft_can_beat_ar`) does not prove the AR step
    better. While it takes AR steps it explores after ``explore_after`` of them: a burst of
    :attr:`EXPLORE_BURST` drafted cycles, cut short by one that verifies the root alone (the first
    cycles after AR steps pay for experts the AR steps' cache lacks, so one cycle alone under-measures
    drafting; one cycle where every expert is resident); ``explore_after`` starts at :attr:`EXPLORE_FIRST`,
    doubles after an exploration that leaves Ŝ below :attr:`EXPLORE_MARGIN` or verifies the root alone
    (up to :attr:`EXPLORE_MAX`, or further while a burst would lose more than :attr:`EXPLORE_COST` of
    the AR steps between two: :meth:`explore_max`), and
    is ``EXPLORE_FIRST * EXPLORE_BURST`` after one near break-even with drafts verified: a bounded
    share of exploring cycles. An exploration's outcome sets the interval once its last cycle is
    learned (the second decision after it: learning runs one cycle late).

    Exploring costs about 0.2% of modeled tok/s in a 16-slot run where drafting never pays, the price of
    noticing when it starts to pay (BENCHMARKS.md, "Engine mechanisms: what each pays"). The gate pays where drafting loses: with 16 cache slots it takes AR steps and beats drafting every
    cycle, and with every expert resident it drafts as every cycle would (BENCHMARKS.md, "Engine mechanisms: what each pays").

    Attributes
    ----------
    state : GateState
    shadow : ShadowState
    """

    name = "gate"
    #: Forgetting factor of the AR steps' H2D sums, per AR step (~50 steps).
    DECAY = 0.98
    #: Forgetting factor of Ŝ's sums, per drafted cycle (~20 cycles): the gate follows what drafting
    #: is worth now, not while acceptance was still being learned (SPECFIT.md §3, "Measured utility").
    SPEEDUP_DECAY = 0.95
    #: Drafted cycles that calibrate acceptance and the predictor's error before Ŝ measures any.
    WARMUP = 10
    #: Drafted cycles measured before the gate trusts Ŝ (one unlucky cycle must not stop drafting).
    MIN_DRAFTED = 10
    #: AR steps before the first exploration, and the most between two explorations, unless more keep
    #: exploring within :attr:`EXPLORE_COST` (:meth:`explore_max`).
    EXPLORE_FIRST = 4
    EXPLORE_MAX = 128
    #: A real exploration's cycles at Ŝ < 1 lose about ``burst (1/Ŝ - 1)`` AR steps (one committed token
    #: each; more when they commit more); the interval grows past :attr:`EXPLORE_MAX`, up to 8 times it,
    #: until that loss is at most this share of the AR steps between two explorations.
    EXPLORE_COST = 0.002
    #: Consecutive cycles one exploration drafts (fewer if one verifies the root alone); one where every
    #: expert is resident (:meth:`set_resident`): no expert is missing after the AR steps, so the first
    #: cycle measures drafting as well as later ones, and a burst's further cycles would only repeat the
    #: measurement at the cost of an exploring cycle each (lite head, H200 profile, every expert resident,
    #: 30 prompts x 64 tokens: 0.986 -> 0.995 x ar on GSM8K, 0.987 -> 0.993 on CNN/DM; BENCHMARKS.md,
    #: "Engine mechanisms: what each pays").
    EXPLORE_BURST = 4
    #: Ŝ at or above which the gate does not back off between explorations (if they verify draft nodes):
    #: drafting then loses at most 1 - EXPLORE_MARGIN of an AR step per exploring cycle, and one burst
    #: per EXPLORE_FIRST * EXPLORE_BURST AR steps (one cycle in 5) explores.
    EXPLORE_MARGIN = 0.95
    #: Shadow cycles after the first :attr:`WARMUP` (which only calibrate) that may clear real drafting
    #: before the shadow warm-up's end: as soon as this many have measured Ŝ_sh > 1 with drafts verified.
    SHADOW_EARLY = 4

    def __init__(self, state: GateState | None = None, shadow: ShadowState | None = None):
        self.state = state if state is not None else GateState(explore_after=self.EXPLORE_FIRST)
        self.shadow = shadow if shadow is not None else ShadowState()
        self.resident = False  # set per generation by the engine (set_resident); not learned, not saved

    # -- what the engine reads -------------------------------------------------------------------
    @property
    def speedup(self) -> float | None:
        """Ŝ, the measured speedup of drafting over the AR step; None before a drafted cycle is measured."""
        s = self.state
        return s.gain_ms / s.spent_ms if s.spent_ms > 0 else None

    @property
    def shadow_speedup(self) -> float | None:
        """Ŝ_sh, the shadow cycles' T_AR over their counterfactual T_d, decayed like Ŝ (None before one)."""
        sh = self.shadow
        return sh.gain_ms / sh.spent_ms if sh.spent_ms > 0 else None

    def warm(self) -> bool:
        """Whether the warm-up runs: no Ŝ yet, or fewer than :attr:`WARMUP` + :attr:`MIN_DRAFTED` drafted cycles."""
        return self.speedup is None or self.state.drafted < self.WARMUP + self.MIN_DRAFTED

    def asks_sound_bound(self) -> bool:
        """Whether :meth:`decide` would consult the sound bound now: Ŝ > 1 after the warm-up."""
        s = self.speedup
        return s is not None and s > 1.0 and self.state.drafted >= self.WARMUP + self.MIN_DRAFTED

    def sound_said_draft(self) -> bool:
        """The sound bound's last answer (True before any): while True the engine launches a cycle's
        first draft level before asking it."""
        return self.state.sound_said_draft

    def decided_ahead(self) -> Decision | None:
        """The next cycle's decision made by :meth:`decide_ahead`, None if not made."""
        return self.state.ahead

    def draft_depth(self, depth: int) -> int:
        """Levels a drafted cycle may draft: ``depth``, capped during the warm-up (the first
        :attr:`WARMUP` + :attr:`MIN_DRAFTED` drafted cycles) at one level past the deepest node the last
        drafted cycle's selection verified (no cap on the first).

        A cycle learns acceptance only from the children of its accepted nodes, so levels far below
        what the exact selection verifies teach nothing and cost their draft and host time; the cap
        lifts when the warm-up ends (SPECFIT.md §3, "Measured utility"). With 16 cache slots it pays about
        1% of modeled tok/s, and with every expert resident it costs about 1% (its shallower warm-up trees
        commit fewer tokens) (BENCHMARKS.md, "Engine mechanisms: what each pays").

        Returns
        -------
        int in [1, depth]
        """
        s = self.state
        if s.drafted >= self.WARMUP + self.MIN_DRAFTED or s.selected_depth is None:
            return depth
        return min(depth, s.selected_depth + 1)

    # -- deciding --------------------------------------------------------------------------------
    def decide(self, sound_can_draft: Callable[[], bool] = lambda: True) -> Decision:
        """The gate's decision for this cycle (class docstring).

        Parameters
        ----------
        sound_can_draft : callable
            Called only when Ŝ > 1 after the warm-up; returns False when the sound bound
            (:func:`specfit.solvers.stop.draft_can_beat_ar`) proves that no draft beats this cycle's
            AR step within the model.

        Returns
        -------
        Decision
            ``"draft"``, ``"explore"`` (a draft although the AR step is measured better), ``"shadow"``
            (an AR step that drafts and selects a tree in its shadow, where :attr:`ShadowState.shadowing`
            holds and real drafting is not cleared) or ``"ar"``.
        """
        s = self.state
        if s.ahead is not None:
            decision, s.ahead = s.ahead, None
            return decision
        warm = self.warm()
        if warm and not (self.shadow.shadowing and s.cleared is not True):
            return "draft"
        if warm and s.cleared is None:  # the warm-up in the AR steps' shadow, not judged yet
            decision = self._shadow_warmup()
            if decision is not None:
                return decision
        if not warm and self.asks_sound_bound():
            s.sound_said_draft = bool(sound_can_draft())
            if s.sound_said_draft:
                s.skips, s.explore_after, s.burst_left, s.burst_unjudged = 0, self.EXPLORE_FIRST, 0, False
                return "draft"
        going_on = self.shadow.selected_draft if s.burst_shadow else s.verified_draft
        if s.burst_left > 0 and going_on:  # an exploration goes on while it verifies drafts
            s.burst_left -= 1
            return self._explore()
        s.burst_left = 0
        if s.burst_unjudged and s.skips > 0 and not (s.burst_shadow and self.shadow.pending):
            if self._judge_burst(warm):
                return "draft"  # the real warm-up
        if s.skips >= s.explore_after:
            s.burst_shadow = self.shadow.shadowing and s.cleared is not True
            s.burst_left, s.skips, s.burst_unjudged = self._burst_cycles() - 1, 0, True
            return self._explore()
        s.skips += 1
        return "ar"

    def _shadow_warmup(self) -> Decision | None:
        """The warm-up's decision while it runs in the AR steps' shadow and is not judged yet; None once
        judged against real drafting (``cleared`` False: the gate goes on as after AR steps)."""
        s, sh = self.state, self.shadow
        early = sh.measured >= self.SHADOW_EARLY and sh.verified_draft and self.shadow_speedup > 1.0
        if sh.drafted < self.WARMUP + self.MIN_DRAFTED and not early:
            return "shadow"
        if not early and sh.pending:  # its last cycles are not resolved yet
            s.skips += 1
            return "ar"
        s.cleared = early or self.shadows_clear()
        if s.cleared:
            return "draft"  # the real warm-up
        s.skips, s.explore_after, s.burst_left, s.burst_unjudged = 0, self.EXPLORE_FIRST, 0, False
        return None

    def _judge_burst(self, warm: bool) -> bool:
        """Set the exploration interval from the burst just over, its last cycle learned (learning runs
        one cycle late: from the second decision after the burst on; a shadow burst's once its outcomes
        are known). True when a shadow burst cleared real drafting during the warm-up (draft now)."""
        s = self.state
        s.burst_unjudged = False
        if s.burst_shadow:
            if self.shadows_clear():  # drafting may pay: measure it for real, now
                s.cleared = True
                if warm:
                    return True
                s.skips = s.explore_after = self.EXPLORE_FIRST
            else:
                s.explore_after = min(2 * s.explore_after, self.EXPLORE_MAX)
        elif self.speedup < self.EXPLORE_MARGIN or not s.verified_draft:
            # drafting measured clearly slower, or the burst's last selection kept the root alone:
            # explore ever more rarely, in the AR steps' shadow where they can carry one
            s.explore_after = min(2 * s.explore_after, self.explore_max())
            s.cleared = False if self.shadow.shadowing else s.cleared
        else:  # nearly break-even with drafts verified: one burst per EXPLORE_FIRST * EXPLORE_BURST AR steps
            s.explore_after = self.EXPLORE_FIRST * self.EXPLORE_BURST
        return False

    def _burst_cycles(self) -> int:
        """Cycles a real exploration drafts at most: :attr:`EXPLORE_BURST`, one where every expert is resident."""
        return 1 if self.resident else self.EXPLORE_BURST

    def explore_max(self) -> int:
        """The most AR steps between two real explorations: :attr:`EXPLORE_MAX`, or up to 8 times it while Ŝ
        < 1, as many as keep a burst's loss, ``burst (1/Ŝ - 1)`` AR steps, within :attr:`EXPLORE_COST` of them.
        It pays where real explorations lose: lite head, H200 profile, 96 slots, CNN/DM, 30 prompts x 64 tokens,
        exploring cost 0.4% of the run instead of 0.9% (BENCHMARKS.md, "Engine mechanisms: what each pays")."""
        s = self.speedup
        if s is None or s >= 1.0:
            return self.EXPLORE_MAX
        need = math.ceil(self._burst_cycles() * (1.0 / max(s, 1e-9) - 1.0) / self.EXPLORE_COST)
        return min(max(self.EXPLORE_MAX, need), 8 * self.EXPLORE_MAX)

    def _explore(self) -> Decision:
        """One exploring cycle of the current burst: ``"shadow"`` in a shadow burst, else ``"explore"`` (counted)."""
        if self.state.burst_shadow:
            return "shadow"
        self.state.explorations += 1
        return "explore"

    def take_ar_ahead(self) -> bool:
        """True, consuming it, if the decision made ahead (:meth:`decide_ahead`) is an AR step: the engine
        then takes the AR step without entering its drafting path (what :meth:`decide` would return)."""
        if self.state.ahead == "ar":
            self.state.ahead = None
            return True
        return False

    def decide_ahead(self) -> None:
        """Make the next cycle's decision now, if it needs nothing of that cycle: :meth:`decide` then
        returns it. The sound bound needs the next root and cache, so while :meth:`asks_sound_bound`
        nothing is decided ahead.

        The engine calls it in an AR step's learning slot, after learning the cycle before: after an AR
        step nothing else the gate reads changes before the next decision, so the decision is the one
        :meth:`decide` would make at the next cycle's start, and a run of AR steps puts no host time for
        the gate on the critical path (SPECFIT.md §3, "Exploration, and what the rule guarantees"). It pays
        the gate's host ms of each AR step, hidden behind that step's verify (part of the hidden host ms, (BENCHMARKS.md, "Engine mechanisms: what each pays"))."""
        if self.state.ahead is None and not self.asks_sound_bound():
            self.state.ahead = self.decide()

    # -- learning --------------------------------------------------------------------------------
    def set_shadowing(self, on: bool) -> None:
        """Whether AR steps may carry shadow cycles now (the engine can resolve them)."""
        self.shadow.shadowing = bool(on)

    def set_resident(self, on: bool) -> None:
        """Whether every expert is resident in this generation: an exploration then drafts one cycle
        (:attr:`EXPLORE_BURST`)."""
        self.resident = bool(on)

    def observe_selection(self, draft_nodes: int, selected_depth: int) -> None:
        """Count one verified drafted cycle right after its verify: ``draft_nodes`` verified (root
        excluded; 0: the root alone), ``selected_depth`` the deepest verified node's depth."""
        self.state.verified_draft, self.state.selected_depth = draft_nodes > 0, int(selected_depth)
        self.state.drafted += 1

    def observe_cycle(self, *, gain_ms: float, spent_ms: float) -> None:
        """Learn one drafted cycle's T_AR (``gain_ms``) and T_d (``spent_ms``) into Ŝ, once the first
        :attr:`WARMUP` drafted cycles (calibrating: not what drafting will be worth) are over."""
        s = self.state
        if s.drafted <= self.WARMUP:
            return
        g = self.SPEEDUP_DECAY
        s.gain_ms = g * s.gain_ms + float(gain_ms)
        s.spent_ms = g * s.spent_ms + float(spent_ms)

    def observe_shadow_selection(self, draft_nodes: int) -> None:
        """Count one shadow cycle at its selection (``draft_nodes`` its selection holds, root excluded)."""
        self.shadow.drafted += 1
        self.shadow.pending += 1
        self.shadow.selected_draft = draft_nodes > 0

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
        sh = self.shadow
        sh.pending = max(sh.pending - 1, 0)
        sh.resolved += 1
        sh.verified_draft = draft_nodes > 0
        if sh.resolved <= self.WARMUP:  # calibrating: not what drafting will be worth
            return
        g = self.SPEEDUP_DECAY
        sh.gain_ms = g * sh.gain_ms + float(ar_tokens_ms)
        sh.spent_ms = g * sh.spent_ms + float(cycle_ms)
        sh.measured += 1

    def observe_ar_h2d(self, ms: float) -> None:
        """Record one AR step's modeled H2D ms (its copied experts' ms): what a shadow's head forwards hide behind."""
        d = self.DECAY
        self.shadow.ar_h2d_ms = d * self.shadow.ar_h2d_ms + float(ms)
        self.shadow.ar_steps = d * self.shadow.ar_steps + 1.0

    def ar_h2d_ms(self) -> float | None:
        """Mean modeled H2D ms of the recent AR steps (decayed; None before one)."""
        return self.shadow.ar_h2d_ms / self.shadow.ar_steps if self.shadow.ar_steps > 0 else None

    def drop_shadows(self, count: int) -> None:
        """Forget ``count`` pending shadow cycles whose outcome will never be known (a generation ended)."""
        self.shadow.pending = max(self.shadow.pending - int(count), 0)

    def shadows_clear(self) -> bool:
        """Whether the shadow cycles say real drafting may pay: Ŝ_sh >= :attr:`EXPLORE_MARGIN` and the last
        resolved shadow's selection verified a draft node."""
        s = self.shadow_speedup
        return s is not None and s >= self.EXPLORE_MARGIN and self.shadow.verified_draft

    # -- saving ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        """``{"policy": "gate", "state": {...}, "shadow": {...}}``: every field of :class:`GateState` and
        :class:`ShadowState` (numbers, booleans, null, one string)."""
        return {"policy": self.name, "state": asdict(self.state), "shadow": asdict(self.shadow)}


#: JSON type of the state fields whose default is None (the others take their default's type).
_NULLABLE = {"selected_depth": int, "ahead": str, "cleared": bool}


def _json_value_ok(value, kind: type) -> bool:
    """Whether ``value`` is a JSON value of ``kind`` (bool, int, float: finite, str)."""
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def _dataclass_from_json(cls, data, field_name: str):
    """``cls(**data)`` with exactly ``cls``'s fields, each of its JSON type; SpecFitInputError naming
    ``field_name.<field>`` otherwise."""
    if not isinstance(data, dict):
        raise SpecFitInputError(field_name, "must be a JSON object")
    names = {f.name for f in fields(cls)}
    if set(data) != names:
        raise SpecFitInputError(field_name, f"must have exactly the fields {sorted(names)}, got {sorted(data)}")
    default = cls()
    for name, value in data.items():
        nullable = name in _NULLABLE
        if nullable and value is None:
            continue
        kind = _NULLABLE[name] if nullable else type(getattr(default, name))
        if not _json_value_ok(value, kind) or (name == "ahead" and value not in DECISIONS):
            raise SpecFitInputError(f"{field_name}.{name}", f"must be {kind.__name__}, got {value!r}")
    return cls(**data)


def policy_from_json(data) -> DraftPolicy:
    """The policy :meth:`DraftPolicy.to_json` wrote.

    Raises
    ------
    SpecFitInputError
        An unknown policy name, or a state whose fields or types differ from the policy's.
    """
    name = data.get("policy") if isinstance(data, dict) else None
    if name not in POLICIES:
        raise SpecFitInputError("policy", f"must be one of {POLICIES}, got {name!r}")
    if name != "gate":
        return make_policy(name)
    return UtilityGate(_dataclass_from_json(GateState, data.get("state"), "policy.state"),
                       _dataclass_from_json(ShadowState, data.get("shadow"), "policy.shadow"))


def make_policy(name: str | DraftPolicy) -> DraftPolicy:
    """A fresh policy by name: ``"gate"`` (:class:`UtilityGate`), ``"always"``, ``"never"``; a policy as is.

    Raises
    ------
    SpecFitInputError
        An unknown name (field ``policy``).
    """
    if isinstance(name, DraftPolicy):
        return name
    kinds = {"gate": UtilityGate, "always": AlwaysDraft, "never": NeverDraft}
    if name not in kinds:
        raise SpecFitInputError("policy", f"must be one of {POLICIES}, got {name!r}")
    return kinds[name]()
