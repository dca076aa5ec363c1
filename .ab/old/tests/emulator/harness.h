// main() of an emulated kernel: reads the launch (argv[1]) and the device arena (argv[2]), runs
// the grid, writes the arena back (argv[3]). The launch file is text, one item per line:
//   grid X Y Z | threads N | smem BYTES | seed S | defer 0|1 | alloc OFFSET BYTES |
//   ptr OFFSET | i32 V | i64 V | f32 BITS |    (the kernel arguments, in order)
//   tmap W0 .. W15                             (a tensor map's 16 words, W0 an arena offset)
#pragma once
#include <string>

#include "cuda_emu.h"

namespace emu {

struct Launch {
    emu_dim3 grid;
    int threads = 0;
    unsigned smem = 0;
    std::vector<unsigned long long> values;  // arguments: pointer offsets or raw scalar bits
    std::vector<std::vector<unsigned long long>> maps;  // tensor maps (values[i] indexes them)
};

inline unsigned char* g_arena = nullptr;
inline Launch g_launch;

inline void* arg_ptr(int i) {
    return g_launch.values[i] == ~0ull ? nullptr : g_arena + g_launch.values[i];
}
inline const void* arg_map(int i) { return g_launch.maps[g_launch.values[i]].data(); }
inline int arg_i32(int i) { return static_cast<int>(g_launch.values[i]); }
inline long long arg_i64(int i) { return static_cast<long long>(g_launch.values[i]); }
inline float arg_f32(int i) {
    const unsigned bits = static_cast<unsigned>(g_launch.values[i]);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

inline int harness_main(int argc, char** argv, void (*body)()) {
    if (argc != 4) fail("usage: kernel LAUNCH ARENA_IN ARENA_OUT");
    FILE* in = fopen(argv[2], "rb");
    if (!in) fail("cannot open the arena");
    fseek(in, 0, SEEK_END);
    const long size = ftell(in);
    fseek(in, 0, SEEK_SET);
    g_arena = static_cast<unsigned char*>(aligned_alloc(4096, (size + 4095) / 4096 * 4096));
    if (fread(g_arena, 1, size, in) != size_t(size)) fail("short arena read");
    fclose(in);

    FILE* launch = fopen(argv[1], "r");
    if (!launch) fail("cannot open the launch file");
    char key[16];
    unsigned long long a, b, c;
    Runtime& r = rt();
    while (fscanf(launch, "%15s", key) == 1) {
        const std::string k = key;
        if (k == "grid") { fscanf(launch, "%llu %llu %llu", &a, &b, &c); g_launch.grid = {unsigned(a), unsigned(b), unsigned(c)}; }
        else if (k == "threads") { fscanf(launch, "%llu", &a); g_launch.threads = int(a); }
        else if (k == "smem") { fscanf(launch, "%llu", &a); g_launch.smem = unsigned(a); }
        else if (k == "seed") { fscanf(launch, "%llu", &a); r.rng.seed(unsigned(a)); }
        else if (k == "defer") { fscanf(launch, "%llu", &a); r.defer_copies = a != 0; }
        else if (k == "alloc") { fscanf(launch, "%llu %llu", &a, &b); r.allocations.push_back({g_arena + a, g_arena + a + b}); }
        else if (k == "null") { g_launch.values.push_back(~0ull); }
        else if (k == "tmap") {  // the first word locates the tensor: made an absolute address
            std::vector<unsigned long long> words(16);
            for (auto& w : words) fscanf(launch, "%llu", &w);
            words[0] += reinterpret_cast<unsigned long long>(g_arena);
            g_launch.values.push_back(g_launch.maps.size());
            g_launch.maps.push_back(words);
        }
        else if (k == "ptr" || k == "i32" || k == "i64" || k == "f32") {
            long long v;
            fscanf(launch, "%lld", &v);
            g_launch.values.push_back(static_cast<unsigned long long>(v));
        } else fail("unknown launch key");
    }
    fclose(launch);

    run_grid(body, g_launch.grid, g_launch.threads, g_launch.smem);

    FILE* out = fopen(argv[3], "wb");
    if (!out || fwrite(g_arena, 1, size, out) != size_t(size)) fail("cannot write the arena");
    fclose(out);
    return 0;
}

}  // namespace emu
