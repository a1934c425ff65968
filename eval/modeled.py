"""Modeled cycle time of a recorded decoding cycle on the real deployment (labelled "modeled").

A cycle recorded on this machine (:class:`specfit.engine.CycleRecord`) is priced on the
deployment a hardware profile describes (Qwen3-30B-A3B on one GPU, experts behind a PCIe link):

    modeled_ms = verify_ms + prefetch_ms + draft_ms + host_ms

    verify_ms = profile.for_layers(L).cycle_ms(nodes_verified, transferred, None, true_experts)
              = fixed_ms + per_node_ms * nodes_verified
                + (48 / L) * sum_l [per_expert_ms * transferred[l] + read_ms * true_experts[l]]
    draft_ms  = (levels + levels_ahead) * profile.draft_level_ms
                + max(0, shadow_levels * profile.draft_level_ms - (copies_ms(transferred) + prefetch_ms))
    prefetch_ms = max(0, copies_ms(prefetched) - (levels + levels_ahead) * profile.draft_level_ms)
    copies_ms(c) = (48 / L) * sum_l per_expert_ms * c[l]
    host_ms   = host_cpu_ms                    (the engine's clock: priced from counts, or measured)

* verify: SPECFIT.md §3's T(S) with the *measured* counts of the cycle — nodes the target
  verified (root included), experts the runtime really copied per MoE layer, and the distinct experts
  the verified nodes really routed to per layer (each read once from device memory). A proxy with
  L < 48 MoE layers stands for the 48-layer target: each layer's miss count is taken for 48 / L
  real layers (:meth:`specfit.core.cost.CostModel.for_layers`), so the expert term keeps its weight
  against ``fixed_ms`` and ratios between methods stay honest. The engine's selection uses the
  same scaled model.
* draft: one EAGLE-3 head forward per draft level (the profile's ``draft_level_ms``, derived in
  :data:`specfit.core.cost.PROFILES`), the level a drafter launched ahead and the cycle did not use
  (``CycleRecord.levels_ahead``) included. A shadow cycle (an AR step that drafts and selects a tree to
  learn from, ``CycleRecord.shadow_levels``; docs/SPECFIT.md §3, "Drafting in the AR step's shadow") runs
  its head forwards while the AR step's experts are copied host-to-device, when the GPU's compute units
  would otherwise wait: only the part of them longer than the step's modeled H2D ms is charged. An AR
  step's lookahead draft (``Method.lookahead_levels``: ``ar+lookahead``, specfit's AR steps with a lookahead
  expert cache) is priced by the same rule, its head forwards counted in ``shadow_levels``: they run while
  the step copies its experts. Approximation: the engine sets the chain's demand before the step's
  forward, while on a GPU the first layers' copies may start before the chain is drafted (their evictions
  would see the previous demand). Not modeled: the head forwards' own memory traffic beside the copies.
* prefetch: with ``SpecDecoder(prefetch=True)`` the engine copies the root's predicted experts before the
  cycle's first head forward is launched (``CycleRecord.prefetch``): the copies are free while they fit in
  the head forwards before the verify, the excess (``prefetch_ms``, in ``transfer_ms``) is charged, and
  it shares the shadow window with the step's copies (:func:`specfit.core.prefetch.overlap_ms`;
  docs/SPECFIT.md §3, "Prefetch while the head drafts"). Without a prefetch ``prefetch_ms`` is 0.
* host: the expert predictor, the solver and the engine's bookkeeping (tree, calibration, gate,
  learning) run on the host CPU in deployment as well, so their time is added as the engine's clock
  gave it (``CycleRecord.host_cpu_ms``, :mod:`specfit.engine.clock`). With the counted clock (``specfit
  eval``'s default on the CPU) each piece of host work is priced from its count with the profile's host
  prices (:class:`specfit.core.host_cost.HostCosts`: per cycle, drafted cycle, draft level and node,
  predictor call and node, solve and tree node, learned cycle and node; a fit of this project's measured
  host CPU time), so the figure is a property of the method, the data and the profile, not of the
  machine that ran it; with the measured clock (the default on CUDA) it is the CPU time of the engine's
  thread (``time.thread_time``). This machine's measured host CPU ms are reported beside, never added
  (``CycleRecord.host_thread_ms``, ``measured_ms["host_thread"]``).
  On the proxy they see L-layer instances (48 in deployment), which understates them; their share
  is reported separately (``host_share``). Parts are left out, as a GPU hides them: a drafted cycle's
  host work before its first draft level is read (the root's prediction and cost, the AR gate's sound
  bound) runs after that level is launched, so up to ``draft_level_ms`` of it overlaps the head forward; with a drafter that
  launches each level before the level above it is read (``Eagle3Drafter.launches_ahead``), each level's
  host work overlaps the next level's forward, up to ``draft_level_ms`` (the last level's and the
  selection's, the forward of a level launched and not used); a cycle's online learning and a
  verify's acceptance learning run while the next cycle's verify is on the device, up to the shortest verify (``fixed_ms +
  per_node_ms``) hidden (``CycleRecord.hidden_host_ms``, ``measured_ms["hidden_host"]`` of a result
  record: both; what exceeds them is in ``host_cpu_ms``; docs/SPECFIT.md §3).

Not modeled: the prefill (excluded from every tokens/s figure) and the verifier's accept step
(part of ``fixed_ms``).
"""

from __future__ import annotations

from specfit.core.cost import CostModel, HostProfile, get_host_profile, get_profile
from specfit.core.errors import SpecFitInputError
from specfit.core.prefetch import overlap_ms

#: The parts of a modeled cycle (keys of :func:`modeled_cycle_ms` besides ``total_ms``).
MODELED_PARTS = ("compute_ms", "transfer_ms", "draft_ms", "host_ms")


def cost_scaling_note(num_layers: int, profile: str, offload: str = "transfer", host_profile: str | None = None) -> str:
    """One sentence that says how modeled time scales for a target with ``num_layers`` MoE layers
    (the profile's ``reference_layers``: 48 for Qwen3-30B-A3B); with ``offload`` ``"host"`` or
    ``"auto"``, for the host-regime profile ``host_profile``."""
    if offload != "transfer":
        name, ref = f"host-regime profile {host_profile}", get_host_profile(host_profile).reference_layers
        counts, how = "counts (host experts, rows, copies)", "HostProfile.for_layers"
    else:
        name, ref = f"profile {profile}", get_profile(profile).reference_layers
        counts, how = "expert transfers and reads", "per_expert_ms and read_ms scaled by that factor, CostModel.for_layers"
    if num_layers == ref:
        return f"Modeled times use {name} with the measured per-layer {counts} as they are."
    return (f"Modeled times use {name} for the {ref}-layer Qwen3-30B-A3B: the model evaluated has {num_layers} "
            f"MoE layers, so each layer's measured {counts} stand for {ref}/{num_layers} = {ref / num_layers:.2f} "
            f"real layers ({how}); the engine's selection uses the same scaled model.")


def modeled_cycle_ms(cycle, cost: CostModel) -> dict[str, float]:
    """Modeled time of one recorded cycle, split into its parts (module docstring).

    Parameters
    ----------
    cycle : specfit.engine.CycleRecord
        Uses ``nodes_verified``, ``transferred`` (length L), ``levels``, ``levels_ahead`` and ``host_cpu_ms``.
    cost : CostModel
        The profile scaled to the model's layers, ``get_profile(name).for_layers(L)``; its
        ``draft_level_ms`` prices a draft level.

    Returns
    -------
    dict
        ``{"compute_ms", "transfer_ms", "draft_ms", "host_ms", "total_ms"}`` in ms: the verify's
        expert-independent part, its expert part (H2D copies and reads of the routed experts), drafting,
        host predictor + solver, and their sum.

    Raises
    ------
    SpecFitInputError
        If ``cost`` has no ``draft_level_ms`` (a cost model that is not a hardware profile).
    """
    if cost.draft_level_ms is None:
        raise SpecFitInputError("profile", f"{cost.name} models no draft-level time (draft_level_ms)")
    if isinstance(cost, HostProfile):
        return _host_cycle_ms(cycle, cost)
    reads = cycle.true_experts if len(cycle.true_experts) == len(cycle.transferred) else None
    verify = cost.cycle_ms(cycle.nodes_verified, cycle.transferred, None, reads)
    compute = cost.fixed_ms + cost.per_node_ms * cycle.nodes_verified
    # a shadow cycle's (and an AR step's lookahead's) head forwards run while the step copies its experts:
    # what exceeds the copies is charged; prefetch copies (SpecDecoder(prefetch=True)) are free within the
    # head forwards before the verify, their excess shares that window and is charged as link time
    prefetched = (getattr(cycle, "prefetch", None) or {}).get("experts") or []
    excess, draft = overlap_ms(cost, prefetched, cycle.transferred, cycle.levels + cycle.levels_ahead,
                               getattr(cycle, "shadow_levels", 0))
    host = cycle.host_cpu_ms
    return {"compute_ms": compute, "transfer_ms": verify - compute + excess, "draft_ms": draft, "host_ms": host,
            "total_ms": verify + excess + draft + host}


def _host_cycle_ms(cycle, cost: HostProfile) -> dict[str, float]:
    """A cycle recorded with ``offload="host"`` or ``"auto"`` priced on a host-regime profile
    (:class:`specfit.core.cost.HostProfile`, per layer max(GPU part + copies, host part) + sync), from
    the cycle's per-layer host-computed experts and rows (``cycle.host``) and, in the auto mode, the
    experts it copied (``cycle.transferred``). ``compute_ms`` is the GPU forward alone,
    ``transfer_ms`` what the offloaded experts add to it (the offload part of the verify)."""
    host = cycle.host or {}
    L = cost.num_layers or len(cycle.true_experts) or cost.reference_layers
    experts, rows = host.get("computed") or [0] * L, host.get("rows") or [0] * L
    copied = cycle.transferred if len(cycle.transferred) == len(experts) else None
    resident = None  # routed experts neither computed on the host nor copied: read on the GPU
    if cost.read_ms and len(cycle.true_experts) == len(experts):
        resident = [max(0, t - e - (copied[l] if copied else 0))
                    for l, (t, e) in enumerate(zip(cycle.true_experts, experts))]
    verify = cost.cycle_ms(cycle.nodes_verified, experts, rows, copied, resident)
    compute = cost.gpu_ms(cycle.nodes_verified)
    draft = (cycle.levels + cycle.levels_ahead) * cost.draft_level_ms
    solve = cycle.host_cpu_ms
    return {"compute_ms": compute, "transfer_ms": verify - compute, "draft_ms": draft, "host_ms": solve,
            "total_ms": verify + draft + solve}
