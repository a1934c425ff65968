"""Summary of an evaluation run: rows per dataset × method, ``summary.json``, ``summary.md``, plots.

Every file is written to a temporary file in the same folder, fsync'ed and renamed, so a folder
never holds half a report. Modeled numbers (:mod:`eval.modeled`) are labelled "modeled"; wall-clock
numbers are this machine's.
"""

from __future__ import annotations

import datetime as _dt
import platform
from pathlib import Path
from statistics import median

from specfit.core.io import atomic_write, atomic_write_text, dumps
from specfit.eval import metrics
from specfit.core.readers import read_json
from specfit.eval.machine import machine
from specfit.eval.modeled import MODELED_PARTS, cost_scaling_note
from specfit.eval.records import ResultRecord, SummaryRow
from specfit.engine import get_method

#: Columns of ``summary.md``: (header, row key, format).
COLUMNS = (
    ("dataset", "dataset", "s"), ("method", "method", "s"), ("prompts", "prompts", "d"), ("τ", "tau", ".2f"),
    ("tok/s wall", "tokens_per_s", ".1f"), ("tok/s modeled", "modeled_tokens_per_s", ".1f"),
    ("× ar (modeled)", "speedup_vs_ar", ".3f"), ("× eagle3 (modeled)", "speedup_vs_eagle3", ".3f"),
    ("experts/token", "experts_per_token", ".1f"), ("hit rate", "cache_hit_rate", ".3f"),
    ("nodes/cycle", "mean_nodes_verified", ".1f"), ("host share", "host_share", ".1%"),
    ("solve + predict share", "solve_predict_share", ".1%"),
    ("host ms/tok (priced)", "host_ms_per_token", ".3f"), ("host ms/tok (this CPU)", "host_thread_ms_per_token", ".3f"),
    ("= ar", "equal_to_ar", "s"), ("task", "task_metric", "s"),
    ("A pred (calibrated)", "predicted_tau", ".2f"), ("A pred (raw P)", "predicted_tau_raw", ".2f"),
    ("AR-step share", "ar_share", ".0%"),
)

#: Columns ``specfit eval`` prints: what a reader compares (the full table is ``summary.md``'s).
PRINTED_COLUMNS = (
    ("dataset", "dataset", "s"), ("method", "method", "s"), ("τ", "tau", ".2f"),
    ("tok/s modeled", "modeled_tokens_per_s", ".1f"), ("tok/s wall", "tokens_per_s", ".1f"),
    ("× ar", "speedup_vs_ar", ".3f"), ("× eagle3", "speedup_vs_eagle3", ".3f"),
    ("experts/token", "experts_per_token", ".1f"), ("host ms/tok priced", "host_ms_per_token", ".3f"),
    ("host ms/tok this CPU", "host_thread_ms_per_token", ".3f"), ("= ar", "equal_to_ar", "s"),
)


def printed_table(rows: list[SummaryRow], summary_md: Path) -> str:
    """The table ``specfit eval`` prints (:data:`PRINTED_COLUMNS`), a line saying which numbers are
    modeled, and the path of the full table (``summary_md``)."""
    lines = ["| " + " | ".join(h for h, _, _ in PRINTED_COLUMNS) + " |", "|" + "---|" * len(PRINTED_COLUMNS)]
    lines += ["| " + " | ".join(_fmt(getattr(r, k), f) for _, k, f in PRINTED_COLUMNS) + " |" for r in rows]
    lines += ["", "tok/s modeled and the × columns: the measured cycles priced on the hardware profile (modeled); "
              "tok/s wall: this machine; τ: committed tokens per cycle; experts/token: uncached experts per "
              "committed token; host ms/tok: the engine's host work per committed token (hidden parts included), "
              "as the run's clock priced it (counted or measured) and as this machine's CPU measured it; = ar: greedy output equals ar's. "
              f"Every column: {summary_md}", ""]
    return "\n".join(lines)


def versions() -> dict:
    """Versions of python, torch, transformers, numpy and specfit."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("specfit", "torch", "transformers", "numpy", "rouge-score"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _task_metric(recs: list[dict]) -> tuple[dict, str]:
    """Mean GSM8K accuracy and ROUGE F1 over the records that have them (Spec-Bench mixes both)."""
    scores = [r.score for r in recs if r.score]
    acc = [s["correct"] for s in scores if "correct" in s]
    rouge = [s for s in scores if "rougeL" in s]
    out, text = {}, []
    if acc:
        out["accuracy"] = sum(acc) / len(acc)
        text.append(f"acc {out['accuracy']:.3f}")
    if rouge:
        out.update({k: sum(s[k] for s in rouge) / len(rouge) for k in ("rouge1", "rouge2", "rougeL")})
        text.append(f"R-L {out['rougeL']:.3f}")
    return out, ", ".join(text) or "-"


#: Methods whose modeled tokens/s every row is compared with (columns ``speedup_vs_<method>``).
SPEEDUP_BASELINES = ("ar", "eagle3")


def summarise(records: list[ResultRecord], depth: int, temperature: float) -> list[SummaryRow]:
    """One row per (dataset, method), in first-seen order.

    Parameters
    ----------
    records : list of ResultRecord
        Result lines (:meth:`ResultRecord.from_generation`), each prompt × method at most once.
    depth : int
        Deepest tree position of ``acceptance_by_depth``.
    temperature : float
        ``equal_to_ar`` is computed at temperature 0 only (None otherwise).

    Returns
    -------
    list of SummaryRow
        ``equal_to_ar`` compares the outputs of each method that runs the draft head (a tree, or
        ``ar+lookahead``'s chain) with those of the method that runs none (``ar``); ``predicted_vs_transferred`` is set for the methods with an expert
        predictor (``Method.needs_predictor``); ``speedup_vs_<m>`` for :data:`SPEEDUP_BASELINES`.
    """
    groups: dict[tuple[str, str], list[ResultRecord]] = {}
    for r in records:
        groups.setdefault((r.dataset, r.method), []).append(r)
    ar_out = {(r.dataset, r.id): r.output_ids for r in records if not get_method(r.method).needs_drafter}
    rows = []
    for (dataset, method), recs in groups.items():
        new = sum(r.new_tokens for r in recs)
        committed = sum(r.committed for r in recs)
        modeled_ms = sum(r.modeled_ms for r in recs)
        accept = [a for r in recs for a in r.accept_lengths]
        nodes = [n for r in recs for n in r.nodes_verified]
        solve = sum(r.measured_ms["solve"] for r in recs)
        # before the predictor's own time was split out (measured_ms without "tree"), "predict" held
        # every level's host work: such records (a run resumed from older results) leave the share unknown
        split = all("tree" in r.measured_ms for r in recs)
        predict = sum(r.measured_ms.get("predict", 0.0) for r in recs)
        wall_ms = 1000.0 * sum(r.wall_s for r in recs)
        equal, diverge = None, {}
        if temperature == 0 and get_method(method).needs_drafter and all((dataset, r.id) in ar_out for r in recs):
            for r in recs:
                pos = metrics.first_divergence(r.output_ids, ar_out[(dataset, r.id)])
                if pos is not None:
                    diverge[r.id] = pos
            equal = not diverge
        task, task_text = _task_metric(recs)
        transferred = sum(r.experts_transferred + r.experts_host_computed for r in recs)  # uncached experts
        prefetched = sum(r.experts_prefetched for r in recs)  # copies made ahead of the verify (--prefetch)
        rows.append(SummaryRow(
            dataset=dataset, method=method, prompts=len(recs), new_tokens=new,
            tau=metrics.tau(accept),
            tokens_per_s=metrics.tokens_per_s(new, wall_ms),
            tokens_per_s_median=median(metrics.tokens_per_s(r.new_tokens, 1000 * r.wall_s) for r in recs),
            modeled_tokens_per_s=metrics.tokens_per_s(new, modeled_ms),
            experts_per_token=metrics.experts_per_token(transferred + prefetched, committed),
            cache_hit_rate=metrics.cache_hit_rate(transferred, sum(r.experts_looked_up for r in recs)),
            mean_nodes_verified=sum(nodes) / len(nodes) if nodes else 0.0,
            predicted_vs_transferred=_predicted_vs_transferred(method, recs),
            solve_share=solve / modeled_ms if modeled_ms else 0.0,
            solve_share_wall=solve / wall_ms if wall_ms else 0.0,
            predict_share=(predict / modeled_ms if modeled_ms else 0.0) if split else None,
            solve_predict_share=((solve + predict) / modeled_ms if modeled_ms else 0.0) if split else None,
            modeled_share={k: sum(r.modeled[k] for r in recs) / modeled_ms if modeled_ms else 0.0
                           for k in MODELED_PARTS},
            host_share=sum(r.modeled["host_ms"] for r in recs) / modeled_ms if modeled_ms else 0.0,
            host_ms_per_token=(sum(r.modeled["host_ms"] + r.measured_ms.get("hidden_host", 0.0) for r in recs) / committed
                               if committed else None),
            host_thread_ms_per_token=(sum(r.measured_ms["host_thread"] for r in recs) / committed if committed else None)
            if all("host_thread" in r.measured_ms for r in recs) else None,
            prefetched_per_token=metrics.experts_per_token(prefetched, committed) if prefetched else None,
            prefetch_used_share=sum(r.experts_prefetch_used for r in recs) / prefetched if prefetched else None,
            equal_to_ar=equal, first_divergence=diverge,
            acceptance_by_depth=metrics.acceptance_by_depth(accept, depth),
            task=task, task_metric=task_text, **_calibration_columns(recs),
        ))
    for row in rows:
        base = {m: next((r for r in rows if r.dataset == row.dataset and r.method == m), None)
                for m in SPEEDUP_BASELINES}
        for m, b in base.items():
            setattr(row, f"speedup_vs_{m}", row.modeled_tokens_per_s / b.modeled_tokens_per_s
                    if b and b.modeled_tokens_per_s else None)
        ar = base["ar"]
        row.speedup_vs_ar_wall = row.tokens_per_s / ar.tokens_per_s if ar and ar.tokens_per_s else None
    return rows


def _calibration_columns(recs: list[ResultRecord]) -> dict:
    """``predicted_tau``, ``predicted_tau_raw`` and ``ar_share`` of a group (empty for old records)."""
    if any(r.expected_tokens is None for r in recs):
        return {}
    cycles = sum(len(r.expected_tokens) for r in recs)
    if not cycles:
        return {}
    return {"predicted_tau": sum(sum(r.expected_tokens) for r in recs) / cycles,
            "predicted_tau_raw": sum(sum(r.expected_tokens_raw) for r in recs) / cycles,
            "ar_share": sum(d in ("ar", "shadow") for r in recs for d in r.decisions) / cycles}


def reliability_plot(records: list[ResultRecord], out: Path) -> dict[str, Path]:
    """Reliability of the acceptance model: cycles binned by predicted A(S) (tokens per cycle), the
    mean committed tokens per bin against the mean prediction, calibrated (solid) and raw path
    probabilities (dashed), one panel per dataset, drafted cycles only; the diagonal is perfect
    calibration. SPECFIT.md §3, "Calibrated acceptance".

    Returns
    -------
    dict
        ``{"reliability_png": path}``, or ``{}`` when no record has per-cycle predictions.
    """
    recs = [r for r in records if r.expected_tokens is not None and get_method(r.method).drafts]
    if not recs:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    datasets = list(dict.fromkeys(r.dataset for r in recs))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        top = 1.0
        for i, method in enumerate(dict.fromkeys(r.method for r in recs if r.dataset == ds)):
            group = [r for r in recs if r.dataset == ds and r.method == method]
            done = np.array([a + 1 for r in group for a, d in zip(r.accept_lengths, r.decisions) if d == "draft"], float)
            for key, style in (("expected_tokens", "-"), ("expected_tokens_raw", "--")):
                pred = np.array([p for r in group for p, d in zip(getattr(r, key), r.decisions) if d == "draft"])
                if not pred.size:
                    continue
                edges = np.quantile(pred, np.linspace(0, 1, 7))
                b = np.clip(np.searchsorted(edges, pred, side="right") - 1, 0, 5)
                xs = [pred[b == k].mean() for k in range(6) if (b == k).any()]
                ys = [done[b == k].mean() for k in range(6) if (b == k).any()]
                ax.plot(xs, ys, style, marker="o", color=plt.cm.tab10(i % 10),
                        label=f"{method} ({'calibrated' if key == 'expected_tokens' else 'raw P'})")
                top = max(top, max(xs), max(ys))
        ax.plot([1, top], [1, top], ":", color="gray")
        ax.set(title=ds, xlabel="predicted A(S), tokens per cycle", ylabel="committed tokens per cycle (mean)")
        if ax.get_legend_handles_labels()[0]:  # no drafted cycle in this panel: nothing to label
            ax.legend(fontsize=7)
    path = out / "reliability.png"
    save_figure(fig, path)
    return {"reliability_png": path}


def _predicted_vs_transferred(method: str, recs: list[ResultRecord]) -> float | None:
    """Uncached experts the selector predicted over those really transferred (1 = exact), for the
    methods that select with predicted experts; None otherwise or for records without the count."""
    m = get_method(method)
    if not (m.needs_predictor and m.drafts) or any(r.experts_predicted_new is None for r in recs):
        return None
    moved = sum(r.experts_transferred + r.experts_host_computed for r in recs)
    return sum(r.experts_predicted_new for r in recs) / moved if moved else None


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "s":
        return {True: "yes", False: "NO"}.get(value, str(value)) if isinstance(value, bool) else str(value)
    return format(value, spec)


def markdown(rows: list[dict], meta: dict) -> str:
    """``summary.md``: the table and the settings that produced it."""
    c = meta["config"]
    head = "| " + " | ".join(h for h, _, _ in COLUMNS) + " |"
    lines = [
        "# specfit eval", "",
        f"Target `{meta['resolved']['model']}` ({meta['num_layers']} MoE layers, {meta['num_experts']} experts, "
        f"top-{meta['top_k']}); head `{meta['resolved']['draft']}`.",
        f"Tree total_tokens={c['total_tokens']} depth={c['depth']} top_k={c['top_k']}; {c['cache_slots']} expert-cache "
        f"slots per layer ({c['eviction']}, admission {c.get('admission', 'all')}; eagle3-vanilla: none); predictor {c['predictor']}; temperature "
        f"{c['temperature']}; max_new_tokens {c['max_new_tokens']}; "
        + (f"device {c['device']} ({c['dtype']}); " if c.get("dtype") else "") + (
            f"profile {c['profile']}." if c.get("offload", "transfer") == "transfer"
            else f"offload {c['offload']}, host-regime profile {c['host_profile']}."),
        "", head, "|" + "---|" * len(COLUMNS),
    ]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(getattr(r, k), f) for _, k, f in COLUMNS) + " |")
    lines += [
        "",
        f"tok/s wall: new tokens per second of the decode loop on this machine ({meta['machine']['cpu']}, "
        f"{meta['machine']['cpu_count']} CPUs; prefill excluded). tok/s modeled: the same cycles priced on "
        f"the profile (eval/modeled.py): verify = "
        + ("fixed + per_node × nodes + per_expert × transferred + read × routed (every distinct expert the verified "
           "nodes routed to, read once)" if c.get("offload", "transfer") == "transfer"
           else "the host-regime profile's per-layer time (below)")
        + ", draft = "
        f"levels × {meta['draft_level_ms']} ms, plus the host CPU ms measured for the predictor, solver and "
        f"engine bookkeeping (thread CPU time; host share; solve + predict share: the solver's and the "
        f"expert predictor's wall ms alone). τ counts the bonus token.",
        meta["cost_scaling"],
        *([meta["offload_note"]] if meta.get("offload_note") else []),
        "",
    ]
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> dict[str, Path]:
    """Three PNGs: modeled throughput vs mean nodes verified per cycle, experts transferred per
    committed token, and acceptance per tree position (fraction of cycles accepting >= d tokens).

    Returns
    -------
    dict
        ``{"throughput_png", "experts_png", "acceptance_png"}`` paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r.dataset for r in rows))
    methods = list(dict.fromkeys(r.method for r in rows))
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    markers = "osD^vP*X"
    paths = {"throughput_png": out / "throughput_vs_tree_size.png", "experts_png": out / "experts_per_token.png",
             "acceptance_png": out / "acceptance_by_depth.png"}

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in rows:  # hollow, and smaller for each later method: methods on one point (specfit as ar) stay visible
        ax.scatter(r.mean_nodes_verified, r.modeled_tokens_per_s, facecolors="none", edgecolors=[colors[r.method]],
                   linewidths=1.5, marker=markers[datasets.index(r.dataset) % len(markers)],
                   s=max(160 - 40 * methods.index(r.method), 20), label=f"{r['method']} / {r['dataset']}")
    ax.set(xlabel="mean nodes verified per cycle (root included)", ylabel="tokens/s (modeled)",
           title="Throughput vs tree size")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, paths["throughput_png"])

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        ys = [next((r.experts_per_token for r in rows if r.dataset == d and r.method == m), 0.0)
              for d in datasets]
        ax.bar([j + i * width for j in range(len(datasets))], ys, width, color=colors[m], label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(datasets))], datasets)
    ax.set(ylabel="experts transferred per committed token", title="Expert transfers (H2D) per token")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, paths["experts_png"])

    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    drafted = [m for m in methods if get_method(m).drafts]
    # methods with identical acceptance (eagle3 and eagle3-vanilla draft the same trees) would hide one
    # another: each method is shifted sideways by a fixed fraction of a depth step and has its own marker
    shift = {m: 0.3 * ((i + 0.5) / len(drafted) - 0.5) for i, m in enumerate(drafted)}
    for ax, d in zip(axes[0], datasets):
        for r in rows:
            if r.dataset == d and get_method(r.method).drafts:
                acc, m = r.acceptance_by_depth, r.method
                ax.plot([x + shift[m] for x in range(1, len(acc) + 1)], acc, color=colors[m], label=m,
                        marker=markers[drafted.index(m) % len(markers)], ls=("-", "--", ":", "-.")[drafted.index(m) % 4])
        ax.set(xlabel="tree position d (depth; methods side by side)", ylabel="cycles accepting >= d draft tokens",
               title=d, ylim=(0, 1))
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    save_figure(fig, paths["acceptance_png"])
    return paths


def save_figure(fig, path: Path) -> None:
    """Write the matplotlib figure ``fig`` to ``path`` as a PNG (110 dpi, tight layout; atomically), then close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=110))
    plt.close(fig)


#: How each generation's expert cache starts, per offload mode (the summary's ``cache``).
_CACHE_START = {"transfer": "every generation starts with an empty expert cache, warmed by its own prefill",
                "host": "every generation starts with the static hot set of the routing trace, which never changes",
                "auto": "every generation starts with the static hot set of the routing trace, then admits what it copies"}


def write_summary(out: str | Path, records: list[dict], meta: dict, prompts) -> tuple[list[dict], str, dict]:
    """Summarise ``records`` and write ``summary.json``, ``summary.md`` and the plots into ``out``.

    Parameters
    ----------
    out : path
    records : list of dict
        Result lines of this run's prompts and methods.
    meta : dict
        ``config`` (EvalConfig.to_json), ``resolved`` (directories), ``num_layers``, ``num_experts``,
        ``top_k``, ``cost`` (the scaled cost model), ``draft_level_ms``.
    prompts : list of Prompt
        This run's prompts (their count per dataset is recorded).

    Returns
    -------
    tuple
        (rows, markdown text, ``{"summary_json", "summary_md", <plot paths>}``).
    """
    out = Path(out)
    c = meta["config"]
    rows = summarise(records, c["depth"], c["temperature"])
    meta = {**meta, "versions": versions(), "machine": machine(device=c.get("device", "cpu")),
            "cost_scaling": cost_scaling_note(meta["num_layers"], c["profile"], c.get("offload", "transfer"),
                                              c.get("host_profile")),
            "cache": _CACHE_START[c.get("offload", "transfer")],
            "prompts_per_dataset": {d: sum(p.dataset == d for p in prompts) for d in dict.fromkeys(p.dataset for p in prompts)},
            "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    text = markdown(rows, meta)
    paths = {"summary_json": out / "summary.json", "summary_md": out / "summary.md"}
    atomic_write_text(paths["summary_json"], dumps({"rows": [r.to_json() for r in rows], **meta}, indent=1) + "\n")
    atomic_write_text(paths["summary_md"], text)
    paths.update(plot(rows, out))
    paths.update(reliability_plot(records, out))
    return rows, text, paths


#: SpecFit's published speedups on Qwen3-30B-A3B (SPECFIT.md §5): specfit over eagle3 with the same
#: expert cache and over vanilla EAGLE-3, per dataset.
PAPER_RATIOS = {"cnndm": {"eagle3": 1.216, "eagle3-vanilla": 1.97}, "gsm8k": {"eagle3": 1.070, "eagle3-vanilla": 1.72}}


def _ratio(rows: list[dict], dataset: str, base: str) -> float | None:
    get = {r.method: r for r in rows if r.dataset == dataset}
    if "specfit" not in get or base not in get or not get[base].modeled_tokens_per_s:
        return None
    return get["specfit"].modeled_tokens_per_s / get[base].modeled_tokens_per_s


def benchmark_markdown(run_dirs) -> str:
    """The BENCHMARKS.md section of one or more finished runs (one per profile): per run the table
    of ``summary.md`` and specfit's modeled speedups next to the paper's (:data:`PAPER_RATIOS`).

    Parameters
    ----------
    run_dirs : iterable of path
        Folders holding a ``summary.json`` written by :func:`write_summary`.

    Returns
    -------
    str
        Markdown.
    """
    parts = []
    for d in run_dirs:
        s = read_json(Path(d) / "summary.json", "run_dirs")
        s["rows"] = [SummaryRow.from_json(r, where="summary.json rows") for r in s["rows"]]
        c = s["config"]
        parts.append(f"### Profile {c['profile']} ({', '.join(f'{k}: {v}' for k, v in s['prompts_per_dataset'].items())} "
                     f"prompts, {c['max_new_tokens']} new tokens each)\n")
        parts.append(markdown(s["rows"], s).split("\n", 2)[2])
        lines = ["| dataset | specfit / eagle3 (modeled) | paper | specfit / eagle3-vanilla (modeled) | paper |",
                 "|---|---:|---:|---:|---:|"]
        for dataset in dict.fromkeys(r.dataset for r in s["rows"]):
            paper = PAPER_RATIOS.get(dataset, {})
            lines.append(f"| {dataset} | {_fmt(_ratio(s['rows'], dataset, 'eagle3'), '.3f')} | "
                         f"{_fmt(paper.get('eagle3'), '.3f')} | {_fmt(_ratio(s['rows'], dataset, 'eagle3-vanilla'), '.2f')} | "
                         f"{_fmt(paper.get('eagle3-vanilla'), '.2f')} |")
        parts.append("\n".join(lines) + "\n")
        parts.append(f"Versions: {', '.join(f'{k} {v}' for k, v in s['versions'].items())}; {s['date_utc']}.\n")
    return "\n".join(parts)


if __name__ == "__main__":
    import sys

    print(benchmark_markdown(sys.argv[1:]), end="")
