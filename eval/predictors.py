"""Recall@k per MoE layer of the expert predictors, on prompts not used to build them.

Builds each predictor of :mod:`models.predictors` from routing traces of *training* prompts (GSM8K
train, CNN/DailyMail training articles, the plain-English corpus; ``models.proxy.data``), then
replays held-out prompts (GSM8K test, the reserved CNN/DailyMail articles) token by token as the
engine would meet them: token j is a draft node at depth d (``--depth``, default 1) below the
cycle's root ``x[j-d]``, so the predictor has been told the true routing of tokens ``< j - d``
(:meth:`observe`; the root's routing is known only after its verify) and is asked for token j's
experts given its id and draft hidden state. Tokens 0 and 1 of each prompt are not scored (no
draft hidden state exists for them). Reports recall@k (:func:`models.predictors.recall_at_k`)
per layer and its mean, chance level k/E, and the median wall time of one ``predict`` call.

Draft hidden states come from the EAGLE-3 head (``--head``; default: the ``eagle3`` directory
beside the model when it exists). Without a head the probe is trained and measured on the target's
own aux hidden state of the previous token, a *stand-in* labelled ``target-aux`` (optimistic: at
draft time the target has not run that token yet).

Usage::

    python -m specfit.eval.predictors --model models/proxy/target --train-prompts 120 --eval-prompts 60
    python -m specfit.eval.predictors --synthetic tiny --train-prompts 8 --eval-prompts 4   # random weights

Writes ``--out`` (JSON, atomically) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from specfit.models.predictors import get_predictor, recall_at_k
from specfit.models.traces import RoutingTrace, record_prompt
from specfit.core.errors import SpecFitInputError
from specfit.core.readers import read_json
from specfit.core.io import atomic_write_text, dumps
from specfit.eval.machine import command_line

#: Predictors reported: label → (registry name, options, online). ``online`` False: never observes.
VARIANTS = {
    "global (static)": ("recency", {}, False),
    "recency W=8": ("recency", {"window": 8}, True),
    "recency W=32": ("recency", {"window": 32}, True),
    "frequency (β=0)": ("frequency", {"recency_weight": 0.0}, True),
    "frequency + recency β=0.5 (default)": ("frequency", {}, True),
    "frequency + recency β=2": ("frequency", {"recency_weight": 2.0}, True),
    "probe": ("probe", {}, True),
    "probe + frequency w=2": ("probe", {"frequency_weight": 2.0}, True),
    "probe + frequency w=4": ("probe", {"frequency_weight": 4.0}, True),
}
#: Leading tokens of each prompt that are not scored.
SKIP = 2


def _chunks(text: str, size: int, count: int) -> list[str]:
    step = max(1, (len(text) - size) // max(count, 1))
    return [text[i:i + size] for i in range(0, max(len(text) - size, 1), step)][:count]


def prompt_texts(n_train: int, n_eval: int, data_dir=None) -> tuple[list[str], list[str]]:
    """Training and held-out prompt texts, interleaved across sources (deterministic).

    Training: GSM8K train problems, CNN/DM training articles, 2,000-character corpus chunks.
    Held out: GSM8K test problems and the reserved CNN/DM articles (never trained on by the proxy
    models either, see :mod:`models.proxy.data`).
    """
    from specfit.models.proxy import data

    kw = {} if data_dir is None else {"data_dir": Path(data_dir)}
    src = data.training_sources(**kw)
    per_doc = max(1, n_train // max(len(src["corpus"]), 1) + 1)
    corpus = [c for doc in src["corpus"] for c in _chunks(doc, 2000, per_doc)]
    train = _interleave([src["gsm8k"], src["cnn"], corpus], n_train)
    held = data.held_out_sources(**kw)
    return train, _interleave([held["gsm8k_test"], held["cnn_held_out"]], n_eval)


def _interleave(lists: list[list[str]], n: int) -> list[str]:
    out = [x for group in zip(*lists) for x in group][:n]
    if len(out) < n:
        raise SpecFitInputError("prompts", f"the data holds only {len(out)} interleaved prompts, asked for {n}")
    return out


def encode(texts: list[str], model_dir: Path, vocab_size: int, max_tokens: int) -> list[np.ndarray]:
    """Token ids of each text, cut to ``max_tokens``: the model's tokenizer, or UTF-8 bytes mod V."""
    from specfit.models.qwen3_moe.generate import load_tokenizer

    tok = load_tokenizer(model_dir)
    if tok is None:
        return [np.frombuffer(t.encode(), np.uint8)[:max_tokens].astype(np.int64) % vocab_size for t in texts]
    return [np.asarray(tok(t)["input_ids"][:max_tokens], np.int64) for t in texts]


def record(model, prompts: list[np.ndarray], head=None) -> RoutingTrace:
    """One routing trace over ``prompts`` (see :func:`models.traces.record_prompt`)."""
    trace = None
    for ids in prompts:
        if len(ids) > SKIP:
            trace = record_prompt(model, ids, trace, head=head, hidden_source=None if head else "target-aux")
    if trace is None:
        raise SpecFitInputError("prompts", f"need at least one prompt longer than {SKIP} tokens")
    return trace


def replay(predictor, trace: RoutingTrace, online: bool = True, depth: int = 1) -> tuple[np.ndarray, list[float]]:
    """Replay held-out prompts token by token (module docstring) and return recall@k and timings.

    Token j is predicted as a draft node at ``depth`` below the cycle's root ``x[j - depth]``: the
    predictor has observed the routing of tokens ``< j - depth`` (the root's own routing is known
    only after the verify), and is given token j's id and draft hidden state.

    Returns
    -------
    tuple
        (recall (L,) float64 over all scored tokens, list of ``predict`` wall times in µs).
    """
    preds, trues, times = [], [], []
    for tokens, routing, hidden in trace.prompts():
        predictor.reset()
        seen = 0
        for j in range(SKIP, len(tokens)):
            if online and j - depth > seen:
                predictor.observe(tokens[seen:j - depth], routing[seen:j - depth], None)
                seen = j - depth
            t0 = time.perf_counter()
            p = predictor.predict(tokens[j:j + 1], None if hidden is None else hidden[j:j + 1])
            times.append((time.perf_counter() - t0) * 1e6)
            preds.append(p)
            trues.append(routing[j:j + 1])
    return recall_at_k(np.concatenate(preds), np.concatenate(trues)), times


def run(model_dir: Path, *, head_dir: Path | None, n_train: int, n_eval: int, max_tokens: int, data_dir=None,
        device: str = "cpu", probe_epochs: int = 40, depth: int = 1, save_traces: Path | None = None) -> dict:
    """Record traces, build every predictor of :data:`VARIANTS`, measure them; returns the report.

    ``save_traces``: a folder that receives ``build.npz`` and ``held_out.npz``
    (:meth:`models.traces.RoutingTrace.save`) for reuse, e.g. ``get_predictor("frequency",
    trace=RoutingTrace.load(".../build.npz"))`` in the engine."""
    from specfit.models.eagle3 import Eagle3Config, check_target, default_aux_layer_ids, load_eagle3
    from specfit.models.qwen3_moe import OffloadedQwen3Moe

    cfg = read_json(Path(model_dir) / "config.json")
    if head_dir is not None:
        head_cfg = Eagle3Config.from_dict(read_json(Path(head_dir) / "config.json"))
        aux_layers = check_target(head_cfg, cfg)
    else:
        aux_layers = default_aux_layer_ids(cfg["num_hidden_layers"])
    model = OffloadedQwen3Moe.from_pretrained(model_dir, device=device, cache_slots="all", max_len=max_tokens + 8,
                                              aux_layers=aux_layers)
    head = None
    if head_dir is not None:
        head = load_eagle3(head_dir, cfg, embed_weight=model.embed_weight.float().cpu(), device=device)
    train_txt, eval_txt = prompt_texts(n_train, n_eval, data_dir)
    V = model.spec.vocab_size
    t0 = time.perf_counter()
    train = record(model, encode(train_txt, model_dir, V, max_tokens), head)
    held = record(model, encode(eval_txt, model_dir, V, max_tokens), head)
    record_s = time.perf_counter() - t0
    if save_traces is not None:
        Path(save_traces).mkdir(parents=True, exist_ok=True)
        train.save(Path(save_traces) / "build.npz")
        held.save(Path(save_traces) / "held_out.npz")
    E, k = train.num_experts, train.top_k
    rows = {}
    for label, (name, options, online) in VARIANTS.items():
        t0 = time.perf_counter()
        extra = {"epochs": probe_epochs, "device": device} if name == "probe" else {}
        predictor = get_predictor(name, trace=train, **options, **extra)
        build_s = time.perf_counter() - t0
        recall, times = replay(predictor, held, online, depth)
        rows[label] = {"predictor": name, "options": options, "online": online, "recall_per_layer": recall.tolist(),
                       "recall_mean": float(recall.mean()), "predict_us_median": statistics.median(times),
                       "build_s": build_s}
    from specfit.eval.machine import machine

    return {"model": str(model_dir), "head": str(head_dir) if head_dir else None,
            "hidden_source": train.hidden_source, "num_layers": train.num_layers, "num_experts": E, "top_k": k,
            "chance_recall": k / E, "train_prompts": train.num_prompts, "eval_prompts": held.num_prompts,
            "train_tokens": len(train), "eval_tokens_scored": len(held) - SKIP * held.num_prompts,
            "max_tokens": max_tokens, "depth": depth, "record_s": record_s, "predictors": rows, "machine": machine(device=device),
            "protocol": f"held-out prompts replayed token by token: token j predicted as a depth-{depth} draft node "
                        f"(routing of tokens < j - {depth} observed; probe input = teacher-forced depth-1 hidden state)"}


def markdown(report: dict) -> str:
    """Markdown table: one row per predictor, mean recall@k and per-layer recall (8 layers at most)."""
    L = report["num_layers"]
    layers = list(range(L)) if L <= 8 else sorted({round(i * (L - 1) / 7) for i in range(8)})
    head = "| predictor | mean | " + " | ".join(f"L{l}" for l in layers) + " | predict µs (median) |"
    lines = [f"recall@{report['top_k']} of {report['num_experts']} experts, depth-{report['depth']} nodes; "
             f"chance = {report['chance_recall']:.3f}; "
             f"probe input: {report['hidden_source']}; {report['train_prompts']} build prompts "
             f"({report['train_tokens']} tokens), {report['eval_prompts']} held-out prompts "
             f"({report['eval_tokens_scored']} scored tokens)", "", head,
             "|---|---:|" + "---:|" * len(layers) + "---:|"]
    for label, r in report["predictors"].items():
        per = " | ".join(f"{r['recall_per_layer'][l]:.3f}" for l in layers)
        lines.append(f"| {label} | {r['recall_mean']:.3f} | {per} | {r['predict_us_median']:.0f} |")
    return "\n".join(lines)


def write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` as JSON atomically (temporary file in the same folder, then rename), creating
    the folder if needed."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, dumps(obj, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m specfit.eval.predictors", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="Qwen3-MoE checkpoint directory (the target)")
    src.add_argument("--synthetic", choices=["tiny", "small"], help="random-weight checkpoint (eval.runtime_bench)")
    ap.add_argument("--head", type=Path, default=None, help="EAGLE-3 head directory (default: <model>/../eagle3 if present)")
    ap.add_argument("--no-head", action="store_true", help="use the target-aux stand-in even if a head exists")
    ap.add_argument("--train-prompts", type=int, default=120)
    ap.add_argument("--eval-prompts", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--probe-epochs", type=int, default=40)
    ap.add_argument("--depth", type=int, default=1, help="draft depth of the scored nodes (context lag)")
    ap.add_argument("--data-dir", type=Path, default=None, help="data copy (default: the repo's data/proxy)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=Path("runs/predictors.json"),
                    help="JSON report (default runs/predictors.json)")
    ap.add_argument("--save-traces", type=Path, default=None, help="folder for build.npz and held_out.npz")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in ("train_prompts", "eval_prompts", "max_tokens", "probe_epochs", "depth"):
        if getattr(args, name) < 1:
            raise SpecFitInputError(f"--{name.replace('_', '-')}", "must be a positive integer")
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic:
            from specfit.eval.runtime_bench import write_synthetic_checkpoint

            model_dir = write_synthetic_checkpoint(Path(tmp) / args.synthetic, args.synthetic, dtype=torch.float32)
        else:
            model_dir = args.model
        head_dir = args.head
        if head_dir is None and not args.no_head and args.model and (args.model.parent / "eagle3" / "config.json").is_file():
            head_dir = args.model.parent / "eagle3"
        report = run(model_dir, head_dir=None if args.no_head else head_dir, n_train=args.train_prompts,
                     n_eval=args.eval_prompts, max_tokens=args.max_tokens, data_dir=args.data_dir,
                     device=args.device, probe_epochs=args.probe_epochs, depth=args.depth,
                     save_traces=args.save_traces)
    report["model"] = str(args.model) if args.model else f"synthetic:{args.synthetic} (random weights)"
    report["command"] = command_line("specfit.eval.predictors", argv)
    write_json(args.out, report)
    print(markdown(report))
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SpecFitInputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
