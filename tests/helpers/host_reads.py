# SPDX-License-Identifier: Apache-2.0
"""A watch for host reads of tensor values: what makes a CUDA call path wait for the GPU.

A tensor's value reaches Python through its methods (``item``, ``tolist``, ``bool(t)``, ...) and,
below Python, through the operators that copy a scalar out (``aten::item``,
``aten::_local_scalar_dense``: what slicing at a tensor-valued bound or indexing with a 0-dim
integer tensor runs in C++) or that size their output by the data (``nonzero``, boolean-mask
indexing, ``masked_select``, ...). On CUDA each of them waits for the kernels queued before it.
:class:`HostReads` watches both levels, a ``TorchFunctionMode`` for the methods and a
``TorchDispatchMode`` for the operators, so a CPU test can show that a call path reads nothing
on the host (an operator that runs inside another operator's kernel is not seen).
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class HostRead:
    """One read: what read (a method or operator name), the storage it read (its data pointer,
    0 where the read is of an operator's data-dependent output size) and where it was called."""

    what: str
    storage: int
    where: str


def _storage(x) -> int:
    return x.untyped_storage().data_ptr() if isinstance(x, torch.Tensor) else 0


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if "host_reads.py" not in f.filename]
    return "".join(traceback.format_list(frames[-3:]))


class _MethodReads(TorchFunctionMode):
    METHODS: ClassVar[set] = {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.numpy,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
    }

    def __init__(self, sink: list[HostRead]) -> None:
        super().__init__()
        self.sink = sink

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.METHODS:
            self.sink.append(HostRead(func.__name__, _storage(args[0]), _where()))
        return func(*args, **(kwargs or {}))


def _has_mask_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _masked_fill(name: str, args) -> bool:
    """``x[mask] = scalar``: one boolean index and a value held on the CPU with one element, which
    ATen runs as ``masked_fill_`` (no size from the data, no read of the device)."""
    if not name.startswith(("index_put", "_index_put")) or len(args) < 3:
        return False
    indices, value = args[1], args[2]
    return (
        len([i for i in indices if i is not None]) == 1
        and isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.numel() == 1
    )


class _OperatorReads(TorchDispatchMode):
    #: operators that copy a value to the host, or size their output by the data
    SCALAR = ("item", "_local_scalar_dense", "is_nonzero", "equal")
    SIZED = ("nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim")

    def __init__(self, sink: list[HostRead]) -> None:
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SCALAR:
            self.sink.append(HostRead(f"aten::{name}", _storage(args[0]), _where()))
        elif name in self.SIZED:
            self.sink.append(HostRead(f"aten::{name}", 0, _where()))
        elif (
            name in ("index", "index_put", "index_put_", "_index_put_impl_")
            and _has_mask_index(args[1])
            and not _masked_fill(name, args)
        ):
            self.sink.append(HostRead(f"aten::{name} with a boolean mask", 0, _where()))
        elif (
            name == "repeat_interleave"
            and isinstance(args[1] if len(args) > 1 else None, torch.Tensor)
            and (kwargs or {}).get("output_size") is None
        ):
            self.sink.append(HostRead("aten::repeat_interleave by tensor", 0, _where()))
        return func(*args, **(kwargs or {}))


class HostReads:
    """``with HostReads(host=[...]) as watch: ...``; then ``watch.reads`` lists every read and
    ``watch.device_reads()`` those of tensors other than ``host`` (and their views).

    Args:
        host: tensors the caller hands over on the host (e.g. lengths a field config keeps on the
            CPU): reading them costs the device nothing, so :meth:`device_reads` leaves them out.
    """

    def __init__(self, host: Iterable[torch.Tensor] = ()) -> None:
        self.reads: list[HostRead] = []
        self._host = {_storage(t) for t in host}
        self._modes = (_MethodReads(self.reads), _OperatorReads(self.reads))

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def device_reads(self) -> list[HostRead]:
        """Reads of anything but the ``host`` tensors (operators that size by data always count)."""
        return [r for r in self.reads if r.storage == 0 or r.storage not in self._host]

    def names(self) -> set[str]:
        return {r.what for r in self.reads}
