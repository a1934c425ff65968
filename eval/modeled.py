"""Modeled cycle time of a recorded decoding cycle on the real deployment (labelled "modeled").

A cycle recorded on this machine (:class:`specfit.engine.CycleRecord`) is priced on the
deployment a hardware profile describes (Qwen3-30B-A3B on one GPU, experts behind a PCIe link):

    modeled_ms = verify_ms + draft_ms + host_ms

    verify_ms = profile.for_layers(L).cycle_ms(nodes_verified, transferred)
              = fixed_ms + per_node_ms * nodes_verified + per_expert_ms * (48 / L) * sum_l transferred[l]
    draft_ms  = levels * DRAFT_LEVEL_MS[profile]
    host_ms   = predict_ms + solve_ms          (measured here)

* verify: SPECFIT.md §3's T(S) with the *measured* counts of the cycle — nodes the target
  verified (root included) and experts the runtime really copied per MoE layer. A proxy with
  L < 48 MoE layers stands for the 48-layer target: each layer's miss count is taken for 48 / L
  real layers (:meth:`specfit.core.cost.CostModel.for_layers`), so the expert term keeps its weight
  against ``fixed_ms`` and ratios between methods stay honest. The engine's selection uses the
  same scaled model.
* draft: one EAGLE-3 head forward per draft level (:data:`DRAFT_LEVEL_MS`).
* host: the expert predictor and the solver run on the host CPU in deployment as well, so their
  measured wall-clock time is added as is. On the proxy they see L-layer instances (48 in
  deployment), which understates them; they are reported separately (``solve_share``).

Not modeled: the prefill (excluded from every tokens/s figure) and the verifier's accept step
(part of ``fixed_ms``).
"""

from __future__ import annotations

from specfit.core.cost import CostModel

#: Modeled time of one EAGLE-3 draft level (one head forward over the level's frontier), ms.
#:
#: Derivation: the Qwen3-30B-A3B EAGLE-3 head (SPECFIT.md §5: fc 3·2048→2048, one Llama decoder
#: layer with a 2H attention input and a 6,144-wide MLP, lm_head over a 32k draft vocabulary) has
#: ~0.15 B parameters ≈ 0.3 GB in bf16. A level is memory-bound at these batch sizes (<= 16 rows):
#:
#: * ``qwen3-30b-a3b-pcie4`` (RTX 4090 class, ~1 TB/s): 0.3 ms of weight reads + ~15 kernel
#:   launches and the top-k host sync (~0.2 ms) ≈ 0.5 ms;
#: * ``qwen3-30b-a3b-h200`` (~4.8 TB/s): 0.06 ms + ~0.2 ms ≈ 0.25 ms.
#:
#: These are estimates from datasheet bandwidths, not measurements; a calibrated value replaces
#: them when a GPU run is available (``models/eagle3.py`` on CUDA, timed per level).
DRAFT_LEVEL_MS: dict[str, float] = {
    "qwen3-30b-a3b-pcie4": 0.5,
    "qwen3-30b-a3b-h200": 0.25,
}

#: MoE layers of the deployed target the profiles describe (Qwen3-30B-A3B).
REFERENCE_LAYERS = 48


def cost_scaling_note(num_layers: int, profile: str) -> str:
    """One sentence that says how modeled time scales for a target with ``num_layers`` MoE layers."""
    if num_layers == REFERENCE_LAYERS:
        return f"Modeled times use profile {profile} with the measured per-layer expert transfers as they are."
    return (f"Modeled times use profile {profile} for the {REFERENCE_LAYERS}-layer Qwen3-30B-A3B: the model "
            f"evaluated has {num_layers} MoE layers, so each layer's measured expert transfers stand for "
            f"{REFERENCE_LAYERS}/{num_layers} = {REFERENCE_LAYERS / num_layers:.2f} real layers (per_expert_ms "
            f"scaled by that factor, CostModel.for_layers); the engine's selection uses the same scaled model.")


def modeled_cycle_ms(cycle: dict, cost: CostModel, draft_level_ms: float) -> dict[str, float]:
    """Modeled time of one recorded cycle, split into its parts (module docstring).

    Parameters
    ----------
    cycle : dict
        A :class:`specfit.engine.CycleRecord` as a dict (``dataclasses.asdict``); uses
        ``nodes_verified``, ``transferred`` (length L), ``levels``, ``predict_ms``, ``solve_ms``.
    cost : CostModel
        The profile scaled to the model's layers, ``get_profile(name).for_layers(L)``.
    draft_level_ms : float
        Modeled ms per draft level, :data:`DRAFT_LEVEL_MS` of the profile.

    Returns
    -------
    dict
        ``{"compute_ms", "transfer_ms", "draft_ms", "host_ms", "total_ms"}`` in ms: the verify's
        expert-independent part, its H2D part, drafting, host predictor + solver, and their sum.
    """
    verify = cost.cycle_ms(cycle["nodes_verified"], cycle["transferred"])
    compute = cost.fixed_ms + cost.per_node_ms * cycle["nodes_verified"]
    draft = cycle["levels"] * draft_level_ms
    host = cycle["predict_ms"] + cycle["solve_ms"]
    return {"compute_ms": compute, "transfer_ms": verify - compute, "draft_ms": draft, "host_ms": host,
            "total_ms": verify + draft + host}
