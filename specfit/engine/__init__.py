"""The decoding cycle: draft → predict → select → verify → accept → record; methods are configurations.

Joins the solvers with a duck-typed target, drafter and predictor (it imports no model code).
"""

from specfit.engine.decoder import (METHODS, CycleRecord, Generation, Method, SpecDecoder, TreeSettings,
                                    get_method)

__all__ = ["METHODS", "CycleRecord", "Generation", "Method", "SpecDecoder", "TreeSettings", "get_method"]
