"""The crossover of a cache-size sweep (``specfit eval --cache-slots 16,32,64,96,all``): one table and
one plot of modeled tokens/s against the cached fraction of each layer's experts.

Where speculation pays depends on the expert cache: with few slots a verify's expert union costs
H2D transfers that a plain AR step does not pay; with every expert cached only compute is left and
the draft tree's τ wins (SPECFIT.md §2). The sweep shows where each method crosses the others, and
:func:`sweep_summary` says it in words.
"""

from __future__ import annotations

from pathlib import Path

from specfit.core.io import atomic_write_text, dumps

#: The baselines specfit is compared with: the best of these per dataset and cache size (``ar+lookahead``:
#: AR decoding with the head's lookahead for the expert cache, run under ``--eviction lookahead``).
BASELINES = ("ar", "ar+lookahead", "eagle3", "eagle3-scan")

#: Table columns: header, row key, format.
COLUMNS = (("dataset", "dataset", "s"), ("slots", "cache_slots", "d"), ("cached", "cached_fraction", ".2f"),
           ("method", "method", "s"), ("tok/s modeled", "modeled_tokens_per_s", ".1f"),
           ("× ar", "speedup_vs_ar", ".3f"), ("× eagle3", "speedup_vs_eagle3", ".3f"),
           ("× best baseline", "vs_best_baseline", ".3f"), ("× oracle", "vs_oracle", ".3f"), ("τ", "tau", ".2f"),
           ("hit rate", "cache_hit_rate", ".3f"), ("experts/token", "experts_per_token", ".1f"),
           ("AR-step share", "ar_share", ".0%"), ("host share", "host_share", ".1%"),
           ("solve + predict share", "solve_predict_share", ".1%"))


def crossover_rows(summaries: list[tuple[int, list]], num_experts: int) -> list[dict]:
    """Flatten the summary rows of each cache size into crossover rows.

    Parameters
    ----------
    summaries : list of (int, list)
        ``(cache slots per layer, summary rows of that run)``; a row is a
        :class:`specfit.eval.records.SummaryRow` or a dict with its fields.
    num_experts : int
        Experts per MoE layer E (cached fraction = slots / E).

    Returns
    -------
    list of dict
        One per dataset × cache size × method, ordered so: ``dataset, cache_slots,
        cached_fraction, method, modeled_tokens_per_s, speedup_vs_ar, speedup_vs_eagle3,
        vs_best_baseline`` (modeled tokens/s over the best of :data:`BASELINES` in the same run,
        None without one), ``vs_oracle`` (over ``oracle``'s in the same run, None without),
        ``tau, cache_hit_rate, experts_per_token`` (H2D transfers per committed token), ``ar_share``
        (cycles the AR gate took as AR steps; None for methods without the gate), ``host_share``
        (the host part of the modeled time) and ``solve_predict_share`` (the solver's and the expert
        predictor's wall ms over the modeled time; None in summaries written before it), ``tokens_per_s``
        (wall-clock, this machine) and ``equal_to_ar``.
    """
    out = []
    for slots, rows in summaries:
        rows = [r if isinstance(r, dict) else r.to_json() for r in rows]
        for r in rows:
            base = [b["modeled_tokens_per_s"] for b in rows
                    if b["dataset"] == r["dataset"] and b["method"] in BASELINES and b["modeled_tokens_per_s"]]
            oracle = [b["modeled_tokens_per_s"] for b in rows
                      if b["dataset"] == r["dataset"] and b["method"] == "oracle" and b["modeled_tokens_per_s"]]
            out.append({"dataset": r["dataset"], "cache_slots": int(slots), "cached_fraction": slots / num_experts,
                        "method": r["method"], "modeled_tokens_per_s": r["modeled_tokens_per_s"],
                        "speedup_vs_ar": r.get("speedup_vs_ar"), "speedup_vs_eagle3": r.get("speedup_vs_eagle3"),
                        "vs_best_baseline": r["modeled_tokens_per_s"] / max(base) if base else None,
                        "vs_oracle": r["modeled_tokens_per_s"] / oracle[0] if oracle else None,
                        "tau": r["tau"], "cache_hit_rate": r["cache_hit_rate"],
                        "experts_per_token": r["experts_per_token"], "ar_share": r.get("ar_share"),
                        "host_share": r.get("host_share", (r.get("modeled_share") or {}).get("host_ms")),
                        "solve_predict_share": r.get("solve_predict_share"),
                        "tokens_per_s": r.get("tokens_per_s"), "equal_to_ar": r.get("equal_to_ar")})
    sets = list(dict.fromkeys(r["dataset"] for r in out))
    return sorted(out, key=lambda r: (sets.index(r["dataset"]), r["cache_slots"]))


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def crossover_markdown(rows: list[dict], note: str = "") -> str:
    """The crossover table (Markdown), one line per dataset × cache size × method, then ``note``."""
    lines = ["# specfit eval: cache-size sweep (modeled)", "",
             "| " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join("all" if k == "cache_slots" and r["cached_fraction"] >= 1 else _fmt(r[k], f)
                                for _, k, f in COLUMNS) + " |" for r in rows]
    lines += ["", "tok/s modeled and the ratios are modeled on the run's hardware profile (each cache size's "
              "summary.md says how); × best baseline: over the best of " + ", ".join(BASELINES) +
              " present in the same run; × oracle: over oracle in the same run (same calibrated objective, "
              "true routing instead of predicted experts); experts/token: uncached experts per committed token "
              "(copied H2D, or computed on the host under --offload host/auto); AR-step share: cycles the AR gate took as plain AR steps; host share: predictor, solver "
              "and bookkeeping CPU time over the modeled time; solve + predict share: the solver's and the expert "
              "predictor's wall ms alone over the modeled time.", note, ""]
    return "\n".join(lines)


#: Columns the sweep prints (the full table is ``sweep.md``'s :data:`COLUMNS`).
PRINTED_COLUMNS = (("dataset", "dataset", "s"), ("slots", "cache_slots", "d"), ("method", "method", "s"),
                   ("τ", "tau", ".2f"), ("tok/s modeled", "modeled_tokens_per_s", ".1f"),
                   ("tok/s wall", "tokens_per_s", ".1f"), ("× ar", "speedup_vs_ar", ".3f"),
                   ("× eagle3", "speedup_vs_eagle3", ".3f"), ("experts/token", "experts_per_token", ".1f"),
                   ("AR-step share", "ar_share", ".0%"), ("= ar", "equal_to_ar", "s"))


def printed_markdown(rows: list[dict]) -> str:
    """The sweep table ``specfit eval`` prints: :data:`PRINTED_COLUMNS` of :func:`crossover_rows`."""
    def cell(r, k, f):
        if k == "cache_slots" and r["cached_fraction"] >= 1:
            return "all"
        if k == "equal_to_ar" and r.get(k) is not None:
            return "yes" if r[k] else "NO"
        return _fmt(r.get(k), f)

    lines = ["| " + " | ".join(h for h, _, _ in PRINTED_COLUMNS) + " |", "|" + "---|" * len(PRINTED_COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cell(r, k, f) for _, k, f in PRINTED_COLUMNS) + " |" for r in rows])


#: specfit "wins" a cell when it is at least this much faster than the best baseline (modeled).
WIN_MARGIN = 1.01


def _slots(r: dict) -> str:
    return "all" if r["cached_fraction"] >= 1 else str(r["cache_slots"])


def sweep_summary(rows: list[dict]) -> str:
    """What a sweep shows, in words computed from its rows: per dataset, the cache sizes where
    specfit beats the best baseline (:data:`BASELINES`) by at least :data:`WIN_MARGIN` and by how
    much, and the sizes where its AR gate took most cycles as AR steps, with why (what a method that
    always drafts, ``eagle3``, pays there in expert transfers against ``ar``). All modeled.

    Returns
    -------
    str
        A few lines of text; empty without ``specfit`` rows.
    """
    out = []
    for d in dict.fromkeys(r["dataset"] for r in rows):
        cells = {}
        for r in rows:
            if r["dataset"] == d:
                cells.setdefault(r["cache_slots"], {})[r["method"]] = r
        wins, ar_steps = [], []
        for by in cells.values():
            sf = by.get("specfit")
            base = {m: by[m] for m in BASELINES if m in by and by[m]["modeled_tokens_per_s"]}
            if sf is None or not base:
                continue
            best = max(base, key=lambda m: base[m]["modeled_tokens_per_s"])
            ratio = sf["modeled_tokens_per_s"] / base[best]["modeled_tokens_per_s"]
            if ratio >= WIN_MARGIN:
                wins.append(f"{_slots(sf)} slots: {ratio:.2f} × {best} ({sf['modeled_tokens_per_s']:.1f} against "
                            f"{base[best]['modeled_tokens_per_s']:.1f} tok/s, τ {sf['tau']:.2f})")
            if (sf.get("ar_share") or 0) >= 0.5:
                why = ""
                e, a = by.get("eagle3"), by.get("ar")
                if e and a and e.get("speedup_vs_ar") and a["experts_per_token"] == e["experts_per_token"] == 0:
                    why = (f": drafting does not pay there, eagle3 runs at {e['speedup_vs_ar']:.2f} × ar, every expert "
                           "resident: a verify reads the weights of every expert its tokens route to")
                elif e and a and e.get("speedup_vs_ar"):
                    why = (f": drafting does not pay there, eagle3 runs at {e['speedup_vs_ar']:.2f} × ar, copying "
                           f"{e['experts_per_token']:.1f} experts per token against ar's {a['experts_per_token']:.1f}")
                la = by.get("ar+lookahead")  # its AR steps' gain is the lookahead cache's: say so beside it
                la = f", ar+lookahead {la['speedup_vs_ar']:.3f} × ar" if la and la.get("speedup_vs_ar") else ""
                ar_steps.append(f"{_slots(sf)} slots ({sf['ar_share']:.0%} of cycles, {sf.get('speedup_vs_ar') or 0:.3f} "
                                f"× ar{la}{why})")
        present = [m for m in BASELINES if any(m in by for by in cells.values())]
        if not any("specfit" in by for by in cells.values()) or not present:
            continue
        text = f"{d}: " + (("specfit wins at " + "; ".join(wins) + ".") if wins else
                           f"specfit does not beat the best of {', '.join(present)} by {WIN_MARGIN - 1:.0%} "
                           "at any size.")
        if ar_steps:
            text += " It takes AR steps in most cycles at " + "; ".join(ar_steps) + "."
        out.append(text)
    return "\n".join(out)


def plot_crossover(rows: list[dict], path: Path) -> Path:
    """Modeled tokens/s against the cached fraction of experts: a line per method, a panel per dataset.

    Parameters
    ----------
    rows : list of dict
        :func:`crossover_rows`.
    path : Path
        The PNG to write (atomically).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specfit.eval.report import save_figure

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, max(len(datasets), 1), figsize=(5 * max(len(datasets), 1), 4), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        for i, m in enumerate(methods):
            pts = sorted((r["cached_fraction"], r["modeled_tokens_per_s"]) for r in rows
                         if r["dataset"] == d and r["method"] == m)
            if pts:  # own line style, hollow markers shrinking per method: lines on one another stay visible
                ax.plot(*zip(*pts), marker="osD^vP*X"[i % 8], color=plt.cm.tab10(i % 10), label=m,
                        ls=("-", "--", ":", "-.")[i % 4], mfc="none", mew=1.5, ms=max(11 - 2.5 * i, 4))
        ax.set(xlabel="cached fraction of each layer's experts", ylabel="tokens/s (modeled)", title=d, xlim=(0, 1.05))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)
    return path


def write_crossover(out: str | Path, rows: list[dict], meta: dict) -> tuple[str, dict]:
    """Write ``OUT/sweep.json``, ``OUT/sweep.md`` and ``OUT/crossover.png``.

    Parameters
    ----------
    out : path
        The sweep folder.
    rows : list of dict
        :func:`crossover_rows`.
    meta : dict
        Settings of the sweep (recorded in ``sweep.json``; ``note`` is appended to the table).

    Returns
    -------
    tuple
        (Markdown text, ``{"sweep_json", "sweep_md", "crossover_png"}`` paths).
    """
    out = Path(out)
    text = crossover_markdown(rows, meta.get("note", ""))
    paths = {"sweep_json": out / "sweep.json", "sweep_md": out / "sweep.md", "crossover_png": out / "crossover.png"}
    atomic_write_text(paths["sweep_json"], dumps({"rows": rows, **meta}, indent=1) + "\n")
    atomic_write_text(paths["sweep_md"], text)
    plot_crossover(rows, paths["crossover_png"])
    return text, paths
