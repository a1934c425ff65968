"""Where a number was measured: the one reader of machine and library information for every report."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU model name (``/proc/cpuinfo`` on Linux, else :func:`platform.processor`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(one_core: bool | None = None, device: str | None = None) -> dict:
    """The machine, the libraries and the time a measurement was taken.

    Parameters
    ----------
    one_core : bool, optional
        Whether the timed process was pinned to one core (recorded as ``pinned_to_one_core``).
    device : str, optional
        The run's compute device; ``gpu`` names *that* device's model (None on the CPU).

    Returns
    -------
    dict
        ``cpu`` (model), ``cpu_count`` (logical cores), ``platform``, ``python``, ``numpy``,
        ``torch`` and ``torch_threads`` (when torch is imported), ``gpu`` (the model of
        ``device`` when it is a CUDA device, else None), ``ortools`` (when installed), ``date_utc``, and ``pinned_to_one_core`` if given.
    """
    import sys

    import numpy as np

    info = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__}
    torch = sys.modules.get("torch")  # torch-free reports (compare-solvers) do not import it for this
    if torch is not None:
        from specfit.models.devices import device_name

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                    gpu=device_name(device) if device is not None else None)
    try:
        import ortools

        info["ortools"] = ortools.__version__
    except ImportError:
        pass
    if one_core is not None:
        info["pinned_to_one_core"] = one_core
    info["date_utc"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return info


def command_line(module: str, argv=None) -> str:
    """The command that reproduces a report: ``python -m <module>`` and its arguments
    (``sys.argv[1:]`` when ``argv`` is None)."""
    import sys

    return " ".join(["python -m " + module, *(sys.argv[1:] if argv is None else argv)])


def publish(result: dict, table: str, json_path=None) -> None:
    """Print a benchmark's machine line (``result["machine"]``) and its table, and write ``result``
    as JSON to ``json_path`` if given (atomically: a temporary file renamed)."""
    from specfit.core.io import atomic_write_text, dumps

    print(dumps(result["machine"]))
    print(table)
    if json_path:
        atomic_write_text(Path(json_path), dumps(result, indent=1) + "\n")


def run_main(main) -> None:
    """Run a benchmark module's ``main()`` as a command: exit with its return code, or print a
    :class:`~specfit.core.errors.SpecFitInputError` as one ``error:`` line and exit 2 (bad input)."""
    import sys

    from specfit.core.errors import SpecFitInputError

    try:
        sys.exit(main())
    except SpecFitInputError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
