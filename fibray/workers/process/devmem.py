"""GPU memory a supervisor allocates and an executor of another uid maps: CUDA VMM through ctypes.

The supervisor creates physical memory with cuMemCreate (exportable as a POSIX file descriptor),
maps it in its own address space and exports the descriptor; the executor receives it over its
channel (SCM_RIGHTS), imports it and maps it in its own. Legacy CUDA IPC handles are refused
between users on some hosts; a file descriptor the executor was handed is not. Both sides wrap
their mapping as a torch uint8 tensor through __cuda_array_interface__. Never used on a CPU.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

_POSIX_FD = 1            # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_PINNED = 1              # CU_MEM_ALLOCATION_TYPE_PINNED
_LOC_DEVICE = 1          # CU_MEM_LOCATION_TYPE_DEVICE
_READWRITE = 3           # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_MIN = 0     # CU_MEM_ALLOC_GRANULARITY_MINIMUM
_ATTR_VMM = 102          # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ATTR_POSIX_FD = 103     # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):
    """CUmemAllocationProp (cuda.h)."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DevMemError(RuntimeError):
    """CUDA VMM is unavailable or a call failed (the message names the call and the CUDA error)."""


_cuda: Optional[ctypes.CDLL] = None


def _lib() -> ctypes.CDLL:
    global _cuda
    if _cuda is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise DevMemError(f"cannot load libcuda.so.1: {e}") from None
        u64, sz = ctypes.c_uint64, ctypes.c_size_t
        sigs = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
            "cuMemGetAllocationGranularity": [ctypes.POINTER(sz), ctypes.POINTER(_Prop), ctypes.c_int],
            "cuMemCreate": [ctypes.POINTER(u64), sz, ctypes.POINTER(_Prop), ctypes.c_ulonglong],
            "cuMemExportToShareableHandle": [ctypes.c_void_p, u64, ctypes.c_int, ctypes.c_ulonglong],
            "cuMemImportFromShareableHandle": [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(u64), sz, sz, u64, ctypes.c_ulonglong],
            "cuMemMap": [u64, sz, sz, u64, ctypes.c_ulonglong],
            "cuMemSetAccess": [u64, sz, ctypes.POINTER(_AccessDesc), sz],
            "cuMemUnmap": [u64, sz],
            "cuMemAddressFree": [u64, sz],
            "cuMemRelease": [u64],
            "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        _cuda = lib
    return _cuda


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(rc, ctypes.byref(name))
        raise DevMemError(f"{what} failed: CUDA error {rc} ({(name.value or b'?').decode()})")


def _ordinal(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _prop(ordinal: int) -> _Prop:
    prop = _Prop()
    prop.type, prop.requestedHandleTypes = _PINNED, _POSIX_FD
    prop.location.type, prop.location.id = _LOC_DEVICE, ordinal
    return prop


def granularity(device: torch.device) -> int:
    lib, gran = _lib(), ctypes.c_size_t(0)
    prop = _prop(_ordinal(device))
    _check(lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), _GRANULARITY_MIN),
           "cuMemGetAllocationGranularity")
    return gran.value


def available(device: torch.device) -> Optional[str]:
    """None when this device can share VMM allocations as file descriptors, else why not."""
    try:
        torch.cuda.init()
        lib = _lib()
        _check(lib.cuInit(0), "cuInit")
        dev, flag = ctypes.c_int(0), ctypes.c_int(0)
        _check(lib.cuDeviceGet(ctypes.byref(dev), _ordinal(device)), "cuDeviceGet")
        for attr, what in ((_ATTR_VMM, "virtual memory management"), (_ATTR_POSIX_FD, "POSIX file descriptor handles")):
            _check(lib.cuDeviceGetAttribute(ctypes.byref(flag), attr, dev), "cuDeviceGetAttribute")
            if not flag.value:
                return f"{device} does not support {what}"
        DeviceRegion.create(1, device).close()  # the whole path once: create, map, export
    except DevMemError as e:
        return str(e)
    return None


class _Interface:
    """What torch.as_tensor needs to view device memory it did not allocate."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class DeviceRegion:
    """A VMM allocation mapped in this process, read-write from its device, as a uint8 tensor."""

    def __init__(self, handle: int, size: int, device: torch.device, fd: Optional[int]) -> None:
        self.size, self.device, self.fd = size, device, fd
        self._handle, self._ptr = handle, 0
        self._mapped = 0
        lib, ordinal = _lib(), _ordinal(device)
        self._mapped = -(-size // granularity(device)) * granularity(device)
        ptr = ctypes.c_uint64(0)
        try:
            _check(lib.cuMemAddressReserve(ctypes.byref(ptr), self._mapped, 0, 0, 0), "cuMemAddressReserve")
            self._ptr = ptr.value
            _check(lib.cuMemMap(self._ptr, self._mapped, 0, handle, 0), "cuMemMap")
            access = _AccessDesc()
            access.location.type, access.location.id, access.flags = _LOC_DEVICE, ordinal, _READWRITE
            _check(lib.cuMemSetAccess(self._ptr, self._mapped, ctypes.byref(access), 1), "cuMemSetAccess")
        except DevMemError:
            self.close()
            raise
        with torch.cuda.device(device):
            self._bytes: Optional[torch.Tensor] = torch.as_tensor(_Interface(self._ptr, size), device=device)

    @classmethod
    def create(cls, size: int, device: torch.device) -> "DeviceRegion":
        """New device memory (the supervisor's), exportable as a file descriptor."""
        lib = _lib()
        _check(lib.cuInit(0), "cuInit")
        gran = granularity(device)
        padded = -(-max(size, 1) // gran) * gran
        handle = ctypes.c_uint64(0)
        prop = _prop(_ordinal(device))
        _check(lib.cuMemCreate(ctypes.byref(handle), padded, ctypes.byref(prop), 0), "cuMemCreate")
        fd = ctypes.c_int(-1)
        rc = lib.cuMemExportToShareableHandle(ctypes.cast(ctypes.byref(fd), ctypes.c_void_p), handle.value, _POSIX_FD, 0)
        if rc != 0:
            lib.cuMemRelease(handle.value)
            _check(rc, "cuMemExportToShareableHandle")
        return cls(handle.value, size, device, fd.value)

    @classmethod
    def open(cls, fd: int, size: int, device: torch.device) -> "DeviceRegion":
        """The supervisor's memory, from the descriptor it sent (the executor's side); the descriptor is closed."""
        lib = _lib()
        _check(lib.cuInit(0), "cuInit")
        handle = ctypes.c_uint64(0)
        try:
            _check(lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), _POSIX_FD),
                   "cuMemImportFromShareableHandle")
        finally:
            os.close(fd)
        return cls(handle.value, size, device, None)

    def bytes(self) -> torch.Tensor:
        assert self._bytes is not None, "region closed"
        return self._bytes

    def share(self) -> Optional[int]:
        return self.fd

    def piece(self, off: int, nbytes: int) -> torch.Tensor:
        """Bytes [off, off + nbytes) as a tensor with a storage of its own."""
        assert self._bytes is not None and 0 <= off and off + nbytes <= self.size, "outside the region"
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        with torch.cuda.device(self.device):
            return torch.as_tensor(_Interface(self._ptr + off, nbytes), device=self.device)

    def close(self) -> None:
        """Unmap and release (a tensor still viewing the range faults on its next use: nothing stale is read)."""
        lib = _lib()
        if getattr(self, "_bytes", None) is not None:
            torch.cuda.synchronize(self.device)
        self._bytes = None
        if self._ptr:
            lib.cuMemUnmap(self._ptr, self._mapped)
            lib.cuMemAddressFree(self._ptr, self._mapped)
            self._ptr = 0
        if self._handle:
            lib.cuMemRelease(self._handle)
            self._handle = 0
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class StagedRegion:
    """The fallback where VMM is unavailable (runner.executor_checks): the executor's device copy of
    a host region, filled from it before each request and copied back after. The supervisor then
    verifies what this process copied back: a candidate that rebinds this class can fake it."""

    def __init__(self, host, device: torch.device) -> None:
        self.host, self.size, self.device = host, host.size, device
        self._bytes: Optional[torch.Tensor] = torch.empty(host.size, dtype=torch.uint8, device=device)

    def bytes(self) -> torch.Tensor:
        assert self._bytes is not None, "region closed"
        return self._bytes

    def share(self) -> Optional[int]:
        return None

    def pull(self) -> None:
        self.bytes().copy_(self.host.bytes())
        torch.cuda.synchronize(self.device)

    def push(self) -> None:
        torch.cuda.synchronize(self.device)
        self.host.bytes().copy_(self.bytes())

    def close(self) -> None:
        self._bytes = None
        self.host.close()


def regions_for(device: torch.device):
    """A Judge's region factory on this GPU: (size, device) -> DeviceRegion."""
    return lambda size, dev: DeviceRegion.create(size, dev)
