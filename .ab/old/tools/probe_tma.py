"""How long one cuTensorMapEncodeTiled costs through cuda.bindings, and whether a map encoded for
one address differs from another address's map only in an 8-byte little-endian address word."""
import time

import torch

from kernelgen import tma

x = torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16)
y = torch.randn_like(x)
m = tma.attention_map(x.shape, x.stride(), "bf16", 128, 128)
a, b = tma._encode(m, x.data_ptr()), tma._encode(m, y.data_ptr())
t0 = time.perf_counter()
for _ in range(2000):
    tma._encode(m, x.data_ptr())
print(f"encode: {(time.perf_counter() - t0) / 2000 * 1e6:.2f} us per map")
diff = [i for i in range(128) if a[i] != b[i]]
print("differing bytes", diff)
print("word 0 of a == address of x:", int.from_bytes(a[:8], "little") == x.data_ptr(),
      "| b == a with word 0 replaced:", b == y.data_ptr().to_bytes(8, "little") + a[8:])
