"""The decoding cycle: decide → draft → predict → select → verify → accept → record; methods are configurations.

Joins the solvers with a duck-typed target, drafter and predictor (it imports no model code).
"""

from specfit.engine.clock import CountedClock, FrozenClock, MeasuredClock
from specfit.engine.decoder import (METHODS, CycleOutcome, CycleRecord, Generation, Method, SpecDecoder, TreeSettings,
                                    get_method)
from specfit.engine.online import OnlineModel
from specfit.engine.policy import AlwaysDraft, DraftPolicy, NeverDraft, UtilityGate

__all__ = ["METHODS", "AlwaysDraft", "CountedClock", "CycleOutcome", "CycleRecord", "DraftPolicy", "FrozenClock",
           "Generation",
           "MeasuredClock", "Method", "NeverDraft", "OnlineModel", "SpecDecoder", "TreeSettings", "UtilityGate",
           "get_method"]
