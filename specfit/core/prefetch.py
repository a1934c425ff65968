"""Expert prefetch while the link is idle: which copies a prefetch issues, and what a cycle pays for them.

A cycle's head forwards run on the GPU's compute stream while the host-to-device link has nothing to
copy: the verify's expert copies come after them. The runtime's expert cache queues prefetch copies on
its copy stream without waiting for them (:meth:`specfit.models.experts.DeviceExpertCache.prefetch_layers`;
the copy stream first waits for the compute work queued *before* the call, so only the head forwards
launched after it overlap the copies), and a verify's layer waits only for that layer's copies. So copies
issued before a cycle's first head forward is launched run while its head forwards compute.

Overlap model (docs/SPECFIT.md §3, "Prefetch while the head drafts"), per cycle, in ms of the deployed
target (``cost`` scaled to the model's layers, :meth:`specfit.core.cost.CostModel.for_layers`):

    S = (levels + levels_ahead) * draft_level_ms     head forwards before the verify, link idle
    H = shadow_levels * draft_level_ms               head forwards that run beside the AR step's copies
    P = sum_l per_expert_ms_l * prefetched_l         the prefetch copies
    X = sum_l per_expert_ms_l * transferred_l        the verify's own copies (its misses)

    excess = max(0, P - S)                           prefetch copies the serial window does not hide
    head   = S + max(0, H - (X + excess))            the head forwards on the critical path

so a cycle costs ``S + max(H, X + excess)`` in head forwards and copies besides the verify's compute:
prefetch copies are free while they fit in S; what exceeds it shares the shadow window with the step's
own copies (the existing shadow rule, ``eval/modeled.py``) and is charged beyond it. With nothing
prefetched this is exactly the model without prefetch. A prefetched expert the verify uses is a hit (not
in X); a wrong one costs its copy beyond the window and the eviction it caused (later misses in X).

Pure numpy; no torch.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specfit.core.errors import SpecFitInputError


def _copies_ms(cost, counts) -> float:
    """Σ_l per_expert_ms_l · counts_l (ms) for a per-layer count array (0 for an empty one)."""
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 1:
        raise SpecFitInputError("prefetched", f"must be one count per MoE layer, got shape {c.shape}")
    if c.size == 0:
        return 0.0
    return float(cost.per_expert_array(c.size) @ c)


def prefetch_budget(cost, layers: Sequence[int], num_layers: int, window_ms: float) -> int:
    """How many of a prefetch's candidate copies, in priority order, start while the link is idle.

    A candidate is issued when the copies before it take less than ``window_ms``: every issued copy starts
    inside the window and at most the last one runs past it (its overrun is charged,
    :func:`overlap_ms`). With one expert of a proxy layer standing for ``48 / L`` real layers' copies,
    a copy is often longer than the whole window; a used one still saves ``min(window, copy)`` as a real
    layer's expert that fits would, and a wrong one is charged its overrun (conservative).

    Parameters
    ----------
    cost : CostModel
        The cycle's cost model (``per_expert_array``).
    layers : sequence of int
        The MoE layer of each candidate expert, in priority order.
    num_layers : int
        MoE layers L of the model (the length of ``per_expert_array``).
    window_ms : float
        The idle-link window, ms (>= 0; 0 issues nothing).

    Returns
    -------
    int
        The number of leading candidates to issue.

    Raises
    ------
    SpecFitInputError
        If ``window_ms`` is negative or not finite (field ``window_ms``) or a layer is outside [0, L)
        (field ``layers``).
    """
    window = float(window_ms)
    if not np.isfinite(window) or window < 0:
        raise SpecFitInputError("window_ms", f"must be a finite number of ms >= 0, got {window_ms!r}")
    ids = np.asarray(layers, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= num_layers):
        raise SpecFitInputError("layers", f"must lie in [0, {num_layers})")
    if window <= 0 or ids.size == 0:
        return 0
    before = np.concatenate(([0.0], np.cumsum(cost.per_expert_array(num_layers)[ids])[:-1]))
    return int(np.count_nonzero(before < window))


def overlap_ms(cost, prefetched, transferred, serial_levels: int, shadow_levels: int) -> tuple[float, float]:
    """The prefetch's charged copies and the head forwards on the critical path of one cycle (module docstring).

    Parameters
    ----------
    cost : CostModel
        The profile scaled to the model's layers, with ``draft_level_ms``.
    prefetched, transferred : array_like of int, shape (L,)
        Experts prefetched and experts the verify copied (its misses), per MoE layer; ``prefetched`` may
        be empty (nothing prefetched).
    serial_levels : int
        Head forwards launched after the prefetch and before the verify, on its critical path
        (``levels + levels_ahead`` of a cycle record).
    shadow_levels : int
        Head forwards that run beside the AR step's copies (``shadow_levels``).

    Returns
    -------
    (excess_ms, head_ms) : tuple of float
        ``excess_ms = max(0, P - S)``, the prefetch copies charged; ``head_ms = S + max(0, H - (X +
        excess_ms))``, the head forwards charged. With nothing prefetched, ``(0, S + max(0, H - X))``.

    Raises
    ------
    SpecFitInputError
        If the count arrays are not one count per layer (field ``prefetched``).
    """
    level = float(cost.draft_level_ms or 0.0)
    serial = serial_levels * level
    copies = _copies_ms(cost, transferred)
    excess = max(0.0, _copies_ms(cost, prefetched) - serial) if len(prefetched) else 0.0
    return excess, serial + max(0.0, shadow_levels * level - (copies + excess))


__all__ = ["overlap_ms", "prefetch_budget"]
