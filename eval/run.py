"""The end-to-end evaluation behind ``specfit eval``: every method on the same prompts, one engine.

For each prompt (datasets in order) and each method (SPECFIT.md §6), one :class:`SpecDecoder`
configured for that method decodes the same prompt token ids; one line per prompt × method is
appended to ``OUT/results.jsonl`` (flushed and fsync'ed), then :mod:`eval.report` writes
``summary.json``, ``summary.md`` and the plots.

Fairness and reproducibility:

* every method runs the same target weights, tokenizer, prompt ids, ``max_new_tokens`` and EOS;
  ``eagle3-vanilla`` runs the target with ``cache_slots=0`` (every needed expert transferred each
  forward), the others with ``cache_slots`` slots per MoE layer;
* every generation starts with an empty expert cache, warmed by its own prefill, so each output
  is independent of the order of runs and of interruptions; ``specfit`` and ``oracle`` carry what
  they learned online (acceptance, predictor corrections, the AR gate's measurement) from one
  prompt to the next of a dataset (:attr:`specfit.pipeline.SpecFit.online`), so their *speed* on a
  prompt depends on the prompts before it in its dataset; each dataset starts that learning afresh
  (a dataset's rows are what a run of that dataset alone measures, not the domain change from the
  dataset before: with GSM8K's measured utility carried in, CNN/DM's H200 96-slot cell measured
  0.976–0.980 × ar over 10 + 10 prompts, 0.984–0.988 without), or from ``warm_start``; a resumed
  run restores what it had learned (below);
* the selection of the cost-aware methods uses ``get_profile(profile).for_layers(L)`` (with
  ``offload="host"`` or ``"auto"``: ``get_host_profile(host_profile).for_layers(L)``), the cost model the modeled
  times use (:mod:`eval.modeled`);
* the sampling verifier (temperature > 0) is seeded per prompt from ``seed`` (an integer in
  [0, 2**63)) and the prompt's dataset and id (:func:`_prompt_seed`, a hash, not a reduction modulo);
* the engine's host work (predictor, tree, solver, bookkeeping, learning) is priced from its counts with
  the profile's host prices (``clock="counted"``, the default on the CPU: :class:`specfit.engine.clock.CountedClock`,
  :func:`specfit.core.cost.get_host_costs`), so the same command gives the same decisions and modeled figures
  on any machine (greedy); ``clock="measured"`` (the default on CUDA) learns from this machine's CPU time
  instead. Either way each record keeps this machine's measured host CPU ms (``measured_ms["host_thread"]``);
* each method first decodes 2 tokens after a short prompt untimed, so one-time costs (lazy
  imports, allocator warm-up) do not land in the first prompt's wall-clock time.

Resume: ``OUT/config.json`` holds the settings that make results comparable; a rerun with the
same ``OUT`` checks them, keeps every complete line of ``results.jsonl`` (a torn last line from an
interruption is cut off) and skips the (id, dataset, method) triples it already holds.
``OUT/learned.json`` (:mod:`specfit.engine.learned`) holds, per dataset and calibrated method, what the
engine learned after its last finished prompt and the prompt ids that state covers; it is rewritten
atomically after each such prompt, and a resumed run restores it, so an interrupted and resumed run
writes the records an uninterrupted one does (decisions included, where the engine's clock is
deterministic: the counted clock, :class:`specfit.engine.clock.CountedClock`; measured host time varies
run to run). A
record written after the last save of ``learned.json`` (an interruption between the two writes) is
dropped and decoded again. The same file is a later run's ``warm_start``.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specfit.eval.datasets import DATASETS, MAX_ARTICLE_TOKENS, Prompt, encode, load_prompts
from specfit.eval.records import ResultRecord, append_result, read_results
from specfit.core.cost import DEFAULT_HOST_PROFILE, DEFAULT_PROFILE, PROFILES, get_host_profile, get_profile
from specfit.engine import METHODS, TreeSettings
from specfit.core.errors import MAX_NODES, SpecFitInputError, check_context, check_int, check_positive_int, lookup
from specfit.core.readers import read_json
from specfit.engine import learned
from specfit.engine.online import OnlineModel

#: torch CPU threads a run may ask for (``threads``; 0 = torch's default).
MAX_THREADS = 1024
#: Methods of the default run (``oracle`` and ``eagle3-scan`` are available on request).
DEFAULT_METHODS = ("ar", "eagle3-vanilla", "eagle3", "specfit")
#: Datasets of the default run.
DEFAULT_DATASETS = ("gsm8k", "cnndm")

#: Prompt tokens of the untimed warm-up generation each method runs before the timed ones.
WARMUP_TOKENS = 16
#: Settings that must match for results in one ``OUT`` folder to be comparable.
IDENTITY_FIELDS = ("model", "draft", "max_new_tokens", "cache_slots", "eviction", "admission", "profile", "temperature",
                   "top_p", "seed", "total_tokens", "depth", "top_k", "predictor", "max_article_tokens", "rate_mode",
                   "device", "dtype", "offload", "host_profile", "warm_start", "clock", "prefetch")


@dataclass(frozen=True)
class EvalConfig:
    """Settings of one evaluation run (the ``specfit eval`` options).

    Attributes
    ----------
    datasets : tuple of str
        Dataset names or ``.jsonl`` paths (:func:`eval.datasets.load_prompts`).
    limit : int
        Prompts per dataset (the first ones in file order).
    methods : tuple of str
        Method names of :data:`specfit.engine.METHODS`.
    max_new_tokens : int, >= 1
        New tokens per prompt (fewer if the target emits EOS); the longest prompt plus these must
        fit in the target's ``max_position_embeddings``.
    cache_slots : int or "all"
        Expert-cache slots per MoE layer for every method but ``eagle3-vanilla``: an integer in
        [0, experts] or ``"all"`` (default 32: a 24 GB GPU holds about a quarter of Qwen3-30B-A3B's
        128 experts per layer). :func:`plan` resolves ``"all"`` to the expert count.
    eviction : str
        Expert-cache eviction policy (``lru``, ``lfu``, ``lookahead``, ``lookahead-lfu``).
    admission : str
        How a verify's experts rank in the cache: ``all`` (default; plain LRU/LFU) or ``accepted``
        (experts copied only for rejected draft nodes are evicted first; not better on the proxy).
    profile : str
        Hardware profile of :mod:`specfit.core.cost` for the selection and the modeled times.
    model, draft : str or None
        Target checkpoint and EAGLE-3 head directories (default: the shipped proxy target and its
        realistic ``lite`` head); ``draft`` may name a shipped head: ``lite`` or ``strong``.
    temperature, top_p : float
        0 = greedy verification; > 0 = lossless sampling verification.
    seed : int
        Seed of the sampling verifier, an integer in [0, 2**63) (recorded as given; each prompt's seed
        is derived from it by :func:`_prompt_seed`).
    total_tokens, depth, top_k : int
        Draft-tree settings (:class:`specfit.engine.TreeSettings`).
    predictor : str
        Expert predictor of :mod:`models.predictors` for ``eagle3-scan``/``specfit``: ``frequency``
        (default; per-(layer, token) tables blended with recency, held-out recall@8 0.69 on the proxy,
        BENCHMARKS.md), ``recency`` (context only, 0.32) or ``probe``.
    predictor_trace : str, optional
        Routing trace (``.npz`` of :class:`models.traces.RoutingTrace`) the ``frequency`` and ``probe``
        predictors are built from; default: the trace shipped beside the model
        (``routing_trace.npz``, recorded on the proxy's training prompts only).
    max_article_tokens : int
        Cut of a summarisation article, in token ids.
    rate_mode : bool
        Long-run-rate selection instead of the per-cycle ratio (SPECFIT.md §3).
    device : str
        Compute device (``cpu``, ``cuda``, ``cuda:1``); one this torch can use.
    dtype : str or None
        The target's and head's dtype, ``float32`` or ``bfloat16`` (or that torch dtype); default
        the runtime's (float32 on the CPU, bfloat16 on CUDA). The plan records the one used, and
        the device with its index (``cuda`` becomes ``cuda:0``). In bfloat16 a method's greedy output can leave AR's at a
        rounding tie of two logits (the "= ar" column then says no); float32 output equals AR's.
    offload : str
        ``transfer`` (default): uncached experts are copied host-to-device; ``host``: computed on
        the CPU, the device cache holding a static hot set (:mod:`specfit.models.host_compute`).
        With ``host`` the cycles are priced on ``host_profile`` (modeled), and the selection, stop
        rule and AR gate of the cost-aware methods use it too (SPECFIT.md §3, "Host-compute regime").
        ``auto``: per layer each uncached expert is copied or host-computed, whichever
        ``host_profile`` says is faster (:class:`specfit.models.host_compute.AutoOffloadCache`);
        priced and selected as ``host``, the copies priced on the link.
    host_profile : str
        Host-regime profile of :data:`specfit.core.cost.HOST_PROFILES` that prices ``host``/``auto`` runs.
    clock : str or None
        What the engine's host work costs (:data:`specfit.engine.clock.CLOCKS`): ``counted`` prices it from
        its counts with the profile's host prices (reproducible modeled figures), ``measured`` from this
        machine's thread CPU time; None (default): ``counted`` on the CPU, ``measured`` on CUDA (the engine
        learns what its host work costs on the GPU machine it runs on). :func:`plan` records the one used.
    warm_start : str or None
        A previous run folder (its ``learned.json``) or a ``learned.json`` file: each dataset's
        ``specfit``/``oracle`` start from what that run learned on the same dataset (or on the file's
        only set) instead of from nothing. Refused with one line naming the field when the file was
        learned on another target, head, profile, offload mode, predictor, admission rule, device
        type, or with other cache slots, eviction, tree settings or sampling settings
        (:mod:`specfit.engine.learned`).
    threads : int
        torch CPU threads while the run lasts (default 1: the proxy's matrices are too small to
        gain from more, and on a shared machine extra threads only contend; 0 = torch's default).
    out : str or None
        Output folder; None (default): :func:`default_out`, a folder under ``runs/`` named from the
        settings, so runs of other settings do not meet in one folder.
    """

    datasets: tuple[str, ...] = DEFAULT_DATASETS
    limit: int = 10
    methods: tuple[str, ...] = DEFAULT_METHODS
    max_new_tokens: int = 64
    cache_slots: int | str = 32
    eviction: str = "lru"
    admission: str = "all"
    profile: str = DEFAULT_PROFILE
    model: str | None = None
    draft: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    total_tokens: int = 32
    depth: int = 6
    top_k: int = 4
    predictor: str = "frequency"
    predictor_trace: str | None = None
    max_article_tokens: int = MAX_ARTICLE_TOKENS
    rate_mode: bool = False
    prefetch: bool = False
    device: str = "cpu"
    dtype: str | None = None
    offload: str = "transfer"
    host_profile: str = DEFAULT_HOST_PROFILE
    warm_start: str | None = None
    clock: str | None = None
    threads: int = 1
    out: str | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["datasets"], d["methods"] = list(self.datasets), list(self.methods)
        return d


#: Settings :func:`default_out` spells out in the folder name; the others, when not at their default,
#: add a short hash of their values.
_NAMED_IN_OUT = ("model", "draft", "profile", "cache_slots", "offload")


def _profile_label(profile: str) -> str:
    """A profile's part of a folder name: a named profile without its ``qwen3-30b-a3b-`` prefix, a profile file
    (``--profile my-gpu.json``) its file name without the suffix."""
    text = str(profile)
    return text.removeprefix("qwen3-30b-a3b-") if text in PROFILES else Path(text).stem


def default_out(config: EvalConfig, sweep: bool = False) -> str:
    """The output folder of a run without ``out``: ``runs/eval-<head>-<profile>-<S>slots`` (a sweep:
    ``runs/sweep-<head>-<profile>``), the model's folder name first when ``model`` is given, the
    offload mode after the profile when it is not ``transfer``, and ``-x<crc32>`` of every other
    setting that tells results apart (:data:`IDENTITY_FIELDS`) when one is not at its default.
    Datasets, methods and the prompt limit are not in the name: a run that adds them resumes there.

    Example: ``specfit eval --draft strong`` writes to ``runs/eval-strong-pcie4-32slots``.
    """
    base = EvalConfig()
    head = "lite" if config.draft is None else Path(str(config.draft).rstrip("/")).name
    parts = ["sweep" if sweep else "eval", *([Path(str(config.model).rstrip("/")).name] if config.model else []), head,
             _profile_label(config.profile)]
    if not sweep:
        parts.append(f"{config.cache_slots}slots")
    if config.offload != "transfer":
        parts.append(str(config.offload))
    rest = {k: getattr(config, k) for k in IDENTITY_FIELDS if k not in _NAMED_IN_OUT}
    rest["predictor_trace"] = config.predictor_trace
    changed = {k: v for k, v in rest.items() if v != getattr(base, k)}
    if changed:
        parts.append(f"x{zlib.crc32(repr(sorted(changed.items())).encode()):08x}")
    return str(Path("runs") / "-".join(parts))


def _resolve_dirs(config: EvalConfig, drafts: bool) -> tuple[Path, Path | None]:
    from specfit.models.proxy import head_dir, paths

    shipped = paths()
    target = Path(config.model) if config.model else shipped["target"]
    if not (target / "config.json").is_file():
        raise SpecFitInputError("model", f"no Qwen3-MoE checkpoint (config.json) in {target}")
    if not drafts and config.draft is None:
        return target.resolve(), None
    draft = head_dir(config.draft)  # a directory, or a shipped head by name (lite = default, strong)
    if not (draft / "config.json").is_file():  # checked when given, even if no method drafts
        hint = ("; the shipped heads are built by `python -m specfit.models.proxy.train --head --head-lite`"
                if config.draft in (None, "lite", "strong") else "; or name a shipped head: lite (default), strong")
        raise SpecFitInputError("draft", f"no EAGLE-3 head (config.json) in {draft}{hint}")
    return target.resolve(), draft.resolve() if drafts else None


@dataclass
class Plan:
    """A validated run: resolved directories, prompts with their ids, methods, cost model."""

    config: EvalConfig
    target_dir: Path
    draft_dir: Path | None
    prompts: list[tuple[Prompt, list[int]]]
    methods: list
    tokenizer: object
    identity: dict
    trace_path: Path | None = None


def plan(config: EvalConfig, named: str | None = None) -> Plan:
    """Check every setting and input, tokenise every prompt; nothing is written.

    ``named`` is the folder these settings write to without ``out``, named in the error when ``out``
    holds other results (None: :func:`default_out`; a sweep passes its own size's folder).

    Raises
    ------
    SpecFitInputError
        Unknown dataset, method, profile or predictor; a JSONL line without ``prompt``; a
        missing model or head directory; a target without tokenizer; bad numbers; an ``out``
        folder holding results of a different configuration.
    """
    from specfit.models.experts import check_cache_args
    from specfit.models.qwen3_moe import read_spec
    from specfit.models.qwen3_moe.generate import load_tokenizer

    from specfit.pipeline import check_sampling, max_tree_nodes

    named = named or default_out(config)  # from the settings as given, before they are resolved
    if config.out is None:
        config = replace(config, out=named)
    for name in ("limit", "max_new_tokens", "total_tokens", "depth", "top_k", "max_article_tokens"):
        check_positive_int(name, getattr(config, name))
    check_int("threads", config.threads, 0, MAX_THREADS)
    check_sampling(config.temperature, config.top_p, config.seed)
    if max_tree_nodes(_tree(config)) > MAX_NODES:
        raise SpecFitInputError("depth", f"top_k={config.top_k} and depth={config.depth} grow draft trees of up to "
                                f"{max_tree_nodes(_tree(config))} nodes, more than {MAX_NODES} (MAX_NODES)")
    from specfit.models.devices import resolve_device

    device = resolve_device(config.device)  # settings as run: a folder's identity compares these
    config = replace(config, device=str(device), dtype=_dtype_name(config.dtype, device),
                     clock=_clock_name(config.clock, device))
    if not config.methods:
        raise SpecFitInputError("methods", "name at least one method")
    if len(set(config.methods)) != len(config.methods):
        raise SpecFitInputError("methods", "names a method twice")
    methods = [lookup(METHODS, m, "methods") for m in config.methods]
    if not config.datasets:
        raise SpecFitInputError("datasets", "name at least one dataset")
    from specfit.models.host_compute import check_offload

    check_offload(config.offload)
    gpu_side = get_host_profile(config.host_profile).gpu.name
    if config.offload != "transfer" and config.profile != gpu_side:
        raise SpecFitInputError("profile", f"with offload {config.offload!r} the GPU side of the cost model is "
                                f"{gpu_side!r} (from host_profile {config.host_profile!r}), not {config.profile!r}: "
                                f"leave profile at {gpu_side!r} or pick another host_profile")
    if get_profile(config.profile).draft_level_ms is None:
        raise SpecFitInputError("profile", f"no draft-level time is modeled for {config.profile!r} (draft_level_ms; a "
                                           f"profile from specfit.eval.cost_fit takes it from --like PROFILE)")
    from specfit.models.predictors import PREDICTORS

    lookup(PREDICTORS, config.predictor, "predictor")
    prompts_by_set = [load_prompts(d, config.limit) for d in config.datasets]
    names = [ps[0].dataset for ps in prompts_by_set]
    if len(set(names)) != len(names):
        raise SpecFitInputError("datasets", "names a dataset twice")
    target_dir, draft_dir = _resolve_dirs(config, any(m.needs_drafter for m in methods))
    spec = read_spec(target_dir)
    if not spec.moe_layers:
        raise SpecFitInputError("model", f"{target_dir} has no MoE layer (mlp_only_layers / decoder_sparse_step "
                                "leave none): there are no experts to offload or select for")
    config = replace(config, cache_slots=check_cache_args(config.cache_slots, config.eviction, spec.num_experts,
                                                          config.admission))
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise SpecFitInputError("model", f"{target_dir} ships no tokenizer; the evaluation prompts are text")
    prompts = [(p, encode(p, tokenizer, config.max_article_tokens)) for ps in prompts_by_set for p in ps]
    empty = [p.id for p, ids in prompts if not ids]
    if empty:
        raise SpecFitInputError("prompt", f"prompt {empty[0]!r} encodes to no tokens")
    longest = max(prompts, key=lambda item: len(item[1]))
    try:
        check_context("max_new_tokens", len(longest[1]), config.max_new_tokens, spec.max_position_embeddings)
    except SpecFitInputError as exc:
        raise SpecFitInputError(exc.field, f"{exc.rule} (longest prompt: {longest[0].dataset}/{longest[0].id})") from None
    trace = None
    if config.predictor != "recency" and any(m.needs_predictor for m in methods):
        trace = Path(config.predictor_trace) if config.predictor_trace else target_dir / "routing_trace.npz"
        if not trace.is_file():
            raise SpecFitInputError("predictor_trace", f"predictor {config.predictor!r} needs a routing trace; "
                                    f"no such file: {trace} (record one with python -m specfit.eval.predictors --save-traces)")
    identity = {k: getattr(config, k) for k in IDENTITY_FIELDS}
    identity.update(model=str(target_dir), draft=None if draft_dir is None else str(draft_dir),
                    model_files=_fingerprint(target_dir), draft_files=_fingerprint(draft_dir),
                    predictor_trace=None if trace is None else str(trace.resolve()))
    _check_out(Path(config.out), identity, named)
    return Plan(config, target_dir, draft_dir, prompts, methods, tokenizer, identity, trace)


def _clock_name(clock, device) -> str:
    """``clock`` if it names a clock of :data:`specfit.engine.clock.CLOCKS`; None: ``"measured"`` on CUDA,
    ``"counted"`` elsewhere.

    Raises
    ------
    SpecFitInputError
        ``clock``, if it names another clock.
    """
    from specfit.engine.clock import CLOCKS

    if clock is None:
        return "measured" if getattr(device, "type", str(device)).startswith("cuda") else "counted"
    if clock not in CLOCKS:
        raise SpecFitInputError("clock", f"must be one of {', '.join(CLOCKS)} (or None: counted on the CPU, measured "
                                         f"on CUDA), got {clock!r}")
    return clock


def _dtype_name(dtype, device) -> str:
    """``"float32"`` or ``"bfloat16"``: ``dtype`` given by name or as a torch dtype, or None for the
    runtime's default on ``device`` (:func:`specfit.models.devices.default_dtype`).

    Raises
    ------
    SpecFitInputError
        ``dtype``, if it names another dtype.
    """
    from specfit.models.devices import default_dtype

    name = str(default_dtype(device) if dtype is None else dtype).removeprefix("torch.")
    if name not in ("float32", "bfloat16"):
        raise SpecFitInputError("dtype", f"must be 'float32' or 'bfloat16' (or None: float32 on the CPU, bfloat16 on "
                                         f"CUDA), got {dtype!r}")
    return name


def _fingerprint(d: Path | None) -> str | None:
    """Names, sizes and modification times of a checkpoint's config and weight files, hashed: a
    retrained model in the same folder does not resume into old results (model cards and reports
    written beside the weights do not count)."""
    if d is None:
        return None
    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(d.iterdir())
             if f.name == "config.json" or f.suffix in (".safetensors", ".bin")]
    return f"{zlib.crc32(repr(stamp).encode()):08x}"


#: Identity fields that only some methods need (the head, the predictor's routing trace): a run of
#: other methods into the same folder leaves them None, and adding a method that needs them resumes.
_OPTIONAL_PARTS = ("draft", "draft_files", "predictor_trace")


def _check_out(out: Path, identity: dict, named: str) -> None:
    """Refuse an ``out`` folder whose ``config.json`` holds other settings; the error names the
    folder these settings get by default (``named``, :func:`default_out`) when that is another one."""
    cfg = out / "config.json"
    if out.exists() and not out.is_dir():
        raise SpecFitInputError("out", f"{out} exists and is not a folder")
    if out.is_dir() and ((out / "sweep.json").is_file() or any(out.glob("slots-*/config.json"))):
        raise SpecFitInputError("out", f"{out} holds a cache-size sweep (slots-<S> folders): run the sweep's "
                                       f"--cache-slots list there, or name another folder for one cache size")
    if not cfg.is_file():
        return
    try:
        old = read_json(cfg)
    except SpecFitInputError as exc:
        raise SpecFitInputError("out", f"{exc.field}: {exc.rule}; use another out folder") from None
    if "clock" in identity and "model" in old:  # a folder written before the clock was recorded: measured
        old = {"clock": "measured", **old}
    for k, v in identity.items():  # a head or trace only some methods need may be missing on one side
        if k in old and old[k] != v and not (k in _OPTIONAL_PARTS and (old[k] is None or v is None)):
            fix = (f"leave out --out (these settings write to {named}) or name another folder"
                   if Path(named) != out else "name another folder with --out")
            raise SpecFitInputError("out", f"{out} holds results with {k}={old[k]!r}, this run has {k}={v!r}; {fix}")


# -- models ---------------------------------------------------------------------------------------
def load_models(p: Plan):
    """The target, head, predictor and cost model of a run, built by :class:`specfit.pipeline.SpecFit`.

    One target serves every method: :meth:`SpecFit.decoder` gives it an empty expert cache of
    ``cache_slots`` (0 for ``eagle3-vanilla``) before each generation. Its KV holds the longest
    prompt, ``max_new_tokens`` and one draft tree.
    """
    from specfit.pipeline import SpecFit, kv_tokens_needed

    from specfit.core.cost import get_host_costs
    from specfit.engine.clock import make_clock

    c = p.config
    longest = max(len(ids) for _, ids in p.prompts)
    needs_predictor = p.trace_path is not None or c.predictor == "recency"
    models = SpecFit.from_pretrained(p.target_dir, p.draft_dir, cache_slots=c.cache_slots, eviction=c.eviction,
                                   admission=c.admission,
                                   device=c.device, dtype=c.dtype, predictor=c.predictor if needs_predictor else None,
                                   predictor_trace=p.trace_path, profile=c.profile, offload=c.offload,
                                   host_profile=c.host_profile,
                                   max_len=kv_tokens_needed(longest, c.max_new_tokens, _tree(c)))
    models.clock = make_clock(c.clock, get_host_costs(c.profile))
    models.identity["clock"] = c.clock  # what it learns is in the clock's ms: a warm start must match it
    return models


#: The summary's note on a ``--offload host`` run.
_HOST_NOTE = ("Offload host: experts outside the device cache were computed on the CPU; the cache held a static "
              "hot set (the most frequently routed experts of the routing trace) instead of starting empty. "
              "tok/s modeled prices the cycles on the host-regime profile {profile} (modeled: per MoE layer "
              "max(GPU part, host experts x per-expert + rows x per-row) + sync; specfit.core.cost.HostProfile). "
              "experts/token and hit rate count the experts computed on the host as the uncached ones. "
              "The selection, stop rule and AR gate of eagle3-scan/specfit use the same host-regime profile "
              "(SPECFIT.md §3, \"Host-compute regime\").")

#: The summary's note on a ``--offload auto`` run.
_AUTO_NOTE = ("Offload auto: the device cache started as the host mode's static hot set; per MoE layer and forward, "
              "each uncached expert was copied into the cache (evicting by the cache's policy) or computed on the "
              "CPU, whichever the host-regime profile {profile} says makes the layer faster (HostProfile.split). "
              "tok/s modeled prices the cycles on that profile (modeled: per MoE layer max(GPU part + copies x "
              "per-expert H2D, host experts x per-expert + rows x per-row) + sync). experts/token and hit rate "
              "count copied and host-computed experts as the uncached ones. The selection, stop rule and AR gate "
              "of eagle3-scan/specfit price a verify as the host mode does, an upper bound on its time here "
              "(SPECFIT.md §3, \"Host-compute regime\").")


def _tree(c: EvalConfig) -> TreeSettings:
    return TreeSettings(c.total_tokens, c.depth, c.top_k)


def _sampling(c: EvalConfig, seed: int) -> dict:
    return dict(temperature=c.temperature, top_p=c.top_p, seed=seed, rate_mode=c.rate_mode, prefetch=c.prefetch)


def _prompt_seed(seed: int, prompt: Prompt) -> int:
    """The sampling verifier's seed for one prompt, in [0, 2**63): the first 63 bits of
    SHA-256(``"<seed>/<dataset>/<id>"``), a function of the run's seed (recorded in config.json as
    given) and the prompt, never of the prompts before it."""
    digest = hashlib.sha256(f"{seed}/{prompt.dataset}/{prompt.id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def run_eval(config: EvalConfig, progress: bool = True) -> dict:
    """Run the evaluation and write ``results.jsonl``, ``summary.json``, ``summary.md`` and plots.

    Parameters
    ----------
    config : EvalConfig
    progress : bool
        Show a progress bar (tqdm, on stderr).

    Returns
    -------
    dict
        ``{"rows": summary rows, "markdown": summary text (summary.md), "table": the shorter table
        ``specfit eval`` prints (:func:`specfit.eval.report.printed_table`), "paths": {name: Path}, "ran":
        int (new generations), "skipped": int (found in results.jsonl)}``.

    Raises
    ------
    SpecFitInputError
        Bad configuration or input (see :func:`plan`); raised before anything is written.
    """
    import torch

    p = plan(config)
    threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        return _run(p, progress)
    finally:
        torch.set_num_threads(threads)


def evaluate(config: EvalConfig | None = None, /, *, progress: bool = False, **options) -> dict:
    """Run the evaluation from Python with the settings ``specfit eval`` takes.

    Parameters
    ----------
    config : EvalConfig, optional
        Base settings (default ``EvalConfig()``, the CLI's defaults).
    progress : bool
        Show a progress bar (tqdm, on stderr).
    **options
        Fields of :class:`EvalConfig` overriding ``config`` (``limit=2``, ``out="runs/x"``, ...);
        ``datasets`` and ``methods`` may be comma-separated strings, as on the command line, or
        sequences of names. ``cache_slots`` as a list (``[16, 32, "all"]``) or a comma string
        (``"16,32,all"``) runs a cache-size sweep (:func:`specfit.eval.sweep.run_sweep`): one run per
        size in ``out/slots-<S>``, then ``out/sweep.md``, ``out/sweep.json``, ``out/crossover.png``.

    Returns
    -------
    dict
        As :func:`run_eval`: ``rows`` (summary rows; crossover rows for a sweep), ``markdown``,
        ``table`` (a sweep's: the printed table and what the sweep shows), ``paths``, ``ran``, ``skipped``.

    Raises
    ------
    TypeError
        An option that is not a field of :class:`EvalConfig`.
    SpecFitInputError
        Bad configuration or input (see :func:`plan`); raised before anything is written.
    """
    from dataclasses import fields, replace

    unknown = sorted(set(options) - {f.name for f in fields(EvalConfig)})
    if unknown:
        raise TypeError(f"evaluate() got an unknown option {unknown[0]!r}; the options are EvalConfig's fields")
    for name in ("datasets", "methods"):
        if isinstance(options.get(name), str):
            options[name] = tuple(s.strip() for s in options[name].split(",") if s.strip())
        elif name in options:
            options[name] = tuple(options[name])
    from specfit.eval.sweep import parse_cache_slots, run_sweep

    sizes = parse_cache_slots(options.get("cache_slots", (config or EvalConfig()).cache_slots))
    if sizes is not None:
        return run_sweep(replace(config or EvalConfig(), **{**options, "cache_slots": 0}), sizes, progress=progress)
    return run_eval(replace(config or EvalConfig(), **options), progress=progress)


def _restore_learned(path: Path, results_path: Path, identity: dict) -> dict:
    """The ``learned.json`` of a run folder (an empty one if none), with ``results.jsonl`` brought in
    line with it: a calibrated method's record of a prompt the saved state does not cover (written
    just before an interruption, before the state was saved) is removed, so that prompt is decoded
    again from the state before it.

    A covered prompt whose record is missing (a record removed by hand) is decoded again from the
    saved state, which already holds what that prompt taught: its decisions can differ from the first time.

    Raises
    ------
    SpecFitInputError
        (field ``learned.json``) The file is malformed.
    """
    from specfit.core.io import atomic_write_text

    if not path.is_file():
        return learned.document(identity, {})
    try:
        doc = learned.read(path)
    except SpecFitInputError as exc:
        raise SpecFitInputError("learned.json", f"{exc.rule}; move it away to rerun the calibrated methods") from None
    covered = {(d, e["key"]["method"], pid) for d, items in doc["sets"].items() for e in items for pid in e.get("covers", [])}
    calibrated = {n for n, m in METHODS.items() if m.calibrated}
    recs = read_results(results_path, repair=True)
    stale = {(r.dataset, r.method, r.id) for r in recs if r.method in calibrated} - covered
    if stale:
        lines = results_path.read_bytes().splitlines(keepends=True)
        keep = [ln for ln in lines if not ln.strip() or _record_key(json.loads(ln)) not in stale]
        atomic_write_text(results_path, b"".join(keep).decode("utf-8"))
    return doc


def _record_key(obj: dict) -> tuple:
    return obj["dataset"], obj["method"], obj["id"]


def _warm_start(config: EvalConfig, models, p: Plan) -> dict:
    """Per dataset of the run, the entries of ``config.warm_start`` its calibrated methods start from
    (checked: identity, then each calibrated method's key); ``{}`` without a warm start."""
    if config.warm_start is None:
        return {}
    doc = learned.read(config.warm_start)
    learned.check_identity(doc["identity"], models.identity)
    tree = _tree(config)
    out = {}
    for d in dict.fromkeys(pr.dataset for pr, _ in p.prompts):
        items = learned.pick_set(doc, d)
        out[d] = []
        for m in p.methods:
            if m.calibrated:
                want = learned.key_to_json(models.online_key(m.name, tree, config.temperature, config.top_p))
                e = learned.check_key(items, want)
                OnlineModel.from_json(e.get("online"))  # a malformed model is refused before anything runs
                out[d].append({"key": e["key"], "online": e["online"]})
    return out


def _save_learned(path: Path, doc: dict, models, pr: Prompt, m, config: EvalConfig) -> None:
    """Record ``models.online``'s model of ``m`` (after prompt ``pr``) in ``doc`` and write it atomically."""
    key = models.online_key(m.name, _tree(config), config.temperature, config.top_p)
    items = doc["sets"].setdefault(pr.dataset, [])
    kj = learned.key_to_json(key)
    old = next((e for e in items if e["key"] == kj), None)
    covers = [] if old is None else [c for c in old.get("covers", []) if c != pr.id]
    covers.append(pr.id)
    entry = {"key": kj, "covers": covers, "online": models.online[key].to_json()}
    doc["sets"][pr.dataset] = [e for e in items if e["key"] != kj] + [entry]
    doc["identity"] = dict(models.identity)
    learned.write(path, doc)


def _run(p: Plan, progress: bool) -> dict:
    import torch
    from tqdm import tqdm

    from specfit.core.cost import get_host_costs
    from specfit.core.io import atomic_write_text, dumps
    from specfit.eval.report import printed_table, write_summary

    config = p.config
    models = load_models(p)
    warm = _warm_start(config, models, p)  # refused before anything is written
    spec = models.target.spec
    num_layers = len(spec.moe_layers)
    out = Path(config.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecFitInputError("out", f"cannot create the folder {out}: {exc.strerror or exc}") from None
    cfg_path = out / "config.json"
    old = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    identity = {**p.identity, **{k: p.identity[k] or old.get(k) for k in _OPTIONAL_PARTS}}
    atomic_write_text(cfg_path, dumps(identity, indent=1) + "\n")
    results_path = out / "results.jsonl"
    learned_path = out / learned.FILE_NAME
    saved = _restore_learned(learned_path, results_path, models.identity)
    done = {r.key for r in read_results(results_path, repair=True)}
    todo = [(pr, ids, m) for pr, ids in p.prompts for m in p.methods if (pr.id, pr.dataset, m.name) not in done]
    skipped = len(p.prompts) * len(p.methods) - len(todo)
    eos = models.eos_token_id
    pricing = models.cost  # host/auto mode: the host profile, which also drives the selection
    with open(results_path, "a", encoding="utf-8") as f, torch.no_grad():
        for m in dict.fromkeys(m for _, _, m in todo):  # untimed warm-up: first-call costs stay out of wall_s
            models.decoder(m, tree=_tree(config), **_sampling(config, 0)).generate(todo[0][1][-WARMUP_TOKENS:], 2)
        bar = tqdm(todo, desc="specfit eval", unit="gen", disable=not progress, dynamic_ncols=True)
        dataset = None
        for pr, ids, m in bar:
            if pr.dataset != dataset:  # each dataset learns afresh (or from warm_start), or resumes what it learned
                models.online.clear()
                dataset = pr.dataset
                for e in warm.get(dataset, []) + saved["sets"].get(dataset, []):  # a resumed key wins
                    models.online[learned.key_from_json(e["key"])] = OnlineModel.from_json(e["online"])
            bar.set_postfix_str(f"{pr.dataset}/{pr.id[:18]} {m.name}")
            dec = models.decoder(m, tree=_tree(config), **_sampling(config, _prompt_seed(config.seed, pr)))
            gen = dec.generate(ids, config.max_new_tokens, eos_id=eos)
            text = p.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            append_result(f, ResultRecord.from_generation(pr, m.name, ids, gen, text, pricing))
            if m.calibrated:  # what it learned, with the prompts it covers, after each finished prompt
                _save_learned(learned_path, saved, models, pr, m, config)
    records = read_results(results_path)
    keys = {(pr.id, pr.dataset) for pr, _ in p.prompts}
    order = {m: i for i, m in enumerate(config.methods)}
    sets = {d: i for i, d in enumerate(dict.fromkeys(pr.dataset for pr, _ in p.prompts))}
    records = sorted((r for r in records if (r.id, r.dataset) in keys and r.method in order),
                     key=lambda r: (sets[r.dataset], order[r.method]))  # rows: datasets, then --methods
    meta = {"config": config.to_json(), "resolved": p.identity, "num_layers": num_layers,
            "num_experts": int(spec.num_experts), "top_k": int(spec.top_k),
            "cost": pricing.to_json(), "draft_level_ms": models.cost.draft_level_ms, "max_len": models.target.max_len,
            "clock": config.clock,
            **({"host_costs": get_host_costs(config.profile).to_json()} if config.clock == "counted" else {})}
    if config.offload != "transfer":
        meta["offload_note"] = (_HOST_NOTE if config.offload == "host" else _AUTO_NOTE).format(profile=config.host_profile)
    rows, text, paths = write_summary(out, records, meta, [pr for pr, _ in p.prompts])
    return {"rows": rows, "markdown": text, "table": printed_table(rows, paths["summary_md"]),
            "paths": {"results": results_path, "config": cfg_path,
                      **({"learned": learned_path} if learned_path.is_file() else {}), **paths}, "ran": len(todo), "skipped": skipped}


__all__ = ["EvalConfig", "DATASETS", "DEFAULT_METHODS", "DEFAULT_DATASETS", "plan", "run_eval", "evaluate",
           "load_models", "read_results", "append_result", "ResultRecord"]
