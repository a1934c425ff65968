"""The ``specfit`` command: parse arguments, call the library, print. No logic of its own.

Every subcommand is a pair ``_add_<name>(subparsers)`` / ``_run_<name>(args) -> int``, registered in
``_COMMANDS``. Heavy imports (torch, transformers) happen inside ``_run_*`` so that ``specfit solve``
starts fast. Bad input (:class:`~specfit.errors.SpecFitInputError`) is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from specfit.errors import SpecFitInputError


def _add_solve(sub) -> None:
    p = sub.add_parser("solve", help="select the verified subtree of one instance (SPECFIT.md §4)",
                       description="Read one instance JSON and print the selected subtree.")
    p.add_argument("instance", help="instance JSON file (SPECFIT.md §4)")
    p.add_argument("--solver", default="exact", help="solver name (default: exact); see --list-solvers")
    p.add_argument("--max-nodes", type=int, default=None, help="override the instance's max_nodes budget")
    p.add_argument("--rate", type=float, default=None,
                   help="rate mode: maximise A - rate*T with rate in tokens/s (default: ratio mode, max A/T)")
    p.add_argument("--time-limit", type=float, default=None, help="time limit in seconds (cpsat)")
    p.add_argument("--json", action="store_true", help="print the selection as one JSON object")


def _run_solve(args) -> int:
    from dataclasses import replace

    from solvers import get_solver
    from specfit.instance import load_instance

    inst = load_instance(args.instance)
    if args.max_nodes is not None:
        inst = replace(inst, max_nodes=args.max_nodes)
    options = {} if args.time_limit is None else {"time_limit_s": args.time_limit}
    sel = get_solver(args.solver, **options).solve(inst, rate=args.rate)
    if args.json:
        print(json.dumps(sel.to_json()))
    else:
        print(f"solver      {sel.solver} ({sel.status})")
        print(f"nodes       {list(sel.nodes)}")
        print(f"expected    {sel.expected_tokens:.4f} tokens/cycle")
        print(f"predicted   {sel.predicted_ms:.4f} ms/cycle")
        print(f"throughput  {sel.throughput:.3f} tokens/s")
        print(f"solve time  {sel.solve_ms:.3f} ms")
    return 0


_COMMANDS = (
    ("solve", _add_solve, _run_solve),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``specfit`` command with all subcommands."""
    parser = argparse.ArgumentParser(prog="specfit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for _, add, _ in _COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``specfit`` and ``python -m specfit``. Returns the exit code."""
    args = build_parser().parse_args(argv)
    run = {name: fn for name, _, fn in _COMMANDS}[args.command]
    try:
        return run(args)
    except SpecFitInputError as exc:
        print(f"specfit {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
