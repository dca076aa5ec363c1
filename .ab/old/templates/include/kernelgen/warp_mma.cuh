// Warp-level GEMM steps over padded row-major shared-memory tiles, built on the mma.sync and
// ldmatrix primitives with the forward's lane addressing (no inline PTX here).
#pragma once
#include "kernelgen/mma_sm80.cuh"

namespace kg {

// ldmatrix lane offsets: ROWS_A gives lane L the row L%16, column (L/16)*8 of a 16x16 block (the A
// fragment, or with .trans two n8 B tiles of a [k][n] block); ROWS_B gives row L%8 + (L/16)*8,
// column ((L/8)%2)*8 (two n8 B tiles of an [n][k] block, or with .trans the A fragment of [k][m]).
template <int PITCH> __device__ __forceinline__ u32 lane_offset_rows_a(int lane) {
    return ((lane % 16) * PITCH + (lane / 16) * 8) * 2;
}
template <int PITCH> __device__ __forceinline__ u32 lane_offset_rows_b(int lane) {
    return ((lane % 8 + (lane / 16) * 8) * PITCH + ((lane / 8) % 2) * 8) * 2;
}

// acc[mt][nt] += A B^T over K_STEPS k16 steps, where A (MT m16 tiles of rows at a_tile) and B (NT
// n8 tiles of rows at b_tile) are both row-major [row][k] with a pitch of PITCH elements: every
// product of the S = Q K^T kind. An odd NT ends with a two-matrix ldmatrix.
template <class Elem, int MT, int NT, int K_STEPS, int PITCH>
__device__ __forceinline__ void warp_mma_rows(float (&acc)[MT][NT][4], u32 a_tile, u32 b_tile,
                                              int lane) {
    const u32 a_lane = a_tile + lane_offset_rows_a<PITCH>(lane);
    const u32 b_lane = b_tile + lane_offset_rows_b<PITCH>(lane);
    #pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk) {
        u32 af[MT][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af[mt], a_lane + (mt * 16 * PITCH + kk * 16) * 2);
        #pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 bf[4];
            ldmatrix_x4(bf, b_lane + (np * 16 * PITCH + kk * 16) * 2);
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816(acc[mt][2 * np], af[mt], bf[0], bf[1], Elem{});
                mma_16816(acc[mt][2 * np + 1], af[mt], bf[2], bf[3], Elem{});
            }
        }
        if constexpr (NT % 2 == 1) {
            u32 bf[2];
            ldmatrix_x2(bf, b_lane + ((NT - 1) * 8 * PITCH + kk * 16) * 2);
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma_16816(acc[mt][NT - 1], af[mt], bf[0], bf[1], Elem{});
        }
    }
}

// acc[mt][nt] += a[mt] B for one k16 step, where B is 16 rows of a row-major [k][n] tile at b_tile
// (pitch PITCH elements, NT n8 tiles of columns, NT even), read transposed: V in O = P V.
template <class Elem, int MT, int NT, int PITCH>
__device__ __forceinline__ void warp_mma_step_kn(float (&acc)[MT][NT][4], const u32 (&a)[MT][4],
                                                 u32 b_tile, int lane) {
    static_assert(NT % 2 == 0, "B is read as pairs of n8 tiles");
    const u32 b_lane = b_tile + lane_offset_rows_a<PITCH>(lane);
    #pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
        u32 bf[4];
        ldmatrix_x4_trans(bf, b_lane + np * 16 * 2);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            mma_16816(acc[mt][2 * np], a[mt], bf[0], bf[1], Elem{});
            mma_16816(acc[mt][2 * np + 1], a[mt], bf[2], bf[3], Elem{});
        }
    }
}

}  // namespace kg
