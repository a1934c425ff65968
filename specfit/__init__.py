"""SpecFit: throughput-optimal speculative decoding for MoE models with offloaded experts.

The public API (README.md, "Python API")::

    import specfit

    specfit.select(tree, "qwen3-30b-a3b-pcie4", cache)      # the solver layer alone (no torch)
    sf = specfit.SpecFit.from_pretrained(target_dir, draft_dir, cache_slots=32)
    out = sf.generate("text or ids", method="specfit", max_new_tokens=64)
    specfit.evaluate(datasets="gsm8k", limit=2)             # the ``specfit eval`` run

Names load on first use (PEP 562): ``import specfit`` imports neither torch nor transformers, and
the solver-layer names (``select``, ``DraftTree``, ``CostModel``, ...) never do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: The package version; ``specfit --version`` prints it and the installed metadata is read from it
#: (pyproject.toml, ``[tool.setuptools.dynamic]``).
__version__ = "0.2.0"

#: Public name -> module that defines it.
_LAZY: dict[str, str] = {
    # solver layer (no torch)
    "select": "specfit.solvers",
    "Selection": "specfit.solvers",
    "available_solvers": "specfit.solvers",
    "DraftTree": "specfit.core.tree",
    "load_instance": "specfit.core.instance",
    "CostModel": "specfit.core.cost",
    "get_profile": "specfit.core.cost",
    "SpecFitInputError": "specfit.core.errors",
    # decoding (torch)
    "SpecFit": "specfit.pipeline",
    "GenerateOutput": "specfit.pipeline",
    "TreeSettings": "specfit.engine",
    "METHODS": "specfit.engine",
    # evaluation
    "evaluate": "specfit.eval.run",
    "EvalConfig": "specfit.eval.run",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:
    from specfit.core.cost import CostModel, get_profile
    from specfit.core.errors import SpecFitInputError
    from specfit.core.instance import load_instance
    from specfit.core.tree import DraftTree
    from specfit.engine import METHODS, TreeSettings
    from specfit.eval.run import EvalConfig, evaluate
    from specfit.pipeline import GenerateOutput, SpecFit
    from specfit.solvers import Selection, available_solvers, select


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (PEP 562) and cache the name here."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'specfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
