"""Compute devices: parse a device string once, check it against what this torch can use.

Every runtime entry point (:class:`specfit.models.qwen3_moe.OffloadedQwen3Moe`, the EAGLE-3 loader,
``specfit eval`` and ``specfit generate``) resolves its ``device`` here, so ``"gpu"``, ``"cuda"`` on a
CPU-only torch or ``"cuda:3"`` on a one-GPU machine is one :class:`SpecFitInputError` that says which
devices this torch can use. ``"cuda"`` is resolved to an explicit index (the current CUDA device),
so later code (CUDA events, memory and device-name reports) never assumes ``cuda:0``.
"""

from __future__ import annotations

import torch

from specfit.core.errors import SpecFitInputError


def available_devices() -> list[str]:
    """The device strings this torch can compute on: ``cpu`` and one ``cuda:i`` per visible GPU."""
    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return ["cpu", *cuda]


def resolve_device(device, field: str = "device") -> torch.device:
    """The ``torch.device`` for ``device``, checked against :func:`available_devices`.

    Parameters
    ----------
    device : str or torch.device
        ``"cpu"``, ``"cuda"`` (the current CUDA device) or ``"cuda:i"``.
    field : str
        Field name for the error.

    Returns
    -------
    torch.device
        With an explicit index for CUDA (``cuda`` becomes ``cuda:<current device>``).

    Raises
    ------
    SpecFitInputError
        If the string is not a device, the device type is not CPU or CUDA, CUDA is not available to
        this torch, or the index names a GPU that does not exist; the message lists the devices
        this torch can use.
    """
    can = f"this torch ({torch.__version__}) can use: {', '.join(available_devices())}"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise SpecFitInputError(field, f"{device!r} is not a device; {can}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise SpecFitInputError(field, f"device type {dev.type!r} is not supported; {can}")
    if not torch.cuda.is_available():
        raise SpecFitInputError(field, f"{device!r}: CUDA is not available; {can}")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise SpecFitInputError(field, f"{device!r}: no such GPU; {can}")
    return torch.device("cuda", index)


def default_dtype(device) -> torch.dtype:
    """The runtime's compute dtype on ``device`` when none is given: float32 on the CPU, bfloat16 on
    CUDA (Qwen3-30B-A3B's own checkpoint dtype; half the memory and copy time of float32).

    Raises
    ------
    SpecFitInputError
        If ``device`` is not one this torch can use (:func:`resolve_device`).
    """
    return torch.float32 if resolve_device(device).type == "cpu" else torch.bfloat16


def device_name(device) -> str | None:
    """The GPU model of ``device`` (``torch.cuda.get_device_name`` of *that* index), None on the CPU."""
    dev = resolve_device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
