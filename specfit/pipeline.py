"""Load a target and a draft head from directories and generate with any method: the one builder.

:class:`SpecFit` joins the parts the engine needs (ARCHITECTURE.md, "the one way through"): an
offloaded Qwen3-MoE target (:class:`specfit.models.qwen3_moe.OffloadedQwen3Moe`) with its device
expert cache, an EAGLE-3 head and its drafter (:mod:`specfit.models.eagle3`), an expert predictor
(:mod:`specfit.models.predictors`), the cost model the selection uses (:mod:`specfit.core.cost`)
and the tokenizer. :meth:`SpecFit.decoder` configures one :class:`specfit.engine.SpecDecoder` per
method (SPECFIT.md §6) and :meth:`SpecFit.generate` decodes text or token ids with it. The
evaluation (:mod:`specfit.eval.run`), the ``specfit generate`` command and users all build through
here.

Example::

    from specfit import SpecFit

    sf = SpecFit.from_pretrained("models/proxy/target", "models/proxy/eagle3", cache_slots=32)
    out = sf.generate("Question: 2 + 3 = ?", method="specfit", max_new_tokens=16)
    print(out.text, out.tau)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from specfit.core.cost import DEFAULT_HOST_PROFILE, DEFAULT_PROFILE, CostModel, HostProfile, get_host_profile, get_profile
from specfit.core.errors import (SpecFitInputError, check_context, check_number, check_positive_int, check_seed,
                                 has_bool, lookup)
from specfit.core.readers import read_json
from specfit.engine.decoder import CycleRecord, Method, SpecDecoder, TreeSettings, get_method, prompt_list, tau
from specfit.engine.online import OnlineModel
from specfit.engine.policy import make_policy

if TYPE_CHECKING:  # torch and the model code load only when a model does
    import torch

#: Default KV capacity of a loaded target, tokens (prompt + new tokens + one draft tree).
DEFAULT_MAX_LEN = 4096


def max_tree_nodes(tree: TreeSettings) -> int:
    """Draft nodes EAGLE-2 growth creates at most: ``top_k`` on level 1, ``top_k²`` on each of the
    ``depth - 1`` deeper levels (``top_k`` nodes expanded, ``top_k`` children each; Li et al. 2024,
    EAGLE-2, §4)."""
    return tree.top_k * (1 + (tree.depth - 1) * tree.top_k)


def kv_tokens_needed(prompt_tokens: int, max_new_tokens: int, tree: TreeSettings | None) -> int:
    """KV capacity (tokens) one generation needs: the prompt, the new tokens, one verified draft
    tree (:func:`max_tree_nodes`; none without a drafter) and 2 tokens of slack (the root and
    the bonus token)."""
    return prompt_tokens + max_new_tokens + (0 if tree is None else max_tree_nodes(tree)) + 2


@dataclass
class GenerateOutput:
    """What :meth:`SpecFit.generate` returns.

    Attributes
    ----------
    text : str or None
        ``output_ids`` decoded (special tokens skipped); None when the target ships no tokenizer.
    output_ids : list of int
        The new token ids only (at most ``max_new_tokens``; the EOS id is included when emitted).
    prompt_ids : list of int
        The prompt as token ids.
    method : str
        The method of :data:`specfit.engine.METHODS` that decoded.
    cycles : list of CycleRecord
        One record per draft-verify cycle (:class:`specfit.engine.CycleRecord`); its ``decision``
        is ``"ar"`` for every cycle of a method that never drafts (``ar``).
    wall_s, prefill_s : float
        Measured seconds of the decode loop and of the prefill.
    stats : dict
        Expert-cache counters of this generation (hits, misses, bytes moved, H2D ms per MoE
        layer and in total; :meth:`specfit.models.experts.DeviceExpertCache.stats`).
    memory : dict
        Bytes the target holds (:meth:`specfit.models.qwen3_moe.OffloadedQwen3Moe.memory`).
    """

    text: str | None
    output_ids: list[int]
    prompt_ids: list[int]
    method: str
    cycles: list[CycleRecord]
    wall_s: float
    prefill_s: float
    stats: dict
    memory: dict

    @property
    def tau(self) -> float:
        """Mean committed tokens per cycle τ (accepted draft tokens + 1 bonus token; AR = 1)."""
        return tau(self.cycles)

    @property
    def tokens_per_s(self) -> float:
        """Measured decode throughput on this machine, new tokens/s (prefill excluded)."""
        return len(self.output_ids) / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        """A JSON-ready dict of every attribute and ``tau`` (the ``specfit generate --json`` object)."""
        return {**asdict(self), "tau": self.tau}


def check_sampling(temperature, top_p, seed) -> tuple[float, float, int]:
    """The sampling settings of a generation, checked by the rules every entry point shares.

    Returns
    -------
    (float, float, int)
        ``temperature`` (a finite number >= 0; 0 = greedy), ``top_p`` (a finite number in (0, 1])
        and ``seed`` (an integer in [0, 2**63), used as given).

    Raises
    ------
    SpecFitInputError
        On ``temperature``, ``top_p`` or ``seed`` (NaN, infinity, a bool, a string, a float seed, a
        value out of range).
    """
    return (check_number("temperature", temperature, 0.0, unit="0 = greedy"),
            check_number("top_p", top_p, 0.0, 1.0, low_open=True),
            check_seed("seed", seed))


def _as_dtype(dtype) -> "torch.dtype | None":
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise SpecFitInputError("dtype", f"must be a floating torch dtype such as 'float32' or 'bfloat16', got {dtype!r}")
    return value


def _head_config(target_dir: Path, draft_dir: Path) -> tuple[dict, tuple[int, ...]]:
    """The target's config and the aux layers the head reads (checked against each other)."""
    from specfit.models.eagle3 import Eagle3Config, check_target

    path = draft_dir / "config.json"
    if not path.is_file():
        raise SpecFitInputError("draft_dir", f"no EAGLE-3 head (config.json) in {draft_dir}")
    target_cfg = read_json(target_dir / "config.json")
    return target_cfg, check_target(Eagle3Config.from_dict(read_json(path)), target_cfg)


def _predictor_trace(name: str, target_dir: Path, trace) -> Path | None:
    """The routing trace a named predictor is built from (None: ``recency`` without one); checked
    before any weights are read."""
    from specfit.models.predictors import PREDICTORS

    lookup(PREDICTORS, name, "predictor")
    if name == "recency" and trace is None:
        return None
    trace = Path(trace) if trace is not None else target_dir / "routing_trace.npz"
    if not trace.is_file():
        raise SpecFitInputError("predictor_trace", f"predictor {name!r} needs a routing trace; no such file: {trace} "
                                "(record one with python -m specfit.eval.predictors --save-traces, "
                                "or use predictor='recency')")
    return trace


def _hot_set(offload: str, target_dir: Path, trace) -> list[list[int]] | None:
    """The host (and auto) offload mode's first device set: per MoE layer, every expert ordered by
    how often the routing trace routes to it (the cache keeps its first ``slots``); None in the
    transfer mode or without a trace."""
    if offload == "transfer":
        return None
    path = Path(trace) if trace is not None else target_dir / "routing_trace.npz"
    if not path.is_file():
        return None
    from specfit.models.host_compute import hot_experts
    from specfit.models.traces import RoutingTrace

    t = RoutingTrace.load(path)
    return hot_experts(t.routing, t.num_experts, t.num_experts)


class SpecFit:
    """An offloaded MoE target, an optional EAGLE-3 drafter and predictor, ready to generate.

    Build it with :meth:`from_pretrained`, or from parts already built (the engine's duck types,
    see :mod:`specfit.engine.decoder`).

    Parameters
    ----------
    target
        The offloaded target (``OffloadedQwen3Moe`` or the engine's duck type with
        ``reset_cache(slots)``).
    drafter : optional
        The draft model (``Eagle3Drafter``); None allows only ``ar``.
    tokenizer : optional
        Encodes text prompts and decodes outputs; None allows token ids only.
    predictor : optional
        Expert predictor for ``eagle3-scan`` and ``specfit``.
    cost : CostModel, optional
        Cost model of the selection (ms); needed by ``eagle3-scan``, ``specfit``, ``oracle``.
    cache_slots : int or "all"
        Expert-cache slots per MoE layer every generation starts with (``eagle3-vanilla``: 0).
    eviction : str
        ``"lru"`` or ``"lfu"``.
    reference : callable, optional
        Returns a second target on the same weights with every expert resident; called once,
        on the first ``oracle`` generation.
    identity : dict, optional
        What makes what the engine learns transferable (target, head, profile, offload, predictor,
        admission, device, clock: host ms learned on one clock are not another's); :meth:`from_pretrained`
        fills it (``clock`` ``"measured"``; ``specfit eval`` sets the clock it runs on). :meth:`save_learned` records it and
        :meth:`load_learned` refuses a file whose identity differs (:mod:`specfit.engine.learned`).
    clock : Clock, optional
        The clocks every decoder reads (:mod:`specfit.engine.clock`; default the measured ones);
        :class:`~specfit.engine.clock.FrozenClock` makes decisions independent of the machine's timing.
    warm_start : str or Path, optional
        A ``learned.json`` (or a run folder holding one) to start :attr:`online` from
        (:meth:`load_learned`).

    Attributes
    ----------
    target, drafter, tokenizer, predictor, cost, cache_slots, eviction
    online : dict
        What the engine has learned online (:class:`specfit.engine.online.OnlineModel`), one per
        setting that changes it: (method, tree settings, cache slots, eviction, temperature, top_p).
        Every generation of that setting starts from, and adds to, the same one, as a deployment
        serving many requests would; ``online.clear()`` forgets it.
    """

    def __init__(self, target, drafter=None, *, tokenizer=None, predictor=None, cost: CostModel | None = None,
                 cache_slots: int | str = 0, eviction: str = "lru", reference=None, identity: dict | None = None,
                 clock=None, warm_start: str | Path | None = None):
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.predictor, self.cost = predictor, cost
        self.cache_slots, self.eviction = cache_slots, eviction
        self._reference_loader, self._reference = reference, None
        self.online: dict = {}
        self.identity: dict = dict(identity or {})
        self.clock = clock
        if warm_start is not None:
            self.load_learned(warm_start)

    # -- loading -----------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, target_dir: str | Path, draft_dir: str | Path | None = None, *,
                        cache_slots: int | str | None = None, gpu_memory_bytes: int | str | None = None,
                        eviction: str = "lru", device: str = "cpu", dtype: "str | torch.dtype | None" = None,
                        predictor: str | Any | None = "frequency", predictor_trace: str | Path | None = None,
                        profile: str | CostModel = DEFAULT_PROFILE, max_len: int = DEFAULT_MAX_LEN,
                        admission: str = "all", offload: str = "transfer",
                        host_profile: str | HostProfile = DEFAULT_HOST_PROFILE,
                        warm_start: str | Path | None = None) -> "SpecFit":
        """Load a Qwen3-MoE checkpoint with offloaded experts and, optionally, its EAGLE-3 head.

        Parameters
        ----------
        target_dir : str or Path
            Hugging Face Qwen3-MoE directory (``config.json``, safetensors, optional tokenizer).
        draft_dir : str or Path, optional
            EAGLE-3 head directory in the public layout; without it only ``ar`` can run.
        cache_slots : int or "all", optional
            Expert-cache slots per MoE layer, in [0, E] (default 0: every needed expert is
            transferred host-to-device each forward).
        gpu_memory_bytes : int or str, optional
            Device memory budget instead of ``cache_slots``, bytes or a size like ``"20GiB"``.
            It becomes ``slots = min(E, floor((budget - resident) / (L_moe * expert_bytes)))``
            per MoE layer, where ``resident`` counts the target's non-expert weights, its KV cache
            of ``max_len`` tokens and the head's weights (the oracle's reference target is not
            counted). Host memory (the expert store) is not part of the budget.
        eviction : str
            Expert-cache eviction policy, ``"lru"``, ``"lfu"``, ``"lookahead"`` or ``"lookahead-lfu"``
            (:data:`specfit.models.experts.POLICIES`).
        device : str
            Compute device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``.
        dtype : str or torch.dtype, optional
            Compute dtype (default float32 on CPU, bfloat16 otherwise).
        predictor : str or ExpertPredictor or None
            Expert predictor for ``eagle3-scan``/``specfit``: ``"frequency"`` (default; needs a
            routing trace), ``"recency"``, ``"probe"``, a built predictor, or None. Used only
            with a draft head.
        predictor_trace : str or Path, optional
            Routing trace (``.npz``) the predictor is built from; default
            ``target_dir/routing_trace.npz``.
        profile : str or CostModel
            Cost model of the selection: a hardware profile name of :mod:`specfit.core.cost`
            (scaled to this target's MoE layers with :meth:`CostModel.for_layers`) or a
            :class:`CostModel` used as given.
        max_len : int
            KV capacity in tokens (prompt + new tokens + one draft tree).
        admission : str
            How a verify's experts rank in the expert cache: ``"all"`` (default; plain LRU/LFU)
            or ``"accepted"`` (experts copied only for rejected draft nodes are evicted first);
            timing only, never results (:meth:`DeviceExpertCache.settle`).
        offload : str
            ``"transfer"`` (default): uncached experts are copied host-to-device into the expert
            cache; ``"host"``: they are computed on the CPU from host memory and the device cache
            holds a static hot set, the most frequently routed experts of the routing trace
            (``predictor_trace``, default ``target_dir/routing_trace.npz``; without a trace the
            cache stays empty). Outputs equal the transfer mode's
            (:mod:`specfit.models.host_compute`). In this mode the selection, the stop rule and
            the AR gate use ``host_profile`` instead of ``profile``. ``"auto"``: the device cache
            starts as that hot set and, per layer and forward, each uncached expert is copied into
            it or computed on the host, whichever ``host_profile`` says is faster
            (:class:`specfit.models.host_compute.AutoOffloadCache`); the selection prices a verify
            as the host mode does, an upper bound on its time in this mode.
        host_profile : str or HostProfile
            ``offload="host"``/``"auto"`` only: the cost model of the selection, a host-regime profile name of
            :data:`specfit.core.cost.HOST_PROFILES` (scaled to this target's MoE layers with
            :meth:`HostProfile.for_layers`) or a :class:`HostProfile` used as given (SPECFIT.md §3,
            "Host-compute regime").

        Returns
        -------
        SpecFit

        Raises
        ------
        SpecFitInputError
            Both or bad ``cache_slots``/``gpu_memory_bytes``, a budget too small, a bad
            ``eviction``, ``admission``, ``dtype``, ``profile``, ``predictor``, ``max_len``, ``offload`` or
            ``host_profile``, a missing head or
            routing trace, a head that does not fit the target.
        CheckpointError
            A missing or malformed target checkpoint (names the file and the tensor).
        """
        from specfit.models.experts import parse_bytes
        from specfit.models.host_compute import check_offload
        from specfit.models.qwen3_moe import OffloadedQwen3Moe, read_spec
        from specfit.models.qwen3_moe.generate import load_tokenizer

        if cache_slots is not None and gpu_memory_bytes is not None:
            raise SpecFitInputError("gpu_memory_bytes", "give either cache_slots or gpu_memory_bytes, not both")
        budget = None if gpu_memory_bytes is None else parse_bytes(gpu_memory_bytes, "gpu_memory_bytes")
        check_positive_int("max_len", max_len)
        check_offload(offload)
        cost = profile if isinstance(profile, CostModel) else get_profile(profile)
        given = isinstance(profile, CostModel)
        if offload in ("host", "auto"):
            given = isinstance(host_profile, HostProfile)
            cost = host_profile if given else get_host_profile(host_profile)
        target_dir = Path(target_dir)
        if not target_dir.is_dir():
            raise SpecFitInputError("target_dir", f"{target_dir} is not a folder" if target_dir.exists()
                                    else f"no such checkpoint folder: {target_dir}")
        read_spec(target_dir)  # a missing or unsupported checkpoint fails here, before the head is read
        head_cfg = None if draft_dir is None else _head_config(target_dir, Path(draft_dir))
        named = head_cfg is not None and isinstance(predictor, str)
        trace = _predictor_trace(predictor, target_dir, predictor_trace) if named else None
        load = dict(device=device, dtype=_as_dtype(dtype), eviction=eviction, admission=admission, max_len=max_len,
                    aux_layers=None if head_cfg is None else head_cfg[1])
        target = OffloadedQwen3Moe.from_pretrained(target_dir, cache_slots=0 if budget is not None else cache_slots,
                                                   offload=offload, hot_experts=_hot_set(offload, target_dir, predictor_trace),
                                                   offload_cost=cost if offload == "auto" else None,
                                                   **load)
        drafter, head_bytes = None, 0
        if head_cfg is not None:
            from specfit.models.eagle3 import Eagle3Drafter, load_eagle3

            head = load_eagle3(draft_dir, target_config=head_cfg[0], embed_weight=target.embed_weight.float(),
                               device=target.device, dtype=target.dtype)
            drafter = Eagle3Drafter(head)
            head_bytes = sum(t.nbytes for t in head.state_dict().values())
        slots = target.cache.slots if budget is None else target.slots_for(budget, reserved_bytes=head_bytes)
        if budget is not None:
            target.reset_cache(slots)
        spec, built = target.spec, None if drafter is None else predictor
        L = len(spec.moe_layers)
        if named:
            from specfit.models.predictors import get_predictor

            built = get_predictor(predictor, num_layers=L, num_experts=spec.num_experts, top_k=spec.top_k,
                                  **({} if trace is None else {"trace": trace}))

        def reference():
            return OffloadedQwen3Moe.from_pretrained(target_dir, cache_slots="all", **load)

        identity = {"target": _checkpoint_id(target_dir),
                    "head": None if draft_dir is None else _checkpoint_id(Path(draft_dir)),
                    "profile": _profile_id(profile if offload == "transfer" else host_profile),
                    "offload": offload, "admission": admission,
                    "predictor": predictor if isinstance(predictor, str) or predictor is None else type(predictor).__name__,
                    "device": target.device.type, "clock": "measured"}  # the decoders' default clock
        return cls(target, drafter, tokenizer=load_tokenizer(target_dir), predictor=built,
                   cost=cost if given else cost.for_layers(L),
                   cache_slots=slots, eviction=eviction, reference=reference, identity=identity,
                   warm_start=warm_start)

    # -- decoding ----------------------------------------------------------------------------------
    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence id generation stops at (the first of the target config's), or None."""
        eos = tuple(self.target.spec.eos_token_id)
        return int(eos[0]) if eos else None

    def decoder(self, method: str | Method = "specfit", *, tree: TreeSettings | None = None,
                temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, rate_mode: bool = False,
                policy: str | None = None, prefetch: bool = False) -> SpecDecoder:
        """A :class:`SpecDecoder` for ``method`` whose target starts with an empty expert cache.

        The cache gets :attr:`cache_slots` slots per MoE layer (0 for methods that run without
        one, ``eagle3-vanilla``), so every generation's output is independent of the ones before.
        A calibrated method (``specfit``, ``oracle``) starts from what the decoders of the same
        setting learned before (:attr:`online`): that changes which nodes are verified, never the
        output (greedy: equal to AR's; sampling: the target's distribution).

        Parameters
        ----------
        method : str or Method
            A method of :data:`specfit.engine.METHODS` (SPECFIT.md §6).
        tree : TreeSettings, optional
            Draft-tree settings (default ``TreeSettings()``: 32 / 6 / 4).
        temperature, top_p : float
            0 = greedy verification; > 0 = lossless sampling verification.
        seed : int
            Seed of the sampling verifier.
        rate_mode : bool
            Long-run-rate selection instead of the per-cycle ratio (SPECFIT.md §3).
        policy : str, optional
            Whether each cycle drafts (:mod:`specfit.engine.policy`): ``"gate"`` (the AR gate on measured
            utility; the default of ``specfit`` and ``oracle``, which alone can take it), ``"always"`` (the
            other methods' default) or ``"never"`` (every cycle an AR step). A calibrated method keeps it in
            the online model of its setting (:attr:`online`), made with the first decoder of that setting.
        prefetch : bool
            Prefetch the root's predicted experts while the draft head runs (``SpecDecoder(prefetch=True)``;
            a drafting method gets the expert predictor for it). Timing only, never outputs.

        Returns
        -------
        SpecDecoder

        Raises
        ------
        SpecFitInputError
            Unknown method; a method that needs a drafter, predictor or cost model this object
            lacks; ``temperature`` not a finite number >= 0, ``top_p`` not in (0, 1], ``seed`` not an
            integer in [0, 2**63) (:func:`~specfit.core.errors.check_seed`); an unknown ``policy``, ``"gate"``
            for a method that is not calibrated, or a ``policy`` other than the one the online model of this
            setting drafts with (field ``policy``; ``online.clear()`` forgets it).
        """
        temperature, top_p, seed = check_sampling(temperature, top_p, seed)
        wanted = make_policy(policy).name if policy is not None else None
        m = get_method(method) if isinstance(method, str) else method
        if m.needs_reference and self._reference is None and self._reference_loader is not None:
            self._reference = self._reference_loader()
        needs_predictor = m.needs_predictor or (prefetch is True and m.drafts)  # prefetch predicts the root
        self.target.reset_cache(self.cache_slots if m.uses_cache else 0, self.eviction)
        tree = tree or TreeSettings()
        online = None
        if m.calibrated:
            online = self.online.setdefault(self.online_key(m.name, tree, temperature, top_p),
                                            OnlineModel(tree.depth, wanted or "gate"))
            if wanted is not None and online.policy.name != wanted:
                raise SpecFitInputError("policy", f"{m.name} learned under these settings with the "
                                        f"{online.policy.name!r} policy; online.clear() forgets it to draft with {wanted!r}")
        return SpecDecoder(self.target, self.drafter if m.needs_drafter else None, m, tree=tree,
                           cost=self.cost, predictor=self.predictor if needs_predictor else None,
                           reference=self._reference if m.needs_reference else None, temperature=temperature, top_p=top_p,
                           seed=seed, rate_mode=rate_mode, online=online, clock=self.clock,
                           policy=None if m.calibrated else wanted, prefetch=prefetch)

    def online_key(self, method: str, tree: TreeSettings | None = None, temperature: float = 0.0,
                   top_p: float = 1.0) -> tuple:
        """The key of :attr:`online` a calibrated ``method`` learns under with these settings:
        ``(method, tree, cache_slots, eviction, temperature, top_p)``."""
        return (method, tree or TreeSettings(), self.cache_slots, self.eviction, float(temperature), float(top_p))

    # -- what the engine learned -------------------------------------------------------------------
    def save_learned(self, path: str | Path) -> None:
        """Write :attr:`online` with :attr:`identity` to the ``learned.json`` file ``path`` (atomically;
        format: :mod:`specfit.engine.learned`, set ``"default"``).

        Raises
        ------
        SpecFitInputError
            While learning is still queued (field ``deferred``; save between generations).
        """
        from specfit.engine import learned

        learned.write(path, learned.document(self.identity, {"default": learned.entries(self.online)}))

    def load_learned(self, path: str | Path, dataset: str | None = None, *, expect: dict | None = None) -> None:
        """Start :attr:`online` from a ``learned.json`` (or a run folder holding one): every model of
        the set ``dataset`` (or the file's only set) replaces the one of its key.

        Parameters
        ----------
        path : str or Path
        dataset : str, optional
            The set to read (an evaluation's dataset name); default the file's only set.
        expect : dict, optional
            A partial key (``{"method": "specfit", "depth": 6, ...}``, fields of
            :data:`specfit.engine.learned.KEY_FIELDS`) the file must hold a model of.

        Raises
        ------
        SpecFitInputError
            (field ``warm_start``, one line naming the differing field) A missing or malformed file,
            another identity (target, head, profile, offload, predictor, admission, device), an entry
            learned with other ``cache_slots`` or ``eviction`` than this object's, no model matching
            ``expect``; or a malformed model (its field).
        """
        from specfit.engine import learned

        doc = learned.read(path)
        learned.check_identity(doc["identity"], self.identity)
        items = learned.pick_set(doc, dataset)
        if not isinstance(items, list):
            raise SpecFitInputError("warm_start", "a set must be a list of entries")
        mine = {"cache_slots": self.cache_slots, "eviction": self.eviction}
        loaded = {}
        for e in items:
            key = learned.key_from_json(e.get("key") if isinstance(e, dict) else None)
            for k, v in mine.items():
                if e["key"][k] != v:
                    raise SpecFitInputError("warm_start", f"learned with {k}={e['key'][k]!r}, this run has {k}={v!r}")
            loaded[key] = OnlineModel.from_json(e.get("online"))
        if expect is not None:
            learned.check_key(items, expect)
        self.online.update(loaded)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a text prompt (no special tokens added), or the given ids as ints.

        Parameters
        ----------
        prompt : str, sequence of int, or array/tensor of shape (T,) or (1, T)
            Batch size 1 only.

        Raises
        ------
        SpecFitInputError
            Text without a tokenizer, ids that are not integers, a batch of more than one
            sequence (``batch size 1 only``), or an empty prompt (field ``prompt``).

        Returns
        -------
        list of int, length T >= 1
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SpecFitInputError("prompt", "the model directory has no tokenizer; give token ids")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            if has_bool(prompt):  # [True, 5] would read as the ids [1, 5]
                raise SpecFitInputError("prompt", "must be integer token ids, got a boolean")
            ids = prompt_list(prompt, "prompt")
        if not ids:
            raise SpecFitInputError("prompt", "encodes to no tokens")
        return list(ids)

    def generate(self, prompt: str | Sequence[int], *, method: str | Method = "specfit", max_new_tokens: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, tree: TreeSettings | None = None,
                 rate_mode: bool = False, policy: str | None = None, prefetch: bool = False) -> GenerateOutput:
        """Decode up to ``max_new_tokens`` tokens after a text or token-id prompt with ``method``.

        Every call starts from an empty expert cache (warmed by its own prefill) and stops after
        the end-of-sequence token (:attr:`eos_token_id`). Greedy (``temperature=0``) output is
        the target's greedy output for every method; sampling is lossless (SPECFIT.md §2).

        Parameters
        ----------
        prompt : str or sequence of int
            Text (needs the target's tokenizer) or token ids of shape (T,) or (1, T).
        method : str or Method
            ``ar``, ``eagle3-vanilla``, ``eagle3``, ``eagle3-scan``, ``specfit`` or ``oracle``.
        max_new_tokens : int
            Upper bound on new tokens.
        temperature, top_p, seed, tree, rate_mode, policy, prefetch
            See :meth:`decoder`.

        Returns
        -------
        GenerateOutput
            Text, new token ids, per-cycle records, timings and expert-cache counters.

        Raises
        ------
        SpecFitInputError
            A bad prompt, ``max_new_tokens`` or method (see :meth:`decoder`), or a generation
            longer than the KV capacity ``max_len`` (field ``max_new_tokens``).
        """
        import torch

        ids = self.encode(prompt)
        check_positive_int("max_new_tokens", max_new_tokens)
        spec = self.target.spec
        bad = [t for t in ids if not 0 <= t < spec.vocab_size]
        if bad:
            raise SpecFitInputError("prompt", f"token ids must lie in [0, {spec.vocab_size}) (vocab_size), got {bad[0]}")
        check_context("max_new_tokens", len(ids), max_new_tokens, spec.max_position_embeddings)
        dec = self.decoder(method, tree=tree, temperature=temperature, top_p=top_p, seed=seed, rate_mode=rate_mode,
                           policy=policy, prefetch=prefetch)
        need = kv_tokens_needed(len(ids), max_new_tokens, dec.tree if dec.method.needs_drafter else None)
        capacity = getattr(self.target, "max_len", need)
        if need > capacity:
            raise SpecFitInputError("max_new_tokens", f"prompt ({len(ids)} tokens) + {max_new_tokens} new tokens + "
                                    f"one draft tree need {need} KV tokens, the target holds max_len={capacity}; "
                                    "load it with a larger max_len")
        with torch.no_grad():
            gen = dec.generate(ids, max_new_tokens, eos_id=self.eos_token_id)
        text = None if self.tokenizer is None else self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        # a method that never drafts takes an AR step every cycle: its records say so
        cycles = gen.cycles if dec.method.drafts else [replace(c, decision="ar") for c in gen.cycles]
        return GenerateOutput(text=text, output_ids=list(gen.output_ids), prompt_ids=ids, method=dec.method.name,
                              cycles=cycles, wall_s=gen.wall_s, prefill_s=gen.prefill_s,
                              stats=self.target.cache.stats(), memory=self.target.memory())


#: Bytes of each weight file :func:`_checkpoint_id` reads at its start, middle and end.
_ID_SAMPLE = 1 << 16


def _checkpoint_id(d: Path) -> str:
    """``<folder name>:<crc32>`` of a checkpoint's config.json bytes, its weight files' names and sizes, and
    64 KiB of each weight file at its start, middle and end (a few reads, whatever the checkpoint's size): the
    same checkpoint copied elsewhere keeps it; another checkpoint of the same shape (a retrained or other head)
    gets another, since its weights differ in those bytes."""
    import zlib

    d = Path(d)
    crc = zlib.crc32((d / "config.json").read_bytes() if (d / "config.json").is_file() else b"")
    for f in sorted(d.iterdir()):
        if f.suffix not in (".safetensors", ".bin"):
            continue
        size = f.stat().st_size
        crc = zlib.crc32(repr((f.name, size)).encode(), crc)
        with f.open("rb") as fh:
            for at in sorted({0, max(0, size // 2 - _ID_SAMPLE // 2), max(0, size - _ID_SAMPLE)}):
                fh.seek(at)
                crc = zlib.crc32(fh.read(_ID_SAMPLE), crc)
    return f"{d.resolve().name}:{crc:08x}"


def _profile_id(profile) -> str:
    """A profile's name, or ``cost-model:<crc32>`` of a cost model given as an object."""
    import zlib

    if isinstance(profile, str):
        return profile
    return f"cost-model:{zlib.crc32(repr(profile).encode()):08x}"


__all__ = ["DEFAULT_MAX_LEN", "GenerateOutput", "SpecFit", "kv_tokens_needed", "max_tree_nodes"]
