"""A cache-size sweep: the evaluation once per expert-cache size, then the crossover table and plot.

``specfit eval --cache-slots 16,32,64,96,all --out OUT`` (or ``specfit.evaluate(cache_slots=[16, 32,
"all"])``) runs :func:`specfit.eval.run.run_eval` with ``OUT/slots-<S>`` as the output folder of cache
size S, so each size resumes like a single run (its ``results.jsonl`` keeps what was done; an
interrupted sweep reruns to where it stopped), then writes ``OUT/sweep.md``, ``OUT/sweep.json`` and
``OUT/crossover.png`` (:mod:`specfit.eval.crossover`).
"""

from __future__ import annotations

import numbers
from dataclasses import replace
from pathlib import Path

from specfit.core.errors import SpecFitInputError


def parse_cache_slots(value) -> list[int | str] | None:
    """The cache sizes of a sweep, or None for a single run.

    Parameters
    ----------
    value : int, str or sequence
        A single size (``32``, ``"32"``, ``"all"``: None, a single run); a comma-separated string
        (``"16,32,all"``) or a sequence (``[16, 32, "all"]``): a sweep.

    Returns
    -------
    list of (int or "all") or None
        The sizes in the given order; range checks against the model's expert count come later
        (:func:`specfit.models.experts.check_cache_args`).

    Raises
    ------
    SpecFitInputError
        Field ``cache_slots``: a value that is none of those (e.g. ``16.0``), an empty list, an empty
        entry (``"16,,32"``), an entry that is neither a non-negative integer nor ``all``, or a size
        named twice.
    """
    if isinstance(value, str) and "," not in value or isinstance(value, numbers.Integral):
        return None  # one run: its checks come later
    if not isinstance(value, (str, list, tuple)):
        raise SpecFitInputError("cache_slots", f"must be an integer >= 0, 'all', a comma-separated string or a "
                                               f"list of those, got {value!r}")
    items = value.split(",") if isinstance(value, str) else list(value)
    if not items:
        raise SpecFitInputError("cache_slots", "name at least one cache size")
    sizes: list[int | str] = []
    for i, item in enumerate(items, 1):
        text = item.strip() if isinstance(item, str) else item
        if text == "":
            raise SpecFitInputError("cache_slots", f"entry {i} of {value!r} is empty")
        if isinstance(text, str) and text.isdigit():
            text = int(text)
        if not (text == "all" or isinstance(text, numbers.Integral) and not isinstance(text, bool) and text >= 0):
            raise SpecFitInputError("cache_slots", f"entry {i} of {value!r} must be an integer >= 0 or 'all', got {item!r}")
        sizes.append(text if text == "all" else int(text))
    if len(set(sizes)) != len(sizes):
        raise SpecFitInputError("cache_slots", f"{value!r} names a cache size twice")
    return sizes


def run_sweep(config, sizes: list[int | str], progress: bool = False) -> dict:
    """Run the evaluation once per cache size and write the crossover table and plot.

    Parameters
    ----------
    config : EvalConfig
        Settings of every run; ``out`` is the sweep folder (None:
        :func:`specfit.eval.run.default_out` with ``sweep=True``).
    sizes : list of int or "all"
        :func:`parse_cache_slots`.
    progress : bool
        Show a progress bar per run.

    Returns
    -------
    dict
        ``{"rows": crossover rows, "markdown": sweep table (sweep.md), "table": the shorter table
        ``specfit eval`` prints with :func:`specfit.eval.crossover.sweep_summary` and the plot's path,
        "paths": {name: Path}, "ran": int,
        "skipped": int}`` (generations run and resumed over all sizes).

    Raises
    ------
    SpecFitInputError
        A bad setting of any run (every size is checked before the first one runs), or two sizes
        that are the same number of slots (``128`` and ``all`` on a 128-expert model).
    """
    from specfit.eval.crossover import crossover_rows, printed_markdown, sweep_summary, write_crossover
    from specfit.eval.run import default_out, plan, run_eval

    from specfit.models.qwen3_moe import read_spec

    named = default_out(config, sweep=True)
    given = config.out is not None
    if not given:
        config = replace(config, out=named)
    out = Path(config.out)
    if (out / "config.json").is_file() or (out / "results.jsonl").is_file():
        raise SpecFitInputError("out", f"{out} holds the results of one cache size: name another folder for a "
                                       f"sweep, or run one --cache-slots value there")
    configs = [replace(config, cache_slots=s, out=str(out / f"slots-{s}")) for s in sizes]
    # bad settings, or an out folder of other settings, fail before any run; the error names the sweep's folder
    plans = []
    for i, c in enumerate(configs, 1):
        try:
            plans.append(plan(c, named=named if given else c.out))
        except SpecFitInputError as err:
            if err.field != "cache_slots":
                raise
            rule = err.rule.replace(f"got {c.cache_slots!r}", f"got '{c.cache_slots}'")
            raise SpecFitInputError("cache_slots", f"entry {i} of '{value_text(sizes)}': {rule}") from None
    resolved = [p.config.cache_slots for p in plans]
    if len(set(resolved)) != len(resolved):
        raise SpecFitInputError("cache_slots", f"{value_text(sizes)} names the same cache size twice "
                                f"({', '.join(map(str, resolved))} slots)")
    summaries, ran, skipped, runs = [], 0, 0, {}
    for c, slots in zip(configs, resolved):
        res = run_eval(c, progress=progress)
        summaries.append((slots, res["rows"]))
        ran, skipped = ran + res["ran"], skipped + res["skipped"]
        runs[f"slots_{c.cache_slots}"] = Path(c.out)
    num_experts = read_spec(plans[0].target_dir).num_experts
    rows = crossover_rows(summaries, num_experts)
    meta = {"config": {**config.to_json(), "cache_slots": resolved}, "num_experts": num_experts,
            "runs": {k: str(v) for k, v in runs.items()},
            "note": f"Each cache size's full summary: {out}/slots-<S>/summary.md."}
    text, written = write_crossover(out, rows, meta)
    table = (f"{printed_markdown(rows)}\n\nModeled tok/s on {config.profile if config.offload == 'transfer' else config.host_profile}; tok/s wall: this machine.\n"
             f"{sweep_summary(rows)}\nCrossover plot: {written['crossover_png']}; every column: {written['sweep_md']}\n")
    return {"rows": rows, "markdown": text, "table": table, "paths": written, "ran": ran, "skipped": skipped}


def value_text(sizes) -> str:
    """Cache sizes as typed on the command line (``16,32,all``)."""
    return ",".join(map(str, sizes))
