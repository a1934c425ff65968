"""One selection problem: a draft tree with predicted experts, the expert cache, the cost model and
optional budgets; and its JSON form (SPECFIT.md §4, a MUST contract)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from specfit.core.cost import CostModel, HostProfile
from specfit.core.coverage import ItemSets, item_ids, priced_items
from specfit.core.errors import MAX_EXPERTS, MAX_NODES, SpecFitInputError, check_int, check_unique_ids, is_integer
from specfit.core.readers import read_text
from specfit.core.io import atomic_write_text
from specfit.core.tree import DraftTree, check_distinct_experts

_REQUIRED = ("parents", "path_prob", "num_experts", "experts", "cost")
_OPTIONAL = ("cache", "max_nodes", "max_new_experts_per_layer", "tokens")


def _check_budget(name: str, value, low: int, why: str) -> int | None:
    """``value`` as an int >= ``low`` (or None): :func:`~specfit.core.errors.is_integer`'s rule (no
    floats, no bools), the budget's reason in the message."""
    if value is None:
        return None
    if not is_integer(value) or value < low:
        kind = "" if is_integer(value) else f" (a {type(value).__name__})"
        raise SpecFitInputError(name, f"must be an integer >= {low} ({why}), got {value!r}{kind}")
    return int(value)


def cache_mask(cached, num_layers: int, num_experts: int) -> np.ndarray:
    """The expert cache as a bool mask from one list of cached expert ids per MoE layer.

    Parameters
    ----------
    cached : list of list of int
        ``cached[l]``: ids of the experts of layer l resident on the device (the instance JSON's
        ``cache``, SPECFIT.md §4).
    num_layers, num_experts : int

    Returns
    -------
    numpy.ndarray of bool, shape (num_layers, num_experts)

    Raises
    ------
    SpecFitInputError
        Field ``cache`` (not one list per layer) or ``cache[l]`` (not integers, id out of range).
    """
    if not isinstance(cached, (list, tuple)) or len(cached) != num_layers:
        raise SpecFitInputError("cache", f"must be a list with one list of expert ids per layer ({num_layers})")
    mask = np.zeros((num_layers, num_experts), dtype=bool)
    for l, ids in enumerate(cached):
        if not isinstance(ids, (list, tuple)) or not all(is_integer(e) for e in ids):
            bad = next((e for e in ids if not is_integer(e)), ids) if isinstance(ids, (list, tuple)) else ids
            raise SpecFitInputError(f"cache[{l}]", f"must be a list of integer expert ids, got {bad!r}")
        bad = [e for e in ids if not 0 <= e < num_experts]
        if bad:
            raise SpecFitInputError(f"cache[{l}]", f"expert id {bad[0]} is out of range [0, {num_experts})")
        check_unique_ids(f"cache[{l}]", ids)
        mask[l, list(ids)] = True
    return mask


@dataclass(frozen=True, eq=False)
class Instance:
    """A subtree-selection instance.

    Parameters
    ----------
    tree : DraftTree
        The draft tree; ``tree.experts`` (shape (n, L, k)) are the predicted experts. A tree
        without experts has no expert term (L = 0).
    cost : CostModel or HostProfile
        Constants of T(S) in ms: a :class:`CostModel` (transfer regime, SPECFIT.md §3) or a
        :class:`~specfit.core.cost.HostProfile` scaled to the tree's layers (host-compute regime:
        per layer the larger of the GPU and host parts, plus a sync).
    cache : numpy.ndarray of bool, shape (L, num_experts), optional
        ``cache[l, e]`` is True iff expert e of layer l is resident on the device.
    max_nodes : int, optional
        Budget on |S| (root included).
    max_new_experts_per_layer : int, optional
        Budget on uncached experts per layer.

    Raises
    ------
    SpecFitInputError
        If the cache shape does not match the tree, or a budget cannot hold even the root
        ("infeasible budget").
    """

    tree: DraftTree
    cost: CostModel | HostProfile
    cache: np.ndarray | None = None
    max_nodes: int | None = None
    max_new_experts_per_layer: int | None = None

    def __post_init__(self):
        L, E = self.num_layers, self.num_experts
        if self.n > MAX_NODES:
            raise SpecFitInputError("parents", f"must have at most {MAX_NODES} nodes (MAX_NODES), got {self.n}")
        if self.cache is None:
            object.__setattr__(self, "cache", np.zeros((L, E), dtype=bool))
        elif self.cache.shape != (L, E):
            raise SpecFitInputError("cache", f"must have shape (layers={L}, num_experts={E}), got {self.cache.shape}")
        object.__setattr__(self, "max_nodes", _check_budget("max_nodes", self.max_nodes, 1,
                                                            "infeasible budget: the root is always verified"))
        object.__setattr__(self, "max_new_experts_per_layer",
                           _check_budget("max_new_experts_per_layer", self.max_new_experts_per_layer, 0,
                                         "uncached experts per layer"))
        self.cost.check_layers(L)  # a per-layer list, or a scaled host profile, must fit L
        if self.max_new_experts_per_layer is not None and L:
            root_new = self.items.new_per_layer([0])
            if root_new.max() > self.max_new_experts_per_layer:
                l = int(root_new.argmax())
                raise SpecFitInputError("max_new_experts_per_layer",
                                        f"infeasible budget: the root alone needs {int(root_new[l])} uncached experts in "
                                        f"layer {l}, more than {self.max_new_experts_per_layer}")

    # --- shape ------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return self.tree.n

    @property
    def num_layers(self) -> int:
        return self.tree.num_layers

    @property
    def num_experts(self) -> int:
        return self.tree.num_experts or 0

    @property
    def has_budget(self) -> bool:
        return self.max_nodes is not None or self.max_new_experts_per_layer is not None

    # --- items: (layer, expert) pairs a node needs and the cache lacks ------------------------
    @property
    def items(self) -> ItemSets:
        """The tree's coverage accounting against this instance's cache (:meth:`DraftTree.items`):
        per-node bitsets of the *items* ``l * num_experts + e`` a node needs and the cache lacks."""
        return self.tree.items(self.cache)

    @cached_property
    def node_items(self) -> list[np.ndarray]:
        """``node_items[v]``: sorted item ids ``l * num_experts + e`` that node v needs and the
        cache lacks (int64 arrays), unpacked from :attr:`items`."""
        return [item_ids(bits, self.num_layers * self.num_experts) for bits in self.items.need]

    @cached_property
    def item_weight(self) -> np.ndarray:
        """Time of each item id ``s * num_experts + e`` in ms per segment s (``cost.segment_ms``: the copy of
        an uncached expert of layer s < L, then, when ``read_ms > 0``, the read of a routed expert of layer
        s - L), float64 of shape (segments * num_experts,) (transfer regime only: in the host regime an item
        has no time of its own)."""
        return np.repeat(self.cost.segment_ms(self.num_layers), self.num_experts)

    @property
    def reads_priced(self) -> bool:
        """True iff T(S) charges reads of routed experts from device memory (``read_ms > 0``, L > 0): every
        routed expert in the transfer regime, the resident ones on the GPU side of the host regime."""
        return bool(self.cost.read_ms) and self.num_layers > 0

    @property
    def priced_items(self):
        """The items T(S) prices (:func:`specfit.core.coverage.priced_items`): :attr:`items`, or with
        resident reads priced a :class:`~specfit.core.coverage.PricedItems` over 2L segments."""
        return priced_items(self.tree, self.cache, self.cost)

    @cached_property
    def read_node_items(self) -> list[np.ndarray]:
        """``read_node_items[v]``: sorted ids ``l * num_experts + e`` of every expert node v routes to
        (cached or not): the experts its verify reads (int64 arrays)."""
        reads = self.tree.read_items()
        return [item_ids(bits, self.num_layers * self.num_experts) for bits in reads.need]

    def read_per_layer(self, nodes) -> np.ndarray:
        """``|U_l(S)|``: the distinct experts the nodes route to, per layer; int64 of shape (L,)."""
        return self.tree.read_items().new_per_layer(nodes)

    # --- JSON ---------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, obj) -> "Instance":
        """Build from the instance JSON object of SPECFIT.md §4.

        Raises
        ------
        SpecFitInputError
            Naming the field and rule: missing or unknown field, cycle / parent not before its
            child, probability outside [0, 1] or NaN, ragged layers, expert id out of range,
            negative cost, infeasible budget.
        """
        if not isinstance(obj, dict):
            raise SpecFitInputError("instance", "must be a JSON object")
        for k in _REQUIRED:
            if k not in obj:
                raise SpecFitInputError(k, "is required")
        for k in obj:
            if k not in _REQUIRED and k not in _OPTIONAL:
                raise SpecFitInputError(k, "is not a known instance field")
        ne = check_int("num_experts", obj["num_experts"], 1, MAX_EXPERTS)
        if isinstance(obj["parents"], list) and len(obj["parents"]) > MAX_NODES:
            raise SpecFitInputError("parents", f"must have at most {MAX_NODES} nodes (MAX_NODES), got {len(obj['parents'])}")
        experts = obj["experts"]
        if not isinstance(experts, list):
            raise SpecFitInputError("experts", "must be a list (one entry per node) of lists (one per layer) of ids")
        n_layers = len(experts[0]) if experts and isinstance(experts[0], list) else 0
        k = len(experts[0][0]) if n_layers and isinstance(experts[0][0], list) else 0
        for v, per_node in enumerate(experts):
            if not isinstance(per_node, list) or len(per_node) != n_layers:
                raise SpecFitInputError(f"experts[{v}]", f"ragged layers: expected {n_layers} layer lists like experts[0]")
            for l, ids in enumerate(per_node):
                if k and isinstance(ids, list) and not ids:  # all empty: check_experts' rule
                    raise SpecFitInputError(f"experts[{v}][{l}]", "is empty: each node routes to at least one expert "
                                            "per MoE layer")
                if not isinstance(ids, list) or len(ids) != k:
                    raise SpecFitInputError(f"experts[{v}][{l}]", f"ragged layers: expected a list of {k} expert ids "
                                            "like experts[0][0]")
        arr = experts if k else np.zeros((len(experts), n_layers, 0), dtype=np.int64)
        tree = DraftTree(obj["parents"], path_prob=obj["path_prob"], tokens=obj.get("tokens"), experts=arr,
                         num_experts=ne)
        if tree.experts is not None:
            check_distinct_experts(tree.experts)
        cost = CostModel.from_json(obj["cost"])
        cache = None if obj.get("cache") is None else cache_mask(obj["cache"], tree.num_layers, ne)
        return cls(tree, cost, cache, obj.get("max_nodes"), obj.get("max_new_experts_per_layer"))

    def to_json(self) -> dict:
        """The instance JSON object (SPECFIT.md §4); ``Instance.from_json(x.to_json())`` round-trips."""
        t = self.tree
        obj = {
            "parents": t.parents.tolist(),
            "path_prob": t.path_prob.tolist(),
            "num_experts": self.num_experts,
            "experts": t.experts.tolist() if t.experts is not None else [[] for _ in range(t.n)],
            "cache": [np.flatnonzero(row).tolist() for row in self.cache],
            "cost": self.cost.to_json(),
            "max_nodes": self.max_nodes,
            "max_new_experts_per_layer": self.max_new_experts_per_layer,
        }
        if t.tokens is not None:
            obj["tokens"] = t.tokens.tolist()
        return obj


def load_instance(path: str | Path) -> Instance:
    """Read an instance JSON file.

    Raises
    ------
    SpecFitInputError
        If the file is missing or not valid JSON (field ``instance``), or the content is invalid.
    """
    p = Path(path)
    text = read_text(p, "instance")
    try:
        obj = json.loads(text, parse_constant=float)  # NaN, Infinity: read, then refused by the field's rule
    except json.JSONDecodeError as exc:
        raise SpecFitInputError("instance", f"{p} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return Instance.from_json(obj)


def save_instance(instance: Instance, path: str | Path) -> None:
    """Write an instance JSON file atomically (temporary file, then rename)."""
    atomic_write_text(path, json.dumps(instance.to_json(), allow_nan=False))

