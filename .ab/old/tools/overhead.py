"""Where the host time of one flash_attn_func call goes (run on the GPU machine).

The pieces of a repeated call on a tiny problem (1 x 64 x 1 x 64 bf16, the bench's probe), each
timed alone over 3000 queued calls, then cProfile of the whole call. The launch arguments come
from the call's own plan (ops._arguments), so the rows hold for either forward family: sm90 adds
the tensor maps (tma.encode per operand) and, for the dynamic schedule, the tile counter
(hopper.counter_address: words of a pooled zeroed buffer; tile_counter, its torch.zeros per
launch, is what a captured graph gets and what every call made before)."""
import cProfile
import ctypes
import pstats
import time

import torch

import kernelgen
from kernelgen import api, hopper, ops


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
signature, plan = next(iter(ops._PLANS.items()))
kernel = plan.kernel
out = torch.empty(plan.out_shape, dtype=plan.dtype, device="cuda")
lse = torch.empty(plan.lse_shape, device="cuda")
stream = api._current_stream(0)
args, counter = ops._arguments(plan, q, q, q, out, lse, stream)
k = kernel.kernel
loaded = k._loaded[0]
from cuda.bindings import driver  # noqa: E402

handle = driver.CUstream(stream)
libcuda = ctypes.CDLL("libcuda.so.1")
fn_ptr = ctypes.c_void_p(int(loaded.function))
print(f"kernel {kernel.source.name}: config {dict(kernel.config.as_dict())}, grid {plan.grid}, "
      f"{len(args)} arguments")
rows = {
    "flash_attn_func": lambda: kernelgen.flash_attn_func(q, q, q),
    "checked_forward": lambda: ops.checked_forward(q, q, q, False, None),
    "ops._launch (plan known)": lambda: ops._launch(plan, q, q, q),
    "signature + _PLANS.get": lambda: ops._PLANS.get(
        (q.shape, q.shape, q.shape, q.stride(), q.stride(), q.stride(), q.dtype, q.dtype, q.dtype,
         q.device, q.device, q.device, False, None)),
    "2x torch.empty": lambda: (torch.empty(plan.out_shape, dtype=plan.dtype, device=q.device),
                               torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)),
    "ops._arguments": lambda: ops._arguments(plan, q, q, q, out, lse, stream),
    "BoundKernel.launch": lambda: kernel.launch(args, plan.grid, 0, stream),
    "driver.cuLaunchKernel": lambda: driver.cuLaunchKernel(loaded.function, *plan.grid, *kernel.block,
                                                          kernel.smem, handle, k._params_address, 0),
    "ctypes cuLaunchKernel": lambda: libcuda.cuLaunchKernel(fn_ptr, *plan.grid, *kernel.block,
                                                            kernel.smem, ctypes.c_void_p(stream),
                                                            ctypes.c_void_p(k._params_address), None),
    "current stream": lambda: api._current_stream(0),
    "torch.compiler.is_compiling": torch.compiler.is_compiling,
}
if plan.maps:
    rows["hopper.encode_maps"] = lambda: hopper.encode_maps(plan.maps, q, q, q, out)
    rows["hopper.counter_address"] = lambda: hopper.counter_address(kernel, q, stream)
    rows["hopper.tile_counter"] = lambda: hopper.tile_counter(kernel, q)
    rows["is_current_stream_capturing"] = torch.cuda.is_current_stream_capturing
    rows["torch.zeros(4, int32)"] = lambda: torch.zeros(4, dtype=torch.int32, device=q.device)
    rows["torch.empty(4, int32)"] = lambda: torch.empty(4, dtype=torch.int32, device=q.device)
for name, fn in rows.items():
    print(f"{name:34} {per_call_us(fn):7.2f} us")
profile = cProfile.Profile()
profile.enable()
for _ in range(2000):
    kernelgen.flash_attn_func(q, q, q)
profile.disable()
torch.cuda.synchronize()
pstats.Stats(profile).sort_stats("tottime").print_stats(18)
