"""Expert-cache lookahead on a routing trace: how many transfers a lookahead eviction can save.

Replays a recorded routing trace (:class:`models.traces.RoutingTrace`: each token's true top-k experts
per MoE layer) token by token through a simulated expert cache, as plain AR decoding meets it: one
forward per token, whose experts must all be resident in each layer. Reports misses (experts
transferred host-to-device) per token per layer at each cache size, for these eviction policies:

* ``LRU`` — :class:`models.experts.DeviceExpertCache`'s default;
* ``LRU + true next h`` — the ``lookahead`` policy (:class:`models.experts.Lookahead`) whose demand is
  the TRUE experts of the next h tokens (:func:`specfit.core.lookahead.expert_demand`), token t+j
  weighted 1 or, with ``--decays``, ``α^j`` (``weight α^j``: the path probability of a draft chain's depth-j
  node at per-token acceptance α, the weighting a draft tree gives): what a perfect h-token lookahead gives;
* ``LRU + predicted next h`` — the same with the experts of the true next h tokens PREDICTED by the
  frequency predictor (:func:`models.predictors.build_frequency`, recency blend on, observing the true
  routing of every token up to the current one), built on the other half of the trace's prompts
  (2-fold cross-fitting): predicting experts, not tokens (a draft also mispredicts tokens);
* ``Belady`` — optimal offline eviction (evict the resident expert whose next use is farthest; Belady
  1966, "A study of replacement algorithms for a virtual-storage computer"), per layer: the lower
  bound of any eviction policy without prefetch.

Cache semantics are :class:`models.experts.DeviceExpertCache`'s for one-token forwards with at least k
slots (tests/eval/test_lookahead.py checks miss for miss against the real cache): a forward's experts are
used once at the same tick, its misses are admitted in id order into free slots first, and each eviction
takes the policy's victim among the resident experts the forward does not use (lookahead: least demand,
then least recent, then earliest admitted). The cache carries over from one prompt to the next, as it
does across a decoding session (nothing is resident before the first prompt), or with ``--fresh`` starts
empty at each prompt (its cold misses, which no policy avoids, counted).

Usage::

    python -m specfit.eval.lookahead --slots 16,32,64 --horizons 2,4,8 --decays 1,0.5

Prints a Markdown table. Pure numpy.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numba
import numpy as np

from specfit.core.errors import SpecFitInputError
from specfit.core.lookahead import expert_demand
from specfit.eval.machine import run_main
from specfit.models.traces import RoutingTrace

#: The shipped proxy target's routing trace (models/proxy/target/ROUTING_TRACE.md).
DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "models" / "proxy" / "target" / "routing_trace.npz"


@numba.njit(cache=True)
def _replay(routing, priority, has_priority, lfu, slots, resident, count, last_use, uses, admitted, clock, misses):
    """Replay forwards (T, L, k) through the cache state in place (:meth:`CacheSim.replay`); ``clock`` holds
    the tick and the admission counter."""
    T, L, k = routing.shape
    E = resident.shape[1]
    for t in range(T):
        clock[0] += 1
        tick = clock[0]
        for layer in range(L):
            ids = np.sort(routing[t, layer])  # the runtime runs a layer's experts in id order
            for j in range(k):
                last_use[layer, ids[j]] = tick
                uses[layer, ids[j]] += 1
            for j in range(k):
                e = ids[j]
                if resident[layer, e]:
                    continue
                misses[layer] += 1
                if count[layer] >= slots:  # evict: least priority, then the base policy, then earliest admitted
                    best = -1
                    for x in range(E):
                        if not resident[layer, x] or last_use[layer, x] == tick:
                            continue
                        if best < 0:
                            best = x
                            continue
                        if has_priority and priority[t, layer, x] != priority[t, layer, best]:
                            if priority[t, layer, x] < priority[t, layer, best]:
                                best = x
                            continue
                        if lfu and uses[layer, x] != uses[layer, best]:
                            if uses[layer, x] < uses[layer, best]:
                                best = x
                            continue
                        if last_use[layer, x] != last_use[layer, best]:
                            if last_use[layer, x] < last_use[layer, best]:
                                best = x
                            continue
                        if admitted[layer, x] < admitted[layer, best]:
                            best = x
                    resident[layer, best] = False
                    count[layer] -= 1
                clock[1] += 1
                admitted[layer, e] = clock[1]
                resident[layer, e] = True
                count[layer] += 1


class CacheSim:
    """Expert ids resident per layer under a priority-then-base eviction policy (module docstring).

    Parameters
    ----------
    num_layers, num_experts : int
        L MoE layers of E experts.
    slots : int
        Slots per layer, at least the experts per token of the forwards replayed, at most E. The cache
        starts empty, except with ``slots = E``: every expert resident (as :class:`DeviceExpertCache`).
    base : str
        ``"lru"`` or ``"lfu"``: the order among experts of equal priority (then: earliest admitted).

    Raises
    ------
    SpecFitInputError
        If ``slots`` is not in [1, E] (field ``slots``) or ``base`` is unknown (field ``base``).
    """

    def __init__(self, num_layers: int, num_experts: int, slots: int, base: str = "lru"):
        if base not in ("lru", "lfu"):
            raise SpecFitInputError("base", f"must be 'lru' or 'lfu', got {base!r}")
        if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or not 1 <= slots <= num_experts:
            raise SpecFitInputError("slots", f"must be an integer in [1, {num_experts}], got {slots!r}")
        self.slots, self.base = int(slots), base
        shape = (int(num_layers), int(num_experts))
        self.resident = np.zeros(shape, dtype=np.bool_)
        self.count = np.zeros(shape[0], dtype=np.int64)
        self.last_use = np.zeros(shape, dtype=np.int64)
        self.uses = np.zeros(shape, dtype=np.int64)
        self.admitted = np.zeros(shape, dtype=np.int64)
        self.clock = np.zeros(2, dtype=np.int64)  # tick, admissions
        if self.slots == shape[1]:  # every expert resident from the start, as DeviceExpertCache(slots=E)
            self.resident[:], self.count[:] = True, shape[1]
            self.admitted[:] = np.arange(1, shape[1] + 1)
            self.clock[1] = shape[1]

    def replay(self, routing: np.ndarray, priority: np.ndarray | None = None) -> np.ndarray:
        """Forwards of one token each, in order.

        Parameters
        ----------
        routing : numpy.ndarray of int, shape (T, L, k)
            Each token's experts per layer (distinct within a layer), ``k <= slots``.
        priority : numpy.ndarray of float, shape (T, L, E), optional
            Eviction priority during forward t: the victim is the candidate of least ``priority[t, l]``,
            then the base policy's. The lookahead's predicted demand, or minus the next use for Belady.
            None: the base policy.

        Returns
        -------
        numpy.ndarray of int64, shape (L,)
            Misses (H2D transfers) per layer.

        Raises
        ------
        SpecFitInputError
            If the shapes do not match or k exceeds the slots (field ``routing`` / ``priority``).
        """
        r = np.ascontiguousarray(routing, dtype=np.int64)
        L, E = self.resident.shape
        if r.ndim != 3 or r.shape[1] != L or (r.size and (r.min() < 0 or r.max() >= E)):
            raise SpecFitInputError("routing", f"must have shape (T, {L}, k) with ids in [0, {E})")
        if r.shape[2] > self.slots:
            raise SpecFitInputError("routing", f"k = {r.shape[2]} experts per token exceed the {self.slots} slots")
        if priority is None:
            p, has = np.zeros((1, 1, 1)), False
        else:
            p, has = np.ascontiguousarray(priority, dtype=np.float64), True
            if p.shape != (r.shape[0], L, E):
                raise SpecFitInputError("priority", f"must have shape ({r.shape[0]}, {L}, {E}), got {p.shape}")
        misses = np.zeros(L, dtype=np.int64)
        _replay(r, p, has, self.base == "lfu", self.slots, self.resident, self.count, self.last_use, self.uses,
                self.admitted, self.clock, misses)
        return misses


def next_use(routing: np.ndarray, num_experts: int) -> np.ndarray:
    """(T, L, E) int64: the first step after t at which layer l uses expert e, T when none does."""
    T, L, _ = routing.shape
    out = np.empty((T, L, num_experts), dtype=np.int64)
    nxt = np.full((L, num_experts), T, dtype=np.int64)
    rows = np.arange(L)[:, None]
    for t in range(T - 1, -1, -1):
        out[t] = nxt
        nxt[rows, routing[t]] = t
    return out


def belady_misses(routing: np.ndarray, num_experts: int, slots: int) -> np.ndarray:
    """Misses per layer (L,) of optimal offline eviction (evict the farthest next use) over one sequence of
    forwards (T, L, k), from an empty cache."""
    sim = CacheSim(routing.shape[1], num_experts, slots)
    return sim.replay(routing, -next_use(routing, num_experts).astype(np.float64))


def demand_series(experts: np.ndarray, horizon: int, num_experts: int, decay: float = 1.0) -> np.ndarray:
    """(T, L, E) lookahead demand during each forward t of a prompt: :func:`expert_demand` of the next
    ``horizon`` tokens' experts, token t+j weighted ``decay ** j`` (fewer tokens near the prompt's end, none
    at its last token).

    Parameters
    ----------
    experts : numpy.ndarray of int, shape (T, H, L, k) or (T, L, k)
        Per step t, the experts of tokens t+1..t+H (rows of -1: past the prompt's end), as
        :func:`predicted_experts` gives; or the true routing (T, L, k), whose rows t+1.. are the future.
    horizon : int
        Tokens looked ahead, ``1 <= horizon`` (and ``<= H``).
    num_experts : int
        E.
    decay : float
        In (0, 1]: token t+j's weight ``decay ** j`` is the path probability of the depth-j node of a draft
        chain whose every token is accepted with probability ``decay`` (1: every token counts once, so an
        expert needed only at t+h ranks with one needed at t+1).
    """
    T = experts.shape[0]
    L = experts.shape[-2]
    w = float(decay) ** np.arange(1, horizon + 1)
    out = np.zeros((T, L, num_experts))
    for t in range(T):
        if experts.ndim == 3:
            rows = experts[t + 1: t + 1 + horizon]
        else:
            rows = experts[t, :horizon]
            rows = rows[rows[:, 0, 0] >= 0]
        out[t] = expert_demand(w[: len(rows)], rows, num_experts)
    return out


def predicted_experts(trace: RoutingTrace, horizon: int, folds: int = 2) -> list[np.ndarray]:
    """Per prompt, (T, horizon, L, k): at step t, the frequency predictor's experts of the true tokens
    t+1..t+horizon (rows past the prompt's end: -1), the predictor built on the other folds' prompts (prompt
    p is in fold ``p % folds``) and having observed the prompt's true routing up to token t."""
    from specfit.models.predictors import build_frequency

    P = trace.num_prompts
    prompts = list(trace.prompts())
    out: list[np.ndarray] = [np.zeros(0)] * P
    for f in range(folds):
        pred = build_frequency(trace.subset([p for p in range(P) if p % folds != f]))
        for p in range(f, P, folds):
            tokens, routing, _ = prompts[p]
            T, L, k = routing.shape
            res = np.full((T, horizon, L, k), -1, dtype=np.int64)
            pred.reset()
            for t in range(T):
                nxt = tokens[t + 1: t + 1 + horizon]
                res[t, : len(nxt)] = pred.observe_and_predict(tokens[t:t + 1], routing[t:t + 1], nxt)
            out[p] = res
    return out


def label(kind: str, horizon: int, decay: float) -> str:
    """A lookahead row's name: ``kind`` ``"true"`` or ``"predicted"``."""
    return f"LRU + {kind} next {horizon}" + ("" if decay == 1 else f", weight {decay:g}^j")


def simulate(trace: RoutingTrace, slots, horizons=(2, 4), predicted: list[np.ndarray] | None = None,
             decays=(1.0,), fresh: bool = False) -> dict:
    """Misses per token per layer of every policy of the module docstring at each cache size.

    Parameters
    ----------
    trace : RoutingTrace
        The true routing, replayed prompt after prompt through one cache per (size, policy).
    slots : sequence of int
        Slots per layer, each at least the experts per token.
    horizons : sequence of int
        Lookahead horizons h in tokens.
    predicted : list of numpy.ndarray, optional
        :func:`predicted_experts` of the trace with a horizon of at least ``max(horizons)``; without it
        the predicted-experts rows are left out.
    decays : sequence of float
        Weights of the lookahead's tokens (:func:`demand_series`), one row per (kind, horizon, decay).
    fresh : bool
        Empty every cache at each prompt's start (its cold misses counted; Belady then sees only the
        prompt's own future) instead of carrying the cache over from the previous prompt.

    Returns
    -------
    dict
        ``{label: {slots: misses per token per layer}}`` over every token and layer of the trace, labels in
        table order (LRU, the true-future lookaheads, the predicted ones, Belady).
    """
    L, E = trace.num_layers, trace.num_experts
    kinds = ["true"] + (["predicted"] if predicted is not None else [])
    rows = {label(kind, h, d): (kind, h, d) for kind in kinds for d in decays for h in horizons}
    labels = ["LRU", *rows, "Belady"]
    sims = {(name, s): CacheSim(L, E, s) for name in labels for s in slots}
    totals = dict.fromkeys(sims, 0)
    nu = None if fresh else next_use(trace.routing, E)  # carried over: Belady sees the next use across prompts
    for p, (_, routing, _) in enumerate(trace.prompts()):
        if fresh:
            sims = {(name, s): CacheSim(L, E, s) for name in labels for s in slots}
            future = next_use(routing, E)
        else:
            future = nu[trace.offsets[p]:trace.offsets[p + 1]]
        prio = {"LRU": None, "Belady": -future.astype(np.float64)}
        for name, (kind, h, d) in rows.items():
            prio[name] = demand_series(routing if kind == "true" else predicted[p], h, E, d)
        for (name, s), sim in sims.items():
            totals[name, s] += int(sim.replay(routing, prio[name]).sum())
    n = len(trace) * L
    return {name: {s: totals[name, s] / n for s in slots} for name in labels}


def markdown(results: dict[str, dict]) -> str:
    """The table: one row per policy, one column per cache size; misses per token per layer (change
    against LRU at that size)."""
    sizes = list(results["LRU"])
    lines = ["| eviction | " + " | ".join(f"{s} slots" for s in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for name, row in results.items():
        cells = [f"{row[s]:.2f}" if name == "LRU" or not results["LRU"][s] else
                 f"{row[s]:.2f} ({row[s] / results['LRU'][s] - 1:+.0%})" for s in sizes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m specfit.eval.lookahead", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="routing trace .npz (default: the shipped one)")
    ap.add_argument("--slots", default="16,32,64", help="comma-separated cache sizes per layer (default 16,32,64)")
    ap.add_argument("--horizons", default="2,4", help="lookahead horizons in tokens (default 2,4)")
    ap.add_argument("--decays", default="1", help="weights of the lookahead's tokens, decay**j for token t+j, "
                                                  "comma-separated values in (0, 1] (default 1)")
    ap.add_argument("--prompts", type=int, default=None, help="use only the first N prompts of the trace")
    ap.add_argument("--no-predicted", action="store_true", help="skip the predicted-experts lookahead")
    ap.add_argument("--fresh", action="store_true", help="empty the cache at each prompt's start (default: carry it "
                                                         "over from the previous prompt)")
    args = ap.parse_args(argv)
    try:
        slots = [int(s) for s in args.slots.split(",")]
        horizons = [int(h) for h in args.horizons.split(",")]
        decays = [float(d) for d in args.decays.split(",")]
    except ValueError:
        raise SpecFitInputError("--slots/--horizons/--decays", "must be comma-separated numbers") from None
    if min(horizons) < 1:
        raise SpecFitInputError("--horizons", "must be positive integers")
    if not all(0 < d <= 1 for d in decays):
        raise SpecFitInputError("--decays", "must lie in (0, 1]")
    trace = RoutingTrace.load(args.trace)
    if args.prompts is not None:
        if not 2 <= args.prompts <= trace.num_prompts:
            raise SpecFitInputError("--prompts", f"must be in [2, {trace.num_prompts}], got {args.prompts}")
        trace = trace.subset(range(args.prompts))
    t0 = time.perf_counter()
    pred = None if args.no_predicted else predicted_experts(trace, max(horizons))
    results = simulate(trace, slots, horizons, pred, decays, args.fresh)
    print(f"trace {args.trace.name}: {trace.num_prompts} prompts, {len(trace)} tokens, {trace.num_layers} MoE layers, "
          f"top-{trace.top_k} of {trace.num_experts} experts; cache {'emptied at each prompt' if args.fresh else 'carried over'}; "
          f"misses per token per layer "
          f"({time.perf_counter() - t0:.1f} s)\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    run_main(main)
