"""Offloaded Qwen3-MoE runtime: checkpoint loading, forward modes (prefill, decode, tree verify), KV.

Public API::

    from specfit.models.qwen3_moe import OffloadedQwen3Moe, ForwardOutput, greedy_generate
    model = OffloadedQwen3Moe.from_pretrained(DIR, device="cpu", cache_slots=4)
"""

from specfit.models.qwen3_moe.config import ARCHITECTURE, CheckpointError, Qwen3MoeSpec, read_spec
from specfit.models.qwen3_moe.generate import greedy_generate
from specfit.models.qwen3_moe.model import ForwardOutput, OffloadedQwen3Moe, default_aux_layers

__all__ = ["ARCHITECTURE", "CheckpointError", "ForwardOutput", "OffloadedQwen3Moe", "Qwen3MoeSpec",
           "default_aux_layers", "greedy_generate", "read_spec"]
