"""The core data model: the draft tree and its coverage accounting against the expert cache, instances,
cost models and hardware profiles, the objective, input errors and atomic writes.

Imports neither torch nor transformers (docs/ARCHITECTURE.md): everything above builds on it.
"""
