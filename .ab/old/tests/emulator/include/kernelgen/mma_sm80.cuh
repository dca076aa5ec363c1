// CPU stand-in for templates/include/kernelgen/mma_sm80.cuh. Fragment layouts follow the PTX ISA
// (g = lane / 4, t = lane % 4):
//   A 16x16: a0 (g, 2t..2t+1) | a1 (g+8, 2t..) | a2 (g, 2t+8..) | a3 (g+8, 2t+8..)
//   B 16x8 : b0 (k 2t..2t+1, n g) | b1 (k 2t+8..2t+9, n g)
//   C 16x8 : c0,c1 (g, 2t..2t+1) | c2,c3 (g+8, 2t..)
// ldmatrix: matrix i's rows come from lanes 8i..8i+7; lane L receives row L/4, columns
// 2(L%4)..+1 of each matrix, or with .trans column L/4, rows 2(L%4)..+1.
#pragma once
#include "kernelgen/types.cuh"

namespace kg {

template <class Elem> inline float emu_to_float(u16 h);
template <> inline float emu_to_float<bf16_t>(u16 h) { return emu::bf16_to_float(h); }
template <> inline float emu_to_float<half_t>(u16 h) { return emu::half_to_float(h); }

template <class Elem>
inline void emu_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    emu::WarpSlots& w = emu::my_warp();
    const int lane = emu::lane_id();
    for (int i = 0; i < 4; ++i) { w.in[lane][i] = a[i]; w.fin[lane][i] = d[i]; }
    w.in[lane][4] = b0;
    w.in[lane][5] = b1;
    emu::warp_collective(emu::kMma, [](emu::WarpSlots& s) {
        float A[16][16], B[16][8], C[16][8];
        auto lo = [](u32 x) { return emu_to_float<Elem>(u16(x & 0xffff)); };
        auto hi = [](u32 x) { return emu_to_float<Elem>(u16(x >> 16)); };
        for (int l = 0; l < 32; ++l) {
            const int g = l / 4, t = l % 4;
            const u32* r = s.in[l];
            A[g][2 * t] = lo(r[0]);         A[g][2 * t + 1] = hi(r[0]);
            A[g + 8][2 * t] = lo(r[1]);     A[g + 8][2 * t + 1] = hi(r[1]);
            A[g][2 * t + 8] = lo(r[2]);     A[g][2 * t + 9] = hi(r[2]);
            A[g + 8][2 * t + 8] = lo(r[3]); A[g + 8][2 * t + 9] = hi(r[3]);
            B[2 * t][g] = lo(r[4]);         B[2 * t + 1][g] = hi(r[4]);
            B[2 * t + 8][g] = lo(r[5]);     B[2 * t + 9][g] = hi(r[5]);
            C[g][2 * t] = s.fin[l][0];      C[g][2 * t + 1] = s.fin[l][1];
            C[g + 8][2 * t] = s.fin[l][2];  C[g + 8][2 * t + 1] = s.fin[l][3];
        }
        for (int l = 0; l < 32; ++l) {
            const int g = l / 4, t = l % 4;
            const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
            for (int e = 0; e < 4; ++e) {
                float acc = C[rows[e]][cols[e]];
                for (int k = 0; k < 16; ++k) acc += A[rows[e]][k] * B[k][cols[e]];
                s.fout[l][e] = acc;
            }
        }
    });
    for (int i = 0; i < 4; ++i) d[i] = w.fout[lane][i];
}

inline void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1, bf16_t) {
    emu_mma<bf16_t>(d, a, b0, b1);
}
inline void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1, half_t) {
    emu_mma<half_t>(d, a, b0, b1);
}

template <int N, bool TRANS>
inline void emu_ldmatrix(u32* r, u32 addr) {
    emu::WarpSlots& w = emu::my_warp();
    const int lane = emu::lane_id();
    w.in[lane][0] = addr;
    emu::warp_collective(emu::kLdm, [](emu::WarpSlots& s) {
        for (int l = 0; l < 8 * N; ++l) emu::check_smem(s.in[l][0], 16, 16);
        auto elem = [&](int matrix, int row, int col) {
            u16 v;
            memcpy(&v, smem + s.in[8 * matrix + row][0] + 2 * col, 2);
            return u32(v);
        };
        for (int l = 0; l < 32; ++l)
            for (int i = 0; i < N; ++i) {
                const int g = l / 4, t = l % 4;
                s.out[l][i] = TRANS ? elem(i, 2 * t, g) | (elem(i, 2 * t + 1, g) << 16)
                                    : elem(i, g, 2 * t) | (elem(i, g, 2 * t + 1) << 16);
            }
    });
    for (int i = 0; i < N; ++i) r[i] = w.out[lane][i];
}

inline void ldmatrix_x4(u32 (&r)[4], u32 addr) { emu_ldmatrix<4, false>(r, addr); }
inline void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) { emu_ldmatrix<4, true>(r, addr); }
inline void ldmatrix_x2(u32 (&r)[2], u32 addr) { emu_ldmatrix<2, false>(r, addr); }

inline void cp_async_16(u32 dst, const void* src, bool valid) { emu::cp_async(dst, src, 16, valid); }
inline void cp_async_4(u32 dst, const void* src, bool valid) { emu::cp_async(dst, src, 4, valid); }
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int N> inline void cp_async_wait() { emu::cp_async_wait(N); }

inline void red_add_f32x2(float* p, float a, float b) {
    if (reinterpret_cast<unsigned long long>(p) % 8) emu::fail("misaligned red.v2", 0);
    emu::check_global(p, 8);
    p[0] += a;
    p[1] += b;
}

}  // namespace kg
