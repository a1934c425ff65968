"""Host-work prices: what the engine's host CPU work (expert predictor, draft tree, solver, bookkeeping,
online learning) costs per count, the constants a counted clock (:class:`specfit.engine.clock.CountedClock`)
charges instead of measuring this machine's CPU time.

The engine charges each piece of host work where it runs (``SpecDecoder`` calls ``clock.charge(kind, n)``):

==================  ==========================================================  ==========================
kind                host work                                                   count ``n``
==================  ==========================================================  ==========================
``cycle``           a cycle's bookkeeping: the policy's decision, the verify's   1 per cycle
                    inputs, the lookahead demand, the acceptance queue
``drafted``         a drafted cycle's start: the root's cost model, the stop    1 per drafted cycle
                    rule's constants, the AR gate's sound bound
``level``           one draft level's tree work: calibration, pruning, the      1 per draft level
                    stop rule's bounds
``level_node``      the same, per node the level drafted                        nodes of the level
``predict``         one expert-predictor call                                   1 per call
``predict_node``    the same, per node predicted                                nodes predicted
``solve``           one selection solve (a stop-rule ask or the final one)      1 per solve
``solve_node``      the same, per node of the priced tree                       nodes of the tree
``learn``           one cycle's online learning: the AR twin's replay, the      1 per learned cycle
                    online model's update, the next gate's inputs
``learn_node``      acceptance learning, per drafted node it learns from         drafted nodes
==================  ==========================================================  ==========================

The modeled host time of a piece of work is ``price[kind] * n`` ms: a function of the counts alone, so
the same command prices the same cycles the same on any machine. The constants are a fit of this
machine's measured host CPU time to those counts (:data:`HOST_COSTS`, its source there); a profile
file may carry its own (``host_costs``: :func:`host_costs_from_json`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from specfit.core.errors import SpecFitInputError

#: The kinds of host work the engine charges, in the order of :class:`HostCosts`' fields.
HOST_WORK = ("cycle", "drafted", "level", "level_node", "predict", "predict_node", "solve", "solve_node", "learn",
             "learn_node")


@dataclass(frozen=True)
class HostCosts:
    """ms of host CPU work per count, one field per kind of :data:`HOST_WORK` (module docstring).

    Raises
    ------
    SpecFitInputError
        A price that is not a finite number >= 0 (field ``host_costs.<kind>``).
    """

    cycle: float
    drafted: float
    level: float
    level_node: float
    predict: float
    predict_node: float
    solve: float
    solve_node: float
    learn: float
    learn_node: float
    source: str = ""

    def __post_init__(self):
        for f in fields(self):
            if f.name != "source":
                object.__setattr__(self, f.name, check_price(f"host_costs.{f.name}", getattr(self, f.name)))

    def ms(self, kind: str, n: float = 1.0) -> float:
        """Modeled ms of ``n`` counts of host work ``kind`` (a name of :data:`HOST_WORK`).

        Raises
        ------
        SpecFitInputError
            An unknown kind (field ``kind``).
        """
        if kind not in HOST_WORK:
            raise SpecFitInputError("kind", f"must be one of {', '.join(HOST_WORK)}, got {kind!r}")
        return getattr(self, kind) * n

    def to_json(self) -> dict:
        """``{kind: ms}`` for every kind, and ``source`` when it is set (a profile file's ``host_costs``)."""
        out = {k: getattr(self, k) for k in HOST_WORK}
        if self.source:
            out["source"] = self.source
        return out


def check_price(name: str, value) -> float:
    """``value`` as a float if it is a finite number >= 0 (ms per count); else one error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise SpecFitInputError(name, f"must be a finite number of ms >= 0, got {value!r}")
    return float(value)


def host_costs_from_json(obj, where: str = "profile.host_costs") -> HostCosts:
    """Host prices from their JSON object: every kind of :data:`HOST_WORK` (ms per count, required) and an
    optional ``source`` (text: where the numbers come from).

    Raises
    ------
    SpecFitInputError
        One error naming the field (``<where>.<kind>``): not an object, an unknown key, a kind missing,
        a price negative, NaN, infinite or not a number.
    """
    if not isinstance(obj, dict):
        raise SpecFitInputError(where, f"must be an object of ms per count ({', '.join(HOST_WORK)})")
    extra = set(obj) - set(HOST_WORK) - {"source"}
    if extra:
        raise SpecFitInputError(f"{where}.{sorted(extra)[0]}", f"is not a kind of host work ({', '.join(HOST_WORK)})")
    prices = {}
    for k in HOST_WORK:
        if k not in obj:
            raise SpecFitInputError(f"{where}.{k}", "is required (ms per count)")
        prices[k] = check_price(f"{where}.{k}", obj[k])
    return HostCosts(**prices, source=str(obj.get("source", "")))


#: The engine's host prices on this project's CPU (every profile's: the host CPU does the same work
#: whichever GPU verifies), ms per count. Source: a non-negative least-squares fit of the engine's measured
#: host CPU ms per cycle (thread time, ``time.thread_time``, hidden parts included) to the counts it
#: charged, ``python -m specfit.eval.host_cost_fit --limit 4 --max-new-tokens 48`` (the shipped proxy, lite
#: head, 32 slots, methods ar, eagle3, eagle3-scan, specfit; fitted on 649 GSM8K cycles, per-cycle relative
#: residual 0.20; on 676 held-out CNN/DM cycles 0.21, each method's total host ms predicted at 0.83-1.27x
#: the measured) on the 2-vCPU AMD EPYC VM of BENCHMARKS.md, shared with other jobs ("Host work priced
#: from counts"). A kind the fit set to 0 (``level``, ``solve_node``) is explained by the others
#: (``level_node``, ``solve``) on these trees.
HOST_COSTS = HostCosts(cycle=0.00769, drafted=0.43489, level=0.0, level_node=0.01368, predict=0.19458,
                       predict_node=0.00361, solve=0.24455, solve_node=0.0, learn=0.43501, learn_node=0.00994,
                       source="NNLS fit of measured host CPU ms per cycle to the charged counts, python -m "
                              "specfit.eval.host_cost_fit --limit 4 --max-new-tokens 48 (2-vCPU AMD EPYC VM, shared)")

__all__ = ["HOST_COSTS", "HOST_WORK", "HostCosts", "check_price", "host_costs_from_json"]
