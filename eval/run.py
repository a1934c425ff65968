"""The end-to-end evaluation behind ``specfit eval``: every method on the same prompts, one engine.

For each prompt (datasets in order) and each method (SPECFIT.md §6), one :class:`SpecDecoder`
configured for that method decodes the same prompt token ids; one line per prompt × method is
appended to ``OUT/results.jsonl`` (flushed and fsync'ed), then :mod:`eval.report` writes
``summary.json``, ``summary.md`` and the plots.

Fairness and reproducibility:

* every method runs the same target weights, tokenizer, prompt ids, ``max_new_tokens`` and EOS;
  ``eagle3-vanilla`` runs the target with ``cache_slots=0`` (every needed expert transferred each
  forward), the others with ``cache_slots`` slots per MoE layer;
* every generation starts with an empty expert cache, warmed by its own prefill, so each result
  is independent of the order of runs and of interruptions;
* the selection of the cost-aware methods uses ``get_profile(profile).for_layers(L)``, the cost
  model the modeled times use (:mod:`eval.modeled`);
* the sampling verifier (temperature > 0) is seeded per prompt from ``seed`` and the prompt id;
* each method first decodes 2 tokens after a short prompt untimed, so one-time costs (lazy
  imports, allocator warm-up) do not land in the first prompt's wall-clock time.

Resume: ``OUT/config.json`` holds the settings that make results comparable; a rerun with the
same ``OUT`` checks them, keeps every complete line of ``results.jsonl`` (a torn last line from an
interruption is cut off) and skips the (id, dataset, method) triples it already holds.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from specfit.eval.datasets import DATASETS, MAX_ARTICLE_TOKENS, Prompt, encode, load_prompts
from specfit.eval.records import ResultRecord, append_result, read_results
from specfit.core.cost import DEFAULT_PROFILE, get_profile
from specfit.engine import TreeSettings, get_method
from specfit.core.errors import SpecFitInputError, check_positive_int, lookup

#: Methods of the default run (``oracle`` and ``eagle3-scan`` are available on request).
DEFAULT_METHODS = ("ar", "eagle3-vanilla", "eagle3", "specfit")
#: Datasets of the default run.
DEFAULT_DATASETS = ("gsm8k", "cnndm")

#: Prompt tokens of the untimed warm-up generation each method runs before the timed ones.
WARMUP_TOKENS = 16
#: Settings that must match for results in one ``OUT`` folder to be comparable.
IDENTITY_FIELDS = ("model", "draft", "max_new_tokens", "cache_slots", "eviction", "profile", "temperature", "top_p",
                   "seed", "total_tokens", "depth", "top_k", "predictor", "max_article_tokens", "rate_mode", "device")


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
    max_new_tokens : int
        New tokens per prompt (fewer if the target emits EOS).
    cache_slots : int
        Expert-cache slots per MoE layer for every method but ``eagle3-vanilla`` (default 32: a
        24 GB GPU holds about a quarter of Qwen3-30B-A3B's 128 experts per layer).
    eviction : str
        Expert-cache eviction policy (``lru``/``lfu``).
    profile : str
        Hardware profile of :mod:`specfit.core.cost` for the selection and the modeled times.
    model, draft : str or None
        Target checkpoint and EAGLE-3 head directories (default: the shipped proxy pair).
    temperature, top_p : float
        0 = greedy verification; > 0 = lossless sampling verification.
    seed : int
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
        Compute device (``cpu``, ``cuda``, ``cuda:1``).
    threads : int
        torch CPU threads while the run lasts (default 1: the proxy's matrices are too small to
        gain from more, and on a shared machine extra threads only contend; 0 = torch's default).
    out : str
        Output folder.
    """

    datasets: tuple[str, ...] = DEFAULT_DATASETS
    limit: int = 10
    methods: tuple[str, ...] = DEFAULT_METHODS
    max_new_tokens: int = 64
    cache_slots: int = 32
    eviction: str = "lru"
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
    device: str = "cpu"
    threads: int = 1
    out: str = "runs/eval"

    def to_json(self) -> dict:
        d = asdict(self)
        d["datasets"], d["methods"] = list(self.datasets), list(self.methods)
        return d


def _resolve_dirs(config: EvalConfig, drafts: bool) -> tuple[Path, Path | None]:
    from specfit.models.proxy import paths

    shipped = paths()
    target = Path(config.model) if config.model else shipped["target"]
    if not (target / "config.json").is_file():
        raise SpecFitInputError("--model", f"no Qwen3-MoE checkpoint (config.json) in {target}")
    if not drafts:
        return target.resolve(), None
    draft = Path(config.draft) if config.draft else shipped["eagle3"]
    if not (draft / "config.json").is_file():
        hint = ("; the shipped head is built by `python -m specfit.models.proxy.train --head`" if not config.draft
                else "")
        raise SpecFitInputError("--draft", f"no EAGLE-3 head (config.json) in {draft}{hint}")
    return target.resolve(), draft.resolve()


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


def plan(config: EvalConfig) -> Plan:
    """Check every setting and input, tokenise every prompt; nothing is written.

    Raises
    ------
    SpecFitInputError
        Unknown dataset, method, profile or predictor; a JSONL line without ``prompt``; a
        missing model or head directory; a target without tokenizer; bad numbers; an ``out``
        folder holding results of a different configuration.
    """
    from specfit.models.qwen3_moe.generate import load_tokenizer

    for name in ("limit", "max_new_tokens", "total_tokens", "depth", "top_k", "max_article_tokens"):
        check_positive_int(f"--{name.replace('_', '-')}", getattr(config, name))
    if isinstance(config.threads, bool) or not isinstance(config.threads, int) or config.threads < 0:
        raise SpecFitInputError("--threads", f"must be an integer >= 0, got {config.threads!r}")
    if isinstance(config.cache_slots, bool) or not isinstance(config.cache_slots, int) or config.cache_slots < 0:
        raise SpecFitInputError("--cache-slots", f"must be an integer >= 0, got {config.cache_slots!r}")
    if not config.temperature >= 0:
        raise SpecFitInputError("--temperature", f"must be >= 0, got {config.temperature}")
    if not 0 < config.top_p <= 1:
        raise SpecFitInputError("--top-p", f"must be in (0, 1], got {config.top_p}")
    if not config.methods:
        raise SpecFitInputError("--methods", "name at least one method")
    if len(set(config.methods)) != len(config.methods):
        raise SpecFitInputError("--methods", "names a method twice")
    methods = [get_method(m) for m in config.methods]
    if not config.datasets:
        raise SpecFitInputError("--dataset", "name at least one dataset")
    if get_profile(config.profile).draft_level_ms is None:
        raise SpecFitInputError("--profile", f"no draft-level time is modeled for {config.profile!r}")
    from specfit.models.predictors import PREDICTORS

    lookup(PREDICTORS, config.predictor, "--predictor")
    prompts_by_set = [load_prompts(d, config.limit) for d in config.datasets]
    names = [ps[0].dataset for ps in prompts_by_set]
    if len(set(names)) != len(names):
        raise SpecFitInputError("--dataset", "names a dataset twice")
    target_dir, draft_dir = _resolve_dirs(config, any(m.drafts for m in methods))
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise SpecFitInputError("--model", f"{target_dir} ships no tokenizer; the evaluation prompts are text")
    prompts = [(p, encode(p, tokenizer, config.max_article_tokens)) for ps in prompts_by_set for p in ps]
    empty = [p.id for p, ids in prompts if not ids]
    if empty:
        raise SpecFitInputError("prompt", f"prompt {empty[0]!r} encodes to no tokens")
    trace = None
    if config.predictor != "recency" and any(m.needs_predictor for m in methods):
        trace = Path(config.predictor_trace) if config.predictor_trace else target_dir / "routing_trace.npz"
        if not trace.is_file():
            raise SpecFitInputError("--predictor-trace", f"predictor {config.predictor!r} needs a routing trace; "
                                    f"no such file: {trace} (record one with python -m specfit.eval.predictors --save-traces)")
    identity = {k: getattr(config, k) for k in IDENTITY_FIELDS}
    identity.update(model=str(target_dir), draft=None if draft_dir is None else str(draft_dir),
                    model_files=_fingerprint(target_dir), draft_files=_fingerprint(draft_dir),
                    predictor_trace=None if trace is None else str(trace.resolve()))
    _check_out(Path(config.out), identity)
    return Plan(config, target_dir, draft_dir, prompts, methods, tokenizer, identity, trace)


def _fingerprint(d: Path | None) -> str | None:
    """Names, sizes and modification times of a checkpoint's config and weight files, hashed: a
    retrained model in the same folder does not resume into old results (model cards and reports
    written beside the weights do not count)."""
    if d is None:
        return None
    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(d.iterdir())
             if f.name == "config.json" or f.suffix in (".safetensors", ".bin")]
    return f"{zlib.crc32(repr(stamp).encode()):08x}"


def _check_out(out: Path, identity: dict) -> None:
    cfg = out / "config.json"
    if out.exists() and not out.is_dir():
        raise SpecFitInputError("--out", f"{out} exists and is not a folder")
    if not cfg.is_file():
        return
    try:
        old = json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError):
        raise SpecFitInputError("--out", f"{cfg} is unreadable; use another --out") from None
    for k, v in identity.items():
        if k in old and old[k] != v and not (k.startswith("draft") and (old[k] is None or v is None)):
            raise SpecFitInputError("--out", f"{out} holds results with {k}={old[k]!r}, this run has {k}={v!r}; "
                                             "use another --out")


# -- models ---------------------------------------------------------------------------------------
class _Models:
    """The target(s), head and per-method decoders of one run."""

    def __init__(self, p: Plan):
        from specfit.models.eagle3 import Eagle3Drafter, load_eagle3
        from specfit.models.qwen3_moe import OffloadedQwen3Moe

        c = p.config
        longest = max(len(ids) for _, ids in p.prompts)
        tree_nodes = c.top_k * (1 + (c.depth - 1) * c.top_k)  # nodes EAGLE-2 growth drafts at most
        self.max_len = longest + c.max_new_tokens + tree_nodes + 2
        self.aux, self.head = None, None
        if p.draft_dir is not None:  # the head fixes which target features the target must return
            from specfit.models.eagle3 import Eagle3Config, check_target

            target_cfg = json.loads((p.target_dir / "config.json").read_text())
            head_cfg = Eagle3Config.from_dict(json.loads((p.draft_dir / "config.json").read_text()))
            self.aux = check_target(head_cfg, target_cfg)

        def load(slots):
            return OffloadedQwen3Moe.from_pretrained(p.target_dir, device=c.device, cache_slots=slots,
                                                     eviction=c.eviction, max_len=self.max_len, aux_layers=self.aux)

        self.targets = {}
        for m in p.methods:
            slots = c.cache_slots if m.uses_cache else 0
            if slots not in self.targets:
                self.targets[slots] = load(slots)
        self.reference = load("all") if any(m.needs_reference for m in p.methods) else None
        if p.draft_dir is not None:
            any_target = next(iter(self.targets.values()))
            embed = any_target.w["model.embed_tokens.weight"]
            self.head = load_eagle3(p.draft_dir, target_config=target_cfg, embed_weight=embed.float(),
                                    device=c.device, dtype=any_target.dtype)
        self.drafter = Eagle3Drafter(self.head) if self.head is not None else None
        any_target = next(iter(self.targets.values()))
        self.spec = any_target.spec
        self.num_layers = len(self.spec.moe_layers)
        self.cost = get_profile(c.profile).for_layers(self.num_layers)
        self.predictor = None
        if p.trace_path is not None or c.predictor == "recency":
            from specfit.models.predictors import get_predictor

            extra = {} if p.trace_path is None else {"trace": p.trace_path}
            self.predictor = get_predictor(c.predictor, num_layers=self.num_layers, num_experts=self.spec.num_experts,
                                           top_k=self.spec.top_k, **extra)

    def decoder(self, p: Plan, method, seed: int):
        """A fresh :class:`SpecDecoder` for ``method`` whose target starts with an empty expert cache."""
        from specfit.models.experts import DeviceExpertCache
        from specfit.engine import SpecDecoder

        c = p.config
        slots = c.cache_slots if method.uses_cache else 0
        target = self.targets[slots]
        target.cache = None  # free the old slots before allocating the new ones
        target.cache = DeviceExpertCache(target.store, target.device, slots, c.eviction)
        predictor = self.predictor if method.needs_predictor else None
        return SpecDecoder(target, self.drafter if method.drafts else None, method,
                           tree=TreeSettings(c.total_tokens, c.depth, c.top_k), cost=self.cost, predictor=predictor,
                           reference=self.reference if method.needs_reference else None, temperature=c.temperature,
                           top_p=c.top_p, seed=seed, rate_mode=c.rate_mode)


def _prompt_seed(seed: int, prompt: Prompt) -> int:
    return (seed * 1_000_003 + zlib.crc32(f"{prompt.dataset}/{prompt.id}".encode())) % (2**63)


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
        ``{"rows": summary rows, "markdown": summary text, "paths": {name: Path}, "ran": int (new
        generations), "skipped": int (found in results.jsonl)}``.

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


def _run(p: Plan, progress: bool) -> dict:
    import torch
    from tqdm import tqdm

    from specfit.core.io import atomic_write_text
    from specfit.eval.report import write_summary

    config = p.config
    models = _Models(p)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.json"
    old = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    identity = {**p.identity, **{k: p.identity[k] or old.get(k) for k in ("draft", "draft_files")}}
    atomic_write_text(cfg_path, json.dumps(identity, indent=1) + "\n")
    results_path = out / "results.jsonl"
    done = {r.key for r in read_results(results_path, repair=True)}
    todo = [(pr, ids, m) for pr, ids in p.prompts for m in p.methods if (pr.id, pr.dataset, m.name) not in done]
    skipped = len(p.prompts) * len(p.methods) - len(todo)
    eos = models.spec.eos_token_id
    with open(results_path, "a", encoding="utf-8") as f, torch.no_grad():
        for m in dict.fromkeys(m for _, _, m in todo):  # untimed warm-up: first-call costs stay out of wall_s
            models.decoder(p, m, 0).generate(todo[0][1][-WARMUP_TOKENS:], 2)
        bar = tqdm(todo, desc="specfit eval", unit="gen", disable=not progress, dynamic_ncols=True)
        for pr, ids, m in bar:
            bar.set_postfix_str(f"{pr.dataset}/{pr.id[:18]} {m.name}")
            dec = models.decoder(p, m, _prompt_seed(config.seed, pr))
            gen = dec.generate(ids, config.max_new_tokens, eos_id=eos)
            text = p.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            append_result(f, ResultRecord.from_generation(pr, m.name, ids, gen, text, models.cost))
    records = read_results(results_path)
    keys = {(pr.id, pr.dataset) for pr, _ in p.prompts}
    order = {m: i for i, m in enumerate(config.methods)}
    sets = {d: i for i, d in enumerate(dict.fromkeys(pr.dataset for pr, _ in p.prompts))}
    records = sorted((r for r in records if (r.id, r.dataset) in keys and r.method in order),
                     key=lambda r: (sets[r.dataset], order[r.method]))  # rows: datasets, then --methods
    meta = {"config": config.to_json(), "resolved": p.identity, "num_layers": models.num_layers,
            "num_experts": int(models.spec.num_experts), "top_k": int(models.spec.top_k),
            "cost": models.cost.to_json(), "draft_level_ms": models.cost.draft_level_ms, "max_len": models.max_len}
    rows, text, paths = write_summary(out, records, meta, [pr for pr, _ in p.prompts])
    return {"rows": rows, "markdown": text, "paths": {"results": results_path, "config": cfg_path, **paths},
            "ran": len(todo), "skipped": skipped}


__all__ = ["EvalConfig", "DATASETS", "DEFAULT_METHODS", "DEFAULT_DATASETS", "plan", "run_eval", "read_results",
           "append_result", "ResultRecord"]
