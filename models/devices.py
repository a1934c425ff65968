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


#: aten ops (overload packets) that make the host wait for the device on CUDA, or would: reading a
#: value (``_local_scalar_dense``: ``.item()``, ``int(t)``, ``.tolist()``), ops whose output shape
#: depends on values (``nonzero``, ``masked_select``, ``unique``; boolean indexing and ``torch.where``
#: with one argument go through ``nonzero``), ``bincount``/``histc``/``repeat_interleave`` with tensor
#: repeats (their CUDA kernels read a maximum or a sum back), ``equal``/``is_nonzero`` (a bool back) and
#: ``_assert_async``; an entry with a dot names one overload. Copies between the device and the host are
#: caught separately (:class:`HostSyncGuard`).
SYNC_OPS = ("_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "_unique", "_unique2",
            "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount", "histc",
            "repeat_interleave.Tensor", "repeat_interleave.self_Tensor", "equal", "is_nonzero", "_assert_async")


def _op_name(func) -> str:
    """The overload packet name of an aten op (``aten.nonzero.default`` -> ``nonzero``)."""
    return func.overloadpacket.__name__


class OpCounter:
    """Count the aten operations dispatched inside a ``with`` block (a ``TorchDispatchMode``).

    Every op that reaches the dispatcher from Python-visible code is counted once (its own internal
    calls are not); views (``view``, ``transpose``, ``select``, ... : ``OpOverload.is_view``) are
    counted apart, since they launch no kernel on a GPU.

    Attributes
    ----------
    total : int
        Ops dispatched.
    views : int
        Of which views.
    by_name : dict of str -> int
        Count per overload packet name.
    """

    def __init__(self):
        self.total, self.views, self.by_name = 0, 0, {}
        self._mode = None

    def __enter__(self) -> "OpCounter":
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.total += 1
                counter.views += bool(func.is_view)
                name = _op_name(func)
                counter.by_name[name] = counter.by_name.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None


class HostSyncGuard:
    """Fail on any op inside a ``with`` block that makes (or on CUDA would make) the host wait for the device.

    Caught, at the op that does it:

    * the ops of :data:`SYNC_OPS` (a value read back, a shape that depends on values), and indexing with a
      boolean mask (``aten.index``/``index_put_`` with a bool index: a ``nonzero`` inside), on any device: on
      the CPU nothing waits, but the same code on CUDA would, so a CPU run of this guard checks the code path
      a GPU takes;
    * on a CUDA ``device``: copies from the device to the host (``.cpu()``, ``.to("cpu")``), and copies from
      pageable host memory to the device (CUDA synchronises the stream before those; a copy from page-locked
      memory with ``non_blocking=True`` does not wait and is allowed).

    Not caught: Python-side waits that dispatch no aten op (``torch.cuda.synchronize``, an event's
    ``synchronize``), ``.tolist()``/``.numpy()`` of a host tensor (they read host memory without an op; of a
    CUDA tensor they copy to the host first, which is caught on a CUDA device), and host work that is
    merely slow.

    Raises
    ------
    AssertionError
        At the first such op, naming it.
    """

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self._mode = None

    def __enter__(self) -> "HostSyncGuard":
        from torch.utils._python_dispatch import TorchDispatchMode

        cuda = self.device.type == "cuda"

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = _op_name(func)
                if name in SYNC_OPS or f"{name}.{func._overloadname}" in SYNC_OPS:
                    raise AssertionError(f"host sync: aten.{name}.{func._overloadname} inside a sync-free block")
                if name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
                        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
                    raise AssertionError(f"host sync: aten.{name} with a boolean index (a nonzero) inside a sync-free block")
                if cuda and name in ("_to_copy", "copy_"):
                    src = args[1] if name == "copy_" else args[0]
                    dst_type = (args[0].device.type if name == "copy_" else
                                torch.device(kwargs.get("device") or src.device).type)
                    if src.device.type == "cuda" and dst_type == "cpu":
                        raise AssertionError(f"device-to-host copy (aten.{name}) inside a sync-free block")
                    if src.device.type == "cpu" and dst_type == "cuda" and not src.is_pinned():
                        raise AssertionError(f"copy from pageable host memory (aten.{name}) inside a sync-free block")
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None
