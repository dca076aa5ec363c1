"""The Hopper kernels' shared-memory port against their tensor cores, per tile step (PERF_NOTES §110).

A CTA's shared memory serves 128 bytes a clock (H100: 32.3 TB/s over 132 SMs at 1.755 GHz is
128 B/clk/SM, and the H200 is the same chip); its tensor cores do 4096 dense 16-bit FLOP a clock
(989 TFLOP/s). Every wgmma reads its shared-memory operands through that port: an SS
m64nNk16 reads A (64 x 16, 2 KiB) and B (N x 16), an RS one B only, while it computes
64 * N * 16 * 2 FLOP, so an SS wgmma of N = 64 needs the whole port (4 KiB in 32 clocks) and
one of N = 256 a fifth of it. The TMA loads' writes, the consumers' stores and the TMA reduce's
reads of dQ go through the same port.

For one step (the forward: one KV tile of a CTA's query tile; the backward: one (query tile,
KV tile) pair of a CTA) this counts the bytes and the FLOPs of what kernelgen's kernels do and
prints both as clocks: a step whose port time is near or above its tensor time cannot keep the
tensor cores busy however it is scheduled. A model, not a measurement: bank conflicts, plain
loads' L1 traffic and how evenly the two consumer warpgroups share the port are left out.

    python tools/smem_model.py            # the shipped tiles and the alternatives of §110
"""
from __future__ import annotations

from dataclasses import dataclass

PORT_BYTES_PER_CLOCK = 128
TENSOR_FLOP_PER_CLOCK = 4096
ELEM = 2  # bytes of a 16-bit element


@dataclass(frozen=True)
class Step:
    name: str
    smem_bytes: int
    flop: int
    pairs: int   # (query, key) pairs the step covers

    @property
    def port_clocks(self) -> float:
        return self.smem_bytes / PORT_BYTES_PER_CLOCK

    @property
    def tensor_clocks(self) -> float:
        return self.flop / TENSOR_FLOP_PER_CLOCK

    def row(self) -> str:
        return (f"{self.name:<44} {self.smem_bytes / 1024:7.0f} KiB {self.port_clocks:7.0f} "
                f"{self.tensor_clocks:7.0f} {self.port_clocks / self.tensor_clocks:6.2f} "
                f"{1000 * self.port_clocks / self.pairs:7.1f}")


def wgmma_group(n: int, k: int, a_in_smem: bool) -> tuple[int, int]:
    """(shared-memory bytes, FLOP) of one warpgroup's m64 x n x k product as k / 16 wgmmas."""
    steps = k // 16
    per_step = (64 * 16 * ELEM if a_in_smem else 0) + n * 16 * ELEM
    return steps * per_step, 2 * 64 * n * k


def forward(block_m: int, block_n: int, head_dim: int, q_in_registers: bool = False) -> Step:
    """One KV tile: each consumer warpgroup (64 query rows) computes S = Q K^T (SS, or RS with Q
    held in registers) and O += P V (RS: P from the S accumulators); TMA writes K and V."""
    consumers = block_m // 64
    qk = wgmma_group(block_n, head_dim, a_in_smem=not q_in_registers)
    pv = wgmma_group(head_dim, block_n, a_in_smem=False)
    loads = 2 * block_n * head_dim * ELEM
    name = f"fwd hd{head_dim} {block_m}x{block_n}" + (" Q in registers" if q_in_registers else "")
    return Step(name, consumers * (qk[0] + pv[0]) + loads, consumers * (qk[1] + pv[1]),
                block_m * block_n)


def backward(block_m: int, block_n: int, head_dim: int, dq_transposed: bool = False) -> Step:
    """One (query tile, KV tile) pair, block_n / 64 consumer warpgroups of 64 keys each:
    S^T = K Q^T and dP^T = V dO^T (SS, N = block_m); dV += P^T dO and dK += dS^T Q (RS, N =
    head_dim); dS^T stored; dQ = dS K by both warpgroups in halves of head_dim (whole panels),
    else by one of them whole, or (dq_transposed: FA3's dQ_swapAB, for block_m not a multiple of
    64) dQ^T = K^T dS^T by both, M = 64 head_dim columns each, N = block_m; dQ staged in fp32
    and read back by the TMA reduce-add; TMA writes Q and dO."""
    consumers = block_n // 64
    sdp = wgmma_group(block_m, head_dim, a_in_smem=True)
    dkv = wgmma_group(head_dim, block_m, a_in_smem=False)
    if dq_transposed:
        dq_groups, dq = head_dim // 64, wgmma_group(block_m, block_n, a_in_smem=True)
    else:
        assert block_m == 64, "dQ's M is one wgmma"
        halves = head_dim // 2 % 64 == 0
        dq_groups = 2 if halves else 1
        dq = wgmma_group(head_dim // 2 if halves else head_dim, block_n, a_in_smem=True)
    stores = block_n * block_m * ELEM + 2 * block_m * head_dim * 4   # dS^T; dQ fp32 out and back
    loads = 2 * block_m * head_dim * ELEM
    smem = consumers * 2 * (sdp[0] + dkv[0]) + dq_groups * dq[0] + stores + loads
    flop = consumers * 2 * (sdp[1] + dkv[1]) + dq_groups * dq[1]
    name = f"bwd hd{head_dim} {block_m}x{block_n}" + (" dQ^T" if dq_transposed else "")
    return Step(name, smem, flop, block_m * block_n)


def main() -> None:
    print(f"{'step':<44} {'port bytes':>11} {'port':>7} {'tensor':>7} {'ratio':>6} "
          f"{'port clk/1k pairs':>7}")
    # The shipped 4k-16k tiles (tuned_defaults.json, H200) first, then the alternatives.
    for step in (forward(128, 128, 128), forward(128, 160, 128), forward(128, 176, 128),
                 forward(192, 112, 64), forward(128, 80, 256), backward(64, 128, 128),
                 backward(64, 128, 64),
                 forward(192, 128, 128), forward(128, 128, 128, q_in_registers=True),
                 forward(128, 144, 128, q_in_registers=True), backward(80, 128, 128, True),
                 backward(128, 128, 64, True)):
        print(step.row())


if __name__ == "__main__":
    main()
