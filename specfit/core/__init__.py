"""The core data model: draft trees, instances, cost models, the objective and input errors.

Imports neither torch nor transformers (docs/ARCHITECTURE.md): everything above builds on it.
"""
