"""Reproduce the shipped proxy models with one command.

Usage::

    python -m specfit.models.proxy.train --all          # tokenizer, target, EAGLE-3 head, τ, model cards
    python -m specfit.models.proxy.train --target       # tokenizer + target only
    python -m specfit.models.proxy.train --head --tau   # head (needs a trained target) and τ measurement
    python -m specfit.models.proxy.train --head-lite    # the lite head (default of specfit eval), τ, its card

Stages write into :data:`models.proxy.TARGET_DIR`, :data:`models.proxy.EAGLE3_DIR` and
:data:`models.proxy.EAGLE3_LITE_DIR` (``--out`` changes the parent directory). Threads: ``--threads`` (default 2). Wall-clock caps
(``--target-minutes`` 48, ``--head-minutes`` 25) keep the whole run under 90 minutes on a 2-core
CPU; a capped stage still saves its last checkpoint and records the steps it ran.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specfit.models.proxy import EAGLE3_DIR, EAGLE3_LITE_DIR, TARGET_DIR


def main(argv=None) -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m specfit.models.proxy.train", description=__doc__.split("\n")[0])
    ap.add_argument("--all", action="store_true", help="run every stage")
    ap.add_argument("--target", action="store_true", help="train the tokenizer and the target")
    ap.add_argument("--head", action="store_true", help="train the EAGLE-3 head on the target")
    ap.add_argument("--tau", action="store_true", help="measure τ and held-out statistics, write model cards")
    ap.add_argument("--head-lite", action="store_true",
                    help="train the lite head (models.proxy.lite.LITE_RECIPE), measure its τ, write its card")
    ap.add_argument("--out", type=Path, default=None, help="parent directory of target/ and eagle3/")
    ap.add_argument("--data-dir", type=Path, default=None, help="data copy (default: repo data/proxy)")
    ap.add_argument("--target-steps", type=int, default=1500)
    ap.add_argument("--head-steps", type=int, default=800)
    ap.add_argument("--target-minutes", type=float, default=48.0, help="wall-clock cap of target training")
    ap.add_argument("--head-minutes", type=float, default=25.0, help="wall-clock cap of head training")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    import torch

    from specfit.models.proxy import data

    torch.set_num_threads(args.threads)
    target_dir = args.out / "target" if args.out else TARGET_DIR
    head_dir = args.out / "eagle3" if args.out else EAGLE3_DIR
    lite_dir = args.out / "eagle3-lite" if args.out else EAGLE3_LITE_DIR
    data_dir = args.data_dir or data.DATA_DIR
    run_all = args.all or not (args.target or args.head or args.tau or args.head_lite)
    if run_all or args.target:
        from specfit.models.proxy.tokenizer import train_tokenizer
        from specfit.models.proxy.train_target import train_target

        sources = data.training_sources(data_dir)
        target_dir.mkdir(parents=True, exist_ok=True)
        tok = train_tokenizer([t for docs in sources.values() for t in docs], target_dir)
        info = train_target(tok, sources, target_dir, steps=args.target_steps, max_minutes=args.target_minutes,
                            device=args.device, log_path=target_dir / "train_log.jsonl")
        (target_dir / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
        print("target:", info, flush=True)
    if run_all or args.head:
        from specfit.models.proxy.train_head import train_head

        info = train_head(target_dir, head_dir, data_dir=data_dir, steps=args.head_steps,
                          max_minutes=args.head_minutes, device=args.device)
        print("head:", info, flush=True)
    if run_all or args.tau:
        from specfit.models.proxy.report import write_reports

        write_reports(target_dir, head_dir, data_dir=data_dir, device=args.device)
    if run_all or args.head_lite:
        from specfit.models.proxy.lite import train_lite

        res = train_lite(target_dir, lite_dir, data_dir=data_dir, device=args.device)
        print("lite head τ:", {k: round(v["tau"], 3) for k, v in res["tau"].items()}, flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {(time.time() - t0) / 60:.1f} min")
