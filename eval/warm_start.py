"""Warm start on short runs: specfit from a state learned on other prompts of the same dataset.

For each profile and expert-cache size, three ``specfit eval`` runs, one after the other:

1. **learn** — ``specfit`` alone on ``--learn`` *other* GSM8K test prompts (file order ``--learn-from``
   onwards, written with the ``gsm8k`` template to ``OUT/gsm8k-other.jsonl``); its ``learned.json``
   is the warm start;
2. **cold** — ``specfit`` alone on the first ``--limit`` GSM8K test prompts, learning from nothing;
3. **warm** — ``ar``, ``eagle3``, ``eagle3-scan`` and ``specfit`` on the same prompts, specfit started
   from step 1's file (``--warm-start``; the fixed-tree methods learn nothing, so they run here once).

It prints one markdown table row per cell: the modeled tok/s of each method (the warm run's
baselines), specfit's cold and warm tok/s and τ, and both over the best of ar, eagle3 and eagle3-scan,
and specfit's warm decisions. Usage (defaults: 16, 32, 96 and all slots on both profiles)::

    python -m specfit.eval.warm_start --out runs/warm [--profiles P,...] [--slots 16,32,96,all]
                              [--draft strong] [--limit 6] [--max-new-tokens 48] [--learn 20] [--clock counted]

``--clock`` goes to every ``specfit eval`` run (default: its own, counted on the CPU: the same modeled
figures and decisions on any machine).

A rerun resumes each finished run (``specfit eval`` resumes from its ``--out``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PROFILES = ("qwen3-30b-a3b-h200", "qwen3-30b-a3b-pcie4")
BASELINES = ("ar", "eagle3", "eagle3-scan")


def _other_prompts(path: Path, start: int, count: int) -> None:
    """Write GSM8K test prompts ``start .. start+count-1`` (file order, ``gsm8k`` template) to ``path``."""
    from specfit.eval.datasets import load_prompts
    from specfit.core.io import atomic_write_text, dumps

    prompts = load_prompts("gsm8k")[start:start + count]
    atomic_write_text(path, "".join(dumps({"id": p.id, "prompt": p.text, "reference": p.reference}) + "\n"
                                    for p in prompts))


def _eval(args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "specfit", "eval", "--no-progress", *args], check=True,
                   stdout=subprocess.DEVNULL)


def _rows(out: Path) -> dict:
    return {r["method"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}


def _decisions(out: Path) -> dict:
    counts: dict = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("method") == "specfit":
            for d in rec.get("decisions") or []:
                counts[d] = counts.get(d, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    """Run the cells and print the table (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m specfit.eval.warm_start", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/warm")
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--slots", default="16,32,96,all")
    p.add_argument("--draft", default="strong")
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--learn", type=int, default=20)
    p.add_argument("--learn-from", type=int, default=7)
    p.add_argument("--clock", choices=("counted", "measured"), default=None)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    other = out / "gsm8k-other.jsonl"
    _other_prompts(other, a.learn_from, a.learn)
    print("| profile | slots | ar | eagle3 | eagle3-scan | specfit cold (τ) | specfit warm (τ) | cold / best "
          "| warm / best | warm decisions |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for profile in a.profiles.split(","):
        for slots in a.slots.split(","):
            cell = out / f"{profile.removeprefix('qwen3-30b-a3b-')}-{slots}"
            common = ["--draft", a.draft, "--profile", profile, "--max-new-tokens", str(a.max_new_tokens),
                      "--cache-slots", slots] + (["--clock", a.clock] if a.clock else [])
            _eval(common + ["--dataset", str(other), "--limit", str(a.learn), "--methods", "specfit",
                            "--out", str(cell / "learn")])
            _eval(common + ["--dataset", "gsm8k", "--limit", str(a.limit), "--methods", "specfit",
                            "--out", str(cell / "cold")])
            _eval(common + ["--dataset", "gsm8k", "--limit", str(a.limit), "--methods",
                            ",".join(BASELINES) + ",specfit", "--warm-start", str(cell / "learn"),
                            "--out", str(cell / "warm")])
            warm, cold = _rows(cell / "warm"), _rows(cell / "cold")["specfit"]
            best = max(warm[m]["modeled_tokens_per_s"] for m in BASELINES)
            sw = warm["specfit"]
            dec = ", ".join(f"{n} {d}" for d, n in sorted(_decisions(cell / "warm").items()))
            print(f"| {profile} | {slots} | " + " | ".join(f"{warm[m]['modeled_tokens_per_s']:.1f}" for m in BASELINES)
                  + f" | {cold['modeled_tokens_per_s']:.1f} ({cold['tau']:.2f}) | {sw['modeled_tokens_per_s']:.1f} "
                  f"({sw['tau']:.2f}) | {cold['modeled_tokens_per_s'] / best:.3f} | "
                  f"{sw['modeled_tokens_per_s'] / best:.3f} | {dec} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
