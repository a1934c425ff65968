"""The CP-SAT oracle: the selection problem of SPECFIT.md §3 as an OR-Tools CP-SAT model.

The model
---------
Boolean ``x_v`` per non-root node (the root is always in) and ``x_v -> x_parent(v)``. An *item* is
an uncached (layer, expert) pair; items the root needs are paid once, as a constant. A node
*owns* the items it needs that no proper ancestor needs: in an ancestor-closed set an item is
covered iff one of its owners is selected. Items are grouped by their owner set; a group with one
owner is folded into that owner's weight (its cost is paid exactly when the owner is selected), a
group with several owners gets a Boolean ``y_g`` with ``x_v -> y_g`` for each owner. Budgets are
linear: ``sum x_v <= max_nodes - 1`` and, per layer l, the uncached experts of l in the selected
nodes' folded groups and in the chosen ``y_g`` are at most ``max_new_experts_per_layer`` minus the
root's. This model is written from ``Instance.node_items`` alone, independently of the exact
solver's code, so the two check each other.

Ratio and rate mode
-------------------
Rate mode maximises ``F_λ(S) = A(S) - λ T(S)`` with λ = rate/1000 tokens/ms in one CP-SAT solve.
Ratio mode runs Dinkelbach's method (Dinkelbach 1967): start from S_0 = {root}; at step k set
λ_k = A(S_k)/T(S_k) and let S' maximise F_{λ_k}; if A(S')/T(S') > λ_k continue from S_{k+1} = S',
else stop with S_k. The ratios strictly increase over a finite set, so the loop ends.

Integer scaling and its tolerance
---------------------------------
CP-SAT needs integer objective coefficients. Each step multiplies the float weights
(``P_v - λ(per_node_ms + owned exclusive ms)`` per node, ``-λ w_g`` per shared group) by
``s = 2**precision_bits / M`` (M the largest weight magnitude) and rounds. Each coefficient is then
off by at most ``0.5 / s`` tokens, the objective of any set by at most ``δ = K / (2 s)`` for K
objective variables. So when CP-SAT proves a step OPTIMAL the returned set is within ``2δ`` of the
true maximum of ``F_λ``, and at the end of Dinkelbach no set S has ratio above
``λ + 2δ / T(S)``. With the default 40 bits, K ≤ 10^4 and M ≤ 100 this is below 1e-6 tokens,
i.e. a relative error of order 1e-7 in the worst case; in practice the returned value agrees with
an exact rational optimum to float precision unless two sets are within that margin.

Host-compute regime
-------------------
An instance whose cost is a :class:`~specfit.core.cost.HostProfile` has, per MoE layer l, the time
``c · max(g(|S|), h_l(S)) + c · sync_ms · [u_l > 0]`` (c = R / L; SPECFIT.md §3). The model adds a
Boolean ``y_i`` per uncached item the root does not need (``x_v -> y_i`` for every node v needing
it), an integer ``t_l`` with ``t_l >= g`` (linear in the ``x``) and ``t_l >= h_l`` (``y`` for the
union, ``x`` times the node's rows for the rows), and a Boolean ``z_l`` with ``y_i -> z_l`` for the
sync of a layer the root does not already pay; the objective subtracts ``λ c t_l``,
``λ c sync_ms z_l`` and ``λ node_extra_ms`` per draft node, so at the optimum ``t_l`` is the max
exactly and ``z_l`` the indicator. The
``max_new_experts_per_layer`` budget bounds the ``y`` of each layer. Because the constraints carry
λ, the model is rebuilt for each Dinkelbach step; ``t_l`` is measured in the objective's integer
unit (1/s tokens), so every coefficient is rounded once, with the tolerance above.

Status
------
``optimal`` only when every CP-SAT step ended OPTIMAL (within the tolerance above); otherwise
(time limit, or the iteration cap) the best set seen is returned as ``feasible``.

References
----------
W. Dinkelbach, "On nonlinear fractional programming", Management Science 13(7), 1967.
L. Perron and F. Didier, CP-SAT, OR-Tools (https://developers.google.com/optimization), v9.
SPECFIT.md §3.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Sequence

import numpy as np

from specfit.solvers.base import Solver, check_time_limit
from specfit.core.errors import SpecFitInputError, check_int
from specfit.core.instance import Instance
from specfit.core.objective import evaluate

#: Dinkelbach steps before giving up (status ``feasible``); ratios strictly increase, so the loop
#: normally ends after a handful of steps.
MAX_STEPS = 60


def _owned_groups(instance: Instance):
    """Per-node exclusive item weight and per-layer counts, and the shared groups.

    Returns
    -------
    node_ms : numpy.ndarray, shape (n,)
        Transfer ms of the items owned by v alone.
    node_layers : numpy.ndarray, shape (n, L)
        Count of those items per layer.
    groups : list of (owners tuple, ms float, per-layer counts array (L,))
        Item groups with two or more owners.
    root_layers : numpy.ndarray, shape (L,)
        Uncached experts the root needs per layer.
    """
    n, L, E = instance.n, instance.num_layers, max(instance.num_experts, 1)
    par = instance.tree.parents
    items = [set(instance.node_items[v].tolist()) for v in range(n)]
    LE = L * E
    # written independently of the solvers' item segments: item l*E + e is the copy of an uncached expert
    # (per_expert_ms[l]), item LE + l*E + e the read of any routed expert (read_ms), copied or resident
    weight = np.repeat(instance.cost.per_expert_array(L), E) if L else np.zeros(0)
    if instance.reads_priced:
        for v in range(n):
            items[v] |= {LE + it for it in instance.read_node_items[v].tolist()}
        weight = np.concatenate([weight, np.repeat(instance.cost.read_array(L), E)])
    above: list[set] = [set() for _ in range(n)]  # items needed by a proper ancestor (incl. the root)
    owners: dict[int, list[int]] = defaultdict(list)
    for v in range(1, n):
        above[v] = above[par[v]] | items[par[v]]
        for it in items[v] - above[v]:
            owners[it].append(v)
    node_ms, node_layers = np.zeros(n), np.zeros((n, L), dtype=np.int64)
    shared: dict[tuple, list[int]] = defaultdict(list)
    for it, own in owners.items():
        if len(own) == 1:
            node_ms[own[0]] += weight[it]
            if it < LE:  # a copy: the expert budget counts it
                node_layers[own[0], it // E] += 1
        else:
            shared[tuple(own)].append(it)
    groups = []
    for own, its in shared.items():
        copies = np.asarray([it for it in its if it < LE], dtype=np.int64)
        counts = np.bincount(copies // E, minlength=L).astype(np.int64)[:L]
        groups.append((own, float(weight[its].sum()), counts))
    root_layers = instance.items.new_per_layer([0])
    return node_ms, node_layers, groups, root_layers


class CPSATSolver(Solver):
    """OR-Tools CP-SAT model of the selection problem; the validation oracle.

    Parameters
    ----------
    time_limit_s : float
        Wall-clock limit for the whole solve (all Dinkelbach steps), seconds; default 30.
    workers : int
        CP-SAT search workers (default 1: deterministic, one core).
    precision_bits : int
        Objective coefficients are scaled so that the largest is ``2**precision_bits`` (see the
        module docstring for the tolerance this gives); default 40.

    Raises
    ------
    SpecFitInputError
        If ``time_limit_s`` is not a positive finite number, ``workers`` < 1, or
        ``precision_bits`` is outside [10, 52].
    """

    name = "cpsat"
    exact = True

    def __init__(self, time_limit_s: float = 30.0, workers: int = 1, precision_bits: int = 40):
        t = check_time_limit(time_limit_s)
        w = check_int("workers", workers, 1, 1024)
        bits = check_int("precision_bits", precision_bits, 10, 52)
        self.time_limit_s, self.workers, self.precision_bits = t, w, bits

    def _cp_solver(self):
        """A CP-SAT solver with this oracle's workers, random seed 0, and presolve's inclusion detection off.

        OR-Tools 9.15's presolve can certify a wrong optimum (status OPTIMAL below a feasible
        assignment's objective) through its at-most-one/linear inclusion reductions
        (google/or-tools#5293); the host-regime model hit it (a 5-node tree whose optimum
        {0, 3} at 96.2 tok/s was reported as {0, 1, 3} at 90.9, tests/solvers/test_host_regime.py).
        ``presolve_inclusion_work_limit = 0`` switches that family off and keeps the rest of presolve;
        an OR-Tools without that parameter gets no presolve at all (``cp_model_presolve = False``).
        """
        from ortools.sat.python import cp_model

        solver = cp_model.CpSolver()
        solver.parameters.num_workers = self.workers
        solver.parameters.random_seed = 0
        try:
            solver.parameters.presolve_inclusion_work_limit = 0
        except AttributeError:  # pragma: no cover - an older OR-Tools
            solver.parameters.cp_model_presolve = False
        return solver

    def select(self, instance: Instance, rate: float | None) -> tuple[Sequence[int], str]:
        from ortools.sat.python import cp_model

        t0 = time.perf_counter()
        if instance.cost.regime == "host":
            return self._select_host(instance, rate, t0)
        n, L = instance.n, instance.num_layers
        if n == 1:
            return [0], "optimal"
        prob = instance.tree.path_prob
        per_node = instance.cost.per_node_ms
        node_ms, node_layers, groups, root_layers = _owned_groups(instance)

        model = cp_model.CpModel()
        x = [None] + [model.new_bool_var(f"x{v}") for v in range(1, n)]
        for v in range(2, n):
            p = int(instance.tree.parents[v])
            if p:
                model.add_implication(x[v], x[p])
        y = [model.new_bool_var(f"y{g}") for g in range(len(groups))]
        for g, (own, _, _) in enumerate(groups):
            for v in own:
                model.add_implication(x[v], y[g])
        if instance.max_nodes is not None:
            model.add(sum(x[1:]) <= instance.max_nodes - 1)
        cap = instance.max_new_experts_per_layer
        if cap is not None:
            for l in range(L):
                terms = [int(node_layers[v, l]) * x[v] for v in range(1, n) if node_layers[v, l]]
                terms += [int(c[l]) * y[g] for g, (_, _, c) in enumerate(groups) if c[l]]
                if terms:
                    model.add(sum(terms) <= cap - int(root_layers[l]))

        solver = self._cp_solver()

        def best_for(lam: float, hint: Sequence[int]) -> tuple[list[int] | None, bool]:
            """Maximise A - lam*T (scaled); return (nodes or None, proven optimal)."""
            w_node = prob[1:] - lam * (per_node + node_ms[1:])
            w_group = np.array([-lam * ms for _, ms, _ in groups])
            mag = max(float(np.abs(w_node).max(initial=0.0)), float(np.abs(w_group).max(initial=0.0)))
            # weights below 1e-12 tokens are noise far under the tolerance; flooring mag keeps s finite
            s = 2.0 ** self.precision_bits / max(mag, 1e-12)
            model.clear_objective()
            model.maximize(sum(int(round(s * w)) * xv for w, xv in zip(w_node, x[1:]))
                           + sum(int(round(s * w)) * yg for w, yg in zip(w_group, y)))
            model.clear_hints()
            chosen = set(hint)
            for v in range(1, n):
                model.add_hint(x[v], v in chosen)
            for g, (own, _, _) in enumerate(groups):
                model.add_hint(y[g], any(v in chosen for v in own))
            return _run(solver, model, x, self.time_limit_s - (time.perf_counter() - t0))

        def terms(nodes) -> tuple[float, float]:
            reads = instance.read_per_layer(nodes) if instance.reads_priced else None
            return instance.tree.path_prob[nodes[1:]].sum() + 1.0, instance.cost.cycle_ms(
                len(nodes), instance.items.new_per_layer(nodes), None, reads)

        return _dinkelbach(best_for, terms, rate)

    def _select_host(self, instance: Instance, rate: float | None, t0: float) -> tuple[Sequence[int], str]:
        """The host-regime model (module docstring), rebuilt for each λ: its max constraints carry λ."""
        from ortools.sat.python import cp_model

        n = instance.n
        if n == 1:
            return [0], "optimal"
        solver = self._cp_solver()

        def best_for(lam: float, hint: Sequence[int]) -> tuple[list[int] | None, bool]:
            return _run(solver, *_host_model(instance, lam, self.precision_bits, hint),
                        self.time_limit_s - (time.perf_counter() - t0))

        def terms(nodes) -> tuple[float, float]:
            ev = evaluate(instance, nodes)
            return ev.expected_tokens, ev.predicted_ms

        return _dinkelbach(best_for, terms, rate)


def _run(solver, model, x: list, left_s: float) -> tuple[list[int] | None, bool]:
    """Solve ``model`` within ``left_s`` seconds; ``(selected nodes or None, proven optimal)``."""
    from ortools.sat.python import cp_model

    if left_s <= 0:
        return None, False
    solver.parameters.max_time_in_seconds = left_s
    status = solver.solve(model)
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"cpsat: invalid model: {model.validate()}")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, False
    return [0] + [v for v in range(1, len(x)) if solver.boolean_value(x[v])], status == cp_model.OPTIMAL


def _dinkelbach(best_for, terms, rate: float | None) -> tuple[list[int], str]:
    """Rate mode: one step at λ = rate / 1000. Ratio mode: Dinkelbach's loop from {root} (module
    docstring). ``best_for(lam, hint)`` returns ``(nodes or None, proven optimal)``, ``terms(nodes)``
    returns ``(A, T)``."""
    if rate is not None:
        nodes, proven = best_for(rate / 1000.0, [0])
        return (nodes, "optimal" if proven else "feasible") if nodes else ([0], "feasible")

    current = [0]
    a, t = terms(current)
    lam = a / t
    for _ in range(MAX_STEPS):
        nodes, proven = best_for(lam, current)
        if nodes is None:
            return current, "feasible"
        a, t = terms(nodes)
        if a / t > lam:
            current, lam = nodes, a / t
            if not proven:  # a better set, but the search did not finish: stop here
                return current, "feasible"
        else:
            return current, "optimal" if proven else "feasible"
    return current, "feasible"


def _host_model(instance: Instance, lam: float, precision_bits: int, hint: Sequence[int]):
    """CP-SAT model of max A(S) - λT(S) in the host-compute regime (module docstring).

    Returns ``(model, x)`` with ``x[v]`` the Boolean of node v (``x[0]`` None: the root is in).
    Written from ``Instance.node_items`` and the profile's constants alone (not from the exact
    solver's code): rows are counted here from the node's item ids.
    """
    from ortools.sat.python import cp_model

    cost = instance.cost
    n, L, E = instance.n, instance.num_layers, max(instance.num_experts, 1)
    par = instance.tree.parents
    prob = instance.tree.path_prob
    R = cost.reference_layers
    model = cp_model.CpModel()
    x = [None] + [model.new_bool_var(f"x{v}") for v in range(1, n)]
    for v in range(2, n):
        if par[v]:
            model.add_implication(x[v], x[int(par[v])])
    if instance.max_nodes is not None:
        model.add(sum(x[1:]) <= instance.max_nodes - 1)
    if L == 0:  # T = extra_ms + fixed_ms + (per_node_ms + node_extra_ms) * |S| + const: a linear objective
        w = prob[1:] - lam * (cost.gpu.per_node_ms + cost.node_extra_ms)
        s = 2.0 ** precision_bits / max(float(np.abs(w).max(initial=0.0)), 1e-12)
        model.maximize(sum(int(round(s * wv)) * xv for wv, xv in zip(w, x[1:])))
        for v in range(1, n):
            model.add_hint(x[v], v in set(hint))
        return model, x
    c = R / L
    root = set(instance.node_items[0].tolist())
    rows = np.zeros((n, L), dtype=np.int64)
    needers: dict[int, list[int]] = defaultdict(list)  # item (not the root's) -> nodes that need it
    for v in range(n):
        its = instance.node_items[v]
        rows[v] = np.bincount(its // E, minlength=L)
        if v:
            for it in its.tolist():
                if it not in root:
                    needers[it].append(v)
    root_u = np.bincount(np.asarray(sorted(root), dtype=np.int64) // E, minlength=L)
    # resident experts the GPU side reads once each (gpu.read_ms): routed items the cache holds
    cached = instance.cache.reshape(-1)
    root_res, res_needers = np.zeros(L, dtype=np.int64), defaultdict(list)
    if instance.reads_priced:
        root_reads = set(instance.read_node_items[0].tolist())
        for it in root_reads:
            if cached[it]:
                root_res[it // E] += 1
        for v in range(1, n):
            for it in instance.read_node_items[v].tolist():
                if cached[it] and it not in root_reads:
                    res_needers[it].append(v)
    # weights in tokens (k = λ c converts ms of one real layer into tokens); scale s makes them integers
    k = lam * c
    g_root, g_node = k * (cost.gpu.fixed_ms + cost.gpu.per_node_ms) / R, k * cost.gpu.per_node_ms / R
    w_read = k * cost.gpu.read_ms
    w_exp, w_row, w_sync = k * cost.host_per_expert_ms, k * cost.host_per_row_ms, k * cost.sync_ms
    h_root = w_exp * root_u + w_row * rows[0]
    w_node = lam * cost.node_extra_ms  # per draft node, outside the per-layer max
    mag = max(float(prob.max()), g_root, g_node, w_exp, w_row * float(rows.max(initial=0)), w_sync,
              float(h_root.max(initial=0.0)), w_node, w_read * float(root_res.max(initial=0)))
    s = 2.0 ** precision_bits / max(mag, 1e-12)

    def q(w: float) -> int:
        return int(round(s * w))

    y = {it: model.new_bool_var(f"y{it}") for it in needers}
    for it, vs in needers.items():
        for v in vs:
            model.add_implication(x[v], y[it])
    zr = {it: model.new_bool_var(f"r{it}") for it in res_needers}  # a resident expert read on the GPU
    for it, vs in res_needers.items():
        for v in vs:
            model.add_implication(x[v], zr[it])
    if instance.max_new_experts_per_layer is not None:
        for l in range(L):
            layer = [y[it] for it in y if it // E == l]
            if layer:
                model.add(sum(layer) <= instance.max_new_experts_per_layer - int(root_u[l]))
    objective = [q(p - w_node) * xv for p, xv in zip(prob[1:], x[1:])]
    for l in range(L):
        layer = [y[it] for it in y if it // E == l]
        reads = [zr[it] for it in zr if it // E == l]
        gpu = [q(g_root), q(w_read * root_res[l])] + [q(g_node) * xv for xv in x[1:]] + [q(w_read) * zi for zi in reads]
        host = [q(h_root[l])] + [q(w_exp) * yi for yi in layer] + [q(w_row * rows[v, l]) * x[v]
                                                                  for v in range(1, n) if rows[v, l]]
        ub = max(q(g_root) + q(w_read * root_res[l]) + q(g_node) * (n - 1) + q(w_read) * len(reads),
                 q(h_root[l]) + q(w_exp) * len(layer)
                 + sum(q(w_row * rows[v, l]) for v in range(1, n)))
        t = model.new_int_var(0, ub, f"t{l}")  # max(g, h_l) of layer l, in objective units
        model.add(t >= sum(gpu))
        model.add(t >= sum(host))
        objective.append(-t)
        if layer and not root_u[l]:  # the sync is paid iff some host expert is computed in layer l
            z = model.new_bool_var(f"z{l}")
            for yi in layer:
                model.add_implication(yi, z)
            objective.append(-q(w_sync) * z)
    model.maximize(sum(objective))
    chosen = set(hint)
    for v in range(1, n):
        model.add_hint(x[v], v in chosen)
    for it, vs in needers.items():
        model.add_hint(y[it], any(v in chosen for v in vs))
    return model, x
