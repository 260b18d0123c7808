"""Where a registered address lives: host memory or a CUDA device's (one code path for CPU and GPU pools).

``device_of(addr)`` asks the CUDA driver (``cuPointerGetAttribute`` through ``libcuda.so.1``) and answers
the device ordinal of device memory, or None for host memory. Without a driver (a CPU machine) or for a
pointer the driver does not know (numpy, ctypes), it is None: every region is host memory and the
backends behave exactly as on a CPU box. Backends use it at ``register``: NIXL registers device regions
as ``VRAM`` with their device id, Mooncake with location ``cuda:N``, and tcp refuses them (it can only
``recv_into`` host memory).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

_ATTR_MEMORY_TYPE = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
_ATTR_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
_MEMORYTYPE_DEVICE = 2  # CU_MEMORYTYPE_DEVICE

DeviceRegion = tuple[int, int, int]  # (address, length, device ordinal)


@functools.cache
def _driver() -> Any:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = lib.cuPointerGetAttribute
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return fn


def device_of(addr: int) -> int | None:
    query = _driver()
    if query is None:
        return None
    kind = ctypes.c_uint(0)
    if query(ctypes.byref(kind), _ATTR_MEMORY_TYPE, addr) != 0 or kind.value != _MEMORYTYPE_DEVICE:
        return None  # host memory, or a driver that was never initialized in this process (no device memory)
    ordinal = ctypes.c_int(0)
    return ordinal.value if query(ctypes.byref(ordinal), _ATTR_DEVICE_ORDINAL, addr) == 0 else 0


def device_regions(regions: Sequence[tuple[int, int]]) -> list[DeviceRegion]:
    """The regions that live in device memory, with their device ordinal."""
    out = []
    for addr, length in regions:
        device = device_of(addr)
        if device is not None:
            out.append((addr, length, device))
    return out


def find_device(regions: Sequence[DeviceRegion], addr: int, length: int) -> int | None:
    """The device of the device region holding ``[addr, addr + length)``, or None (host memory)."""
    for start, size, device in regions:
        if start <= addr and addr + length <= start + size:
            return device
    return None
