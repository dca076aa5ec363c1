"""Binary -> a CUfunction per device, launched with the driver API.

Knows nothing of specs, tuning or torch: it gets a cubin, the kernel's parameter types in order,
and at launch time the grid, block, shared memory, argument values, stream and device. Loading
(module, function, shared-memory attribute) happens once per device; a launch only writes the
argument values into preallocated ctypes storage and calls cuLaunchKernel.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from dataclasses import dataclass

from kernelgen.compile import Binary

# struct codes, sizes and alignments of the kernel parameter types. A tensor map (CUtensorMap,
# passed by value as a __grid_constant__ parameter) is 128 opaque bytes aligned to 64.
_FORMATS = {"ptr": ("Q", 8, 8), "i64": ("q", 8, 8), "i32": ("i", 4, 4), "f32": ("f", 4, 4),
            "tmap": ("128s", 128, 64)}
_BUFFER_ALIGN = 64  # the strictest alignment above
_DEFAULT_SMEM_LIMIT = 48 * 1024  # beyond this a function must opt in (MAX_DYNAMIC_SHARED_SIZE_BYTES)


class LaunchError(RuntimeError):
    pass


_DRIVER = None
_CURRENT = threading.local()  # which device's primary context this thread made current


def _driver():
    """The driver module, or a clear RuntimeError on a machine without a CUDA driver."""
    global _DRIVER
    if _DRIVER is not None:
        return _DRIVER
    try:
        from cuda.bindings import driver

        _check(driver, driver.cuInit(0), "cuInit")
    except LaunchError:
        raise
    except Exception as exc:  # no libcuda.so: cuda.pathfinder raises its own error types
        raise RuntimeError(
            f"kernelgen: no CUDA driver/GPU available ({type(exc).__name__}: {exc}). "
            "Rendering, compiling and `kernelgen build` work without a GPU; running a kernel does not."
        ) from None
    _DRIVER = driver
    return driver


def _check(driver, result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise LaunchError(f"{what} failed: {name.decode() if name else err}")
    return rest[0] if len(rest) == 1 else rest


@dataclass
class _Loaded:
    context: object
    module: object
    function: object
    smem_limit: int


class Kernel:
    """One compiled binary, loadable on any device of its arch."""

    def __init__(self, binary: Binary, arg_types: tuple[str, ...]):
        unknown = [t for t in arg_types if t not in _FORMATS]
        if unknown:
            raise ValueError(f"unknown kernel argument types {unknown}; allowed: {sorted(_FORMATS)}")
        self.binary = binary
        self.arg_types = tuple(arg_types)
        self._loaded: dict[int, _Loaded] = {}
        self._lock = threading.Lock()
        # All argument values live in one buffer, each at its natural alignment, written by one
        # struct.pack_into per launch; kernelParams is a fixed array of pointers into it.
        fmt, offsets, offset = "<", [], 0
        for t in self.arg_types:
            code, size, align = _FORMATS[t]
            pad = -offset % align
            fmt += "x" * pad + code
            offsets.append(offset + pad)
            offset += pad + size
        self._packer = struct.Struct(fmt)
        self._buffer = ctypes.create_string_buffer(max(8, self._packer.size) + _BUFFER_ALIGN)
        # Values start at an aligned address inside the buffer, so every offset is aligned too.
        self._start = -ctypes.addressof(self._buffer) % _BUFFER_ALIGN
        base = ctypes.addressof(self._buffer) + self._start
        self._pointers = (ctypes.c_void_p * max(1, len(offsets)))(*[base + o for o in offsets])
        self._params_address = ctypes.addressof(self._pointers)
        self._streams: dict[int, object] = {}

    def _load(self, device: int) -> _Loaded:
        driver = _driver()
        with self._lock:
            if device in self._loaded:
                return self._loaded[device]
            dev = _check(driver, driver.cuDeviceGet(device), "cuDeviceGet")
            ctx = _check(driver, driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _check(driver, driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            module = _check(driver, driver.cuModuleLoadData(self.binary.cubin), "cuModuleLoadData")
            function = _check(
                driver, driver.cuModuleGetFunction(module, self.binary.entry.encode()),
                f"cuModuleGetFunction({self.binary.entry})",
            )
            loaded = _Loaded(ctx, module, function, _DEFAULT_SMEM_LIMIT)
            _CURRENT.device = device
            self._loaded[device] = loaded
            return loaded

    def loaded_on(self, device: int) -> bool:
        return device in self._loaded

    def _raise_smem_limit(self, loaded: _Loaded, smem: int) -> None:
        driver = _driver()
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver, driver.cuFuncSetAttribute(loaded.function, attr, smem),
               f"cuFuncSetAttribute(max dynamic smem = {smem} bytes)")
        loaded.smem_limit = smem

    def launch(self, grid, block, smem: int, args, stream: int, device: int) -> None:
        loaded = self._loaded.get(device) or self._load(device)
        driver = _DRIVER
        if getattr(_CURRENT, "device", None) != device:  # the function lives in that context
            _check(driver, driver.cuCtxSetCurrent(loaded.context), "cuCtxSetCurrent")
            _CURRENT.device = device
        if smem > loaded.smem_limit:
            self._raise_smem_limit(loaded, smem)
        if len(args) != len(self.arg_types):
            raise ValueError(f"{self.binary.entry} takes {len(self.arg_types)} arguments, got {len(args)}")
        handle = self._streams.get(stream)
        if handle is None:
            handle = self._streams[stream] = driver.CUstream(stream)
        with self._lock:  # the parameter storage is shared; the driver copies it at launch
            self._packer.pack_into(self._buffer, self._start, *args)
            err, = driver.cuLaunchKernel(
                loaded.function, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                smem, handle, self._params_address, 0,
            )
        if err != driver.CUresult.CUDA_SUCCESS:
            _check(driver, (err,), f"cuLaunchKernel({self.binary.name}, grid={tuple(grid)}, "
                                   f"block={tuple(block)}, smem={smem})")
