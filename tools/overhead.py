"""Where the host time of one flash_attn_func call goes (run on the GPU machine)."""
import cProfile
import ctypes
import pstats
import time

import torch

import kernelgen
from kernelgen import api, ops


def per_call_us(fn, calls=3000):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


q = torch.randn(1, 64, 1, 64, device="cuda", dtype=torch.bfloat16)
kernelgen.flash_attn_func(q, q, q)
kernel = ops._PLANS[next(iter(ops._PLANS))].kernel
out = torch.empty_like(q)
lse = torch.empty(1, 1, 64, device="cuda")
values = (q.data_ptr(), q.data_ptr(), q.data_ptr(), out.data_ptr(), lse.data_ptr(), *q.stride()[:3],
          *q.stride()[:3], *q.stride()[:3], *out.stride()[:3], 1, 1, 1, 64, 64, 0.125)
stream = api._current_stream(0)
k = kernel.kernel
loaded = k._loaded[0]
from cuda.bindings import driver

handle = driver.CUstream(stream)
libcuda = ctypes.CDLL("libcuda.so.1")
fn_ptr = ctypes.c_void_p(int(loaded.function))
rows = {
    "flash_attn_func": lambda: kernelgen.flash_attn_func(q, q, q),
    "flash_attn_forward (no checks)": lambda: ops.flash_attn_forward(q, q, q, False, 0.125),
    "_check_inputs": lambda: ops._check_inputs(q, q, q),
    "2x torch.empty": lambda: (torch.empty_like(q), torch.empty(1, 1, 64, device="cuda")),
    "BoundKernel.launch": lambda: kernel.launch(values, (1, 1, 1), 0, stream),
    "driver.cuLaunchKernel": lambda: driver.cuLaunchKernel(loaded.function, 1, 1, 1, 128, 1, 1, kernel.smem,
                                                          handle, k._params_address, 0),
    "ctypes cuLaunchKernel": lambda: libcuda.cuLaunchKernel(fn_ptr, 1, 1, 1, 128, 1, 1, kernel.smem,
                                                            ctypes.c_void_p(stream),
                                                            ctypes.c_void_p(k._params_address), None),
    "current stream": lambda: api._current_stream(0),
}
for name, fn in rows.items():
    print(f"{name:34} {per_call_us(fn):7.2f} us")
profile = cProfile.Profile()
profile.enable()
for _ in range(2000):
    kernelgen.flash_attn_func(q, q, q)
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(14)
