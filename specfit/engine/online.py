"""What the engine learns online from its own verifies, across the generations of one deployment.

Four things the cycle's objective needs and no datasheet gives (SPECFIT.md §3):

* **Calibrated acceptance** (:class:`specfit.core.acceptance.AcceptanceCalibrator`): draft path
  probabilities → acceptance probabilities.
* **The expert predictor's error, priced.** The selection prices the *predicted* experts of its nodes;
  the verify pays for the *true* ones. Two per-layer corrections, learned from every verify:

      e_l = E[ |true root experts \\ C|_l - |predicted root experts \\ C|_l ]          (the root)
      m_l = E[ (transferred_l - |true root experts \\ C|_l)
               - (|predicted union of S \\ C|_l - |predicted root experts \\ C|_l) ] per draft node

  (C the cache at the cycle's start; ``w_l`` an uncached expert's copy and read, ``per_expert_ms + read_ms``,
  :func:`missed_expert_ms`). The selection then uses ``fixed_ms + Σ_l w_l e_l`` (never below
  the cost of a root with no uncached expert, nor below 0) and ``per_node_ms + max(0, Σ_l w_l m_l)``
  (:meth:`OnlineModel.corrected_cost`): a draft node costs, on average, the experts the predictor
  missed. The solver stays exact for this corrected model; the stop rule's proof needs only that
  every node costs at least ``per_node_ms``, which the correction keeps. A host-regime profile
  (``offload="host"``/``"auto"``) gets the node correction as a per-draft-node term outside its
  per-layer max (``HostProfile.node_extra_ms``): the missed experts computed on the host.
* **The host's own cost, measured.** The predictor, the tree and the solver run on the host CPU every
  drafted cycle. The engine measures that CPU time per draft level and for the rest of the cycle
  (:mod:`specfit.engine.clock`); :meth:`OnlineModel.host_level_ms` replaces the profile's
  ``host_level_ms`` (a prior from benchmarks) in the level cost of the selection, the stop rule and
  the gate, and :meth:`OnlineModel.host_cycle_ms` is a cost every drafted cycle pays whatever it
  verifies (added to the selection's sunk ms, like the levels already drafted). Decayed means: one
  cycle's own CPU time is noisy, and at break-even the noise alone flips the gate between runs.
* **Whether drafting pays** (:attr:`OnlineModel.policy`, :mod:`specfit.engine.policy`). Every drafted
  cycle carries its own counterfactual: plain AR decoding would have committed the same τ tokens in τ
  one-token forwards, so what they cost in AR decoding's own expert cache, replayed by the engine (the
  AR twin, :mod:`specfit.engine.twin`), is known after the fact. ``T_d``, the drafted cycle's time, is
  its verify priced on the measured counts (the experts copied and every expert its nodes routed to,
  each read once), its draft levels and its host ms as the selection charges
  them. The policy learns ``Ŝ = Σ_d T_AR(d) / Σ_d T_d`` (decayed) and gates drafting on it (Cascade,
  arXiv 2506.20675, gates speculation by its measured utility in the same way).

A verify's acceptance learning is queued (:meth:`OnlineModel.defer`) and runs while the device
computes the next cycle's verify, as does the engine's learning of a cycle's outcome
(:meth:`OnlineModel.observe`, :meth:`OnlineModel.observe_host`): the gate and the selection see it one
cycle late. Decayed sums forget with factor :attr:`OnlineModel.DECAY` per observation (an effective
window of ~50 cycles), so the model follows a change of prompt, domain or cache pressure.

What survives a generation round-trips through plain JSON (:meth:`OnlineModel.to_json`,
:meth:`OnlineModel.from_json`), so a deployment can save what it learned and start from it again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Callable

import numpy as np

from specfit.core.acceptance import AcceptanceCalibrator
from specfit.core.cost import CostModel, HostProfile, check_ms
from specfit.core.errors import SpecFitInputError
from specfit.engine.policy import DraftPolicy, make_policy, policy_from_json

#: :meth:`OnlineModel.to_json`'s format version.
FORMAT = 1


class OnlineModel:
    """The engine's online state, shared by the decoders of one deployment (module docstring).

    Parameters
    ----------
    depth : int
        Draft depth (the acceptance calibrator's depths).
    policy : str or DraftPolicy
        Whether and how far a cycle drafts (:func:`specfit.engine.policy.make_policy`): ``"gate"``
        (default, the AR gate on measured utility), ``"always"`` or ``"never"``.

    Attributes
    ----------
    acceptance : AcceptanceCalibrator
    policy : DraftPolicy
    root_error, node_extra : numpy.ndarray of shape (L,) or None
        Decayed sums of the root's and the draft nodes' unpredicted uncached experts (module docstring).
    root_weight, node_weight : float
        Their decayed weights.
    host_ms : list of 4 float
        Decayed sums: level host ms, levels, rest-of-cycle host ms, drafted cycles.
    min_expert_ms : deque
        The last :attr:`GATE_WINDOW` drafted cycles' cheapest draft node's expert ms (the sound gate's bound).
    deferred : list
        Learning queued until the next verify (:meth:`defer`), oldest first.
    """

    #: Forgetting factor of the corrections' decayed sums, per observation (~50 cycles).
    DECAY = 0.98
    #: Drafted cycles over which the sound gate's cheapest-node expert bound is taken.
    GATE_WINDOW = 4

    def __init__(self, depth: int, policy: str | DraftPolicy = "gate"):
        self.depth = int(depth)
        self.acceptance = AcceptanceCalibrator(max_depth=depth)
        self.policy = make_policy(policy)
        self.root_error = None  # (L,) decayed sum of true - predicted uncached root experts
        self.root_weight = 0.0
        self.node_extra = None  # (L,) decayed sum of unpredicted experts of draft nodes
        self.node_weight = 0.0
        self._weighted = None  # (w, Σ w e, Σ w m): corrected_cost's terms until the corrections change
        self.min_expert_ms: deque = deque(maxlen=self.GATE_WINDOW)
        self.host_ms = [0.0, 0.0, 0.0, 0.0]  # decayed sums: level host ms, levels, rest-of-cycle host ms, cycles
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

    def node_correction_ms(self, cost: CostModel | HostProfile) -> float:
        """ms one verified draft node adds for the experts the predictor missed: ``max(0, Σ_l w_l m_l)``
        with ``w`` = :func:`missed_expert_ms` (a host-regime profile: ``node_extra_ms`` of
        :meth:`corrected_cost`); 0 before a drafted verify. The node term of :meth:`corrected_cost`, and
        the price a shadow cycle charges each node it would have rejected."""
        m = self.node_correction()
        if m is None:
            return 0.0
        if isinstance(cost, HostProfile):  # each missed expert computed on the host for one row, R / L scaled
            c = cost.reference_layers / m.size if m.size else 0.0
            return max(0.0, c * (cost.host_per_expert_ms + cost.host_per_row_ms) * float(m.sum()))
        return max(0.0, float(self.weighted_corrections(missed_expert_ms(cost, m.size))[1]))

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
            if self.node_correction() is None:
                return cost
            return replace(cost, node_extra_ms=self.node_correction_ms(cost))
        if not self.root_weight and not self.node_weight:
            return cost
        w = missed_expert_ms(cost, (self.root_error if self.root_weight else self.node_extra).size)
        we, wm = self.weighted_corrections(w)
        root_ms = float(w @ np.asarray(root_new_per_layer, dtype=np.float64))
        fixed = cost.fixed_ms + (max(we, -root_ms) if we is not None else 0.0)
        per_node = cost.per_node_ms + (max(0.0, wm) if wm is not None else 0.0)
        fixed = max(fixed, 0.0)
        if fixed + per_node <= 0:  # a cost model's cycle takes time: keep the uncorrected fixed_ms
            fixed = cost.fixed_ms
        return cost.with_costs(check_ms("fixed_ms", fixed), check_ms("per_node_ms", per_node))


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
            self.policy.observe_selection(draft_nodes, selected_depth)
        if draft_nodes > 0:
            extra = ((np.asarray(transferred, dtype=np.float64) - np.asarray(root_true_new, dtype=np.float64))
                     - (np.asarray(selected_predicted_new, dtype=np.float64)
                        - np.asarray(root_predicted_new, dtype=np.float64)))
            self.node_extra = extra if self.node_extra is None else d * self.node_extra + extra
            self.node_weight = d * self.node_weight + draft_nodes
        gain = committed * float(ar_ms) if ar_tokens_ms is None else float(ar_tokens_ms)
        self.policy.observe_cycle(gain_ms=gain, spent_ms=float(cycle_ms))

    # -- saving and restoring -------------------------------------------------------------------
    def to_json(self) -> dict:
        """What this model learned, as plain JSON (numbers, lists, booleans, null; no NaN or infinity).

        ``{"format": 1, "depth", "acceptance": {max_depth, prior_strength, edges, rank_classes, trials,
        accepted, path_predicted, path_accepted, path_factor}, "corrections": {root_error, root_weight,
        node_extra, node_weight}, "host_ms", "min_expert_ms", "policy": DraftPolicy.to_json()}``.
        :meth:`from_json` restores a model that decides, prices and learns as this one does.

        Raises
        ------
        SpecFitInputError
            While learning is queued (field ``deferred``): a generation flushes it before it returns.
        """
        if self.deferred:
            raise SpecFitInputError("deferred", "learning is still queued; save between generations")
        a = self.acceptance
        return {"format": FORMAT, "depth": self.depth,
                "acceptance": {"max_depth": a.max_depth, "prior_strength": a.prior_strength,
                               "edges": a.edges.tolist(), "rank_classes": a.rank_classes,
                               **{k: getattr(a, k).tolist() for k in _ACCEPTANCE_TABLES}},
                "corrections": {"root_error": _list_or_none(self.root_error), "root_weight": self.root_weight,
                                "node_extra": _list_or_none(self.node_extra), "node_weight": self.node_weight},
                "host_ms": list(self.host_ms), "min_expert_ms": list(self.min_expert_ms),
                "policy": self.policy.to_json()}

    @classmethod
    def from_json(cls, data) -> "OnlineModel":
        """The model :meth:`to_json` wrote.

        Raises
        ------
        SpecFitInputError
            A missing field, an unknown format, a table of the wrong shape, or a number that is not
            finite (each names the field).
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise SpecFitInputError("format", f"must be {FORMAT} (an OnlineModel.to_json object)")
        a = _field(data, "acceptance", dict)
        model = cls(_field(data, "depth", int), policy_from_json(_field(data, "policy", dict)))
        cal = AcceptanceCalibrator(max_depth=_field(a, "max_depth", int), prior_strength=_field(a, "prior_strength", float),
                                   edges=_floats(a, "edges", None), rank_classes=_field(a, "rank_classes", int))
        for name in _ACCEPTANCE_TABLES:
            setattr(cal, name, _floats(a, name, getattr(cal, name).shape))
        cal.refresh()
        model.acceptance = cal
        c = _field(data, "corrections", dict)
        model.root_error = None if c.get("root_error") is None else _floats(c, "root_error", None)
        model.node_extra = None if c.get("node_extra") is None else _floats(c, "node_extra", None)
        model.root_weight, model.node_weight = _field(c, "root_weight", float), _field(c, "node_weight", float)
        model.host_ms = _floats(data, "host_ms", (4,)).tolist()
        model.min_expert_ms.extend(_floats(data, "min_expert_ms", None).tolist())
        return model


#: The acceptance calibrator's learned tables (the rest of its state is derived: ``refresh``).
_ACCEPTANCE_TABLES = ("trials", "accepted", "path_predicted", "path_accepted", "path_factor")


def _list_or_none(x) -> list | None:
    return None if x is None else np.asarray(x).tolist()


def _field(data: dict, name: str, kind: type):
    """``data[name]`` as ``kind`` (int, float or dict); a float is finite."""
    value = data.get(name) if isinstance(data, dict) else None
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
        return float(value)
    if kind is not float and isinstance(value, kind) and not isinstance(value, bool):
        return value
    raise SpecFitInputError(name, f"must be {'a finite number' if kind is float else kind.__name__}, got {value!r}")


def _floats(data: dict, name: str, shape: tuple | None) -> np.ndarray:
    """``data[name]`` as a finite float64 array (of ``shape`` where given)."""
    try:
        x = np.asarray(data[name], dtype=np.float64)
    except (KeyError, TypeError, ValueError):
        raise SpecFitInputError(name, "must be a (nested) list of numbers") from None
    if (shape is not None and x.shape != tuple(shape)) or (shape is None and x.ndim != 1):
        raise SpecFitInputError(name, f"must have shape {shape if shape is not None else '(n,)'}, got {x.shape}")
    if not np.isfinite(x).all():
        raise SpecFitInputError(name, "must hold finite numbers")
    return x


def missed_expert_ms(cost: CostModel, num_layers: int) -> np.ndarray:
    """ms of one uncached expert per MoE layer that the predictor missed, float64 of shape (num_layers,):
    its H2D copy and its device-memory read (:meth:`CostModel.uncached_ms_array`, ``per_expert_ms +
    read_ms``; SPECFIT.md §3), the same array on every call (the corrections' memo keys on it).

    Raises
    ------
    SpecFitInputError
        If a per-layer ``per_expert_ms`` list does not have ``num_layers`` entries."""
    return cost.uncached_ms_array(num_layers)
