// verispec's multi-column kernels alone, on random blocks: time per call and GMAC/s a core at each width, and a
// candidate kernel file checked bitwise against the patched one and timed beside it; a table, then one JSON line.
// Rows "Q8_K": the quantization of the width's activation columns (K values each; the rate in G values/s), the
// candidate's against the patched file's (both vectorized; tests/backends/test_llama_kernels.py checks the patched
// one against ggml's reference through a model's logits). A zero block, a tie for the largest magnitude, a NaN and
// an infinity are among the columns.
// Built and run by bench/multicol_kernels.sh (one thread).
//
//   multicol_kernels WIDTHS REPEATS K:ROWS...     e.g. 1,9,16,36 5 1536:1024 8960:256 (ROWS a multiple of 8)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ggml-common.h"
#include "repack.h"

extern "C" {
float ggml_table_f32_f16[1 << 16];  // what ggml-cpu fills at start: GGML_CPU_FP16_TO_FP32 reads it
void ggml_abort(const char *, int, const char *, ...) { abort(); }
// the patched kernels (reference) and the candidate's, compiled apart with their names changed
void ref_q4(int n, float * dst, size_t dst_stride, const void * vx, const void * vy, size_t vy_stride, int nrows,
            int ncols);
void ref_q6(int n, float * dst, size_t dst_stride, const void * vx, size_t bx, const void * vy, size_t vy_stride,
            int nrows, int ncols);
void new_q4(int n, float * dst, size_t dst_stride, const void * vx, const void * vy, size_t vy_stride, int nrows,
            int ncols);
void new_q6(int n, float * dst, size_t dst_stride, const void * vx, size_t bx, const void * vy, size_t vy_stride,
            int nrows, int ncols);
bool ref_quantize(const float * x, void * y, int64_t k);
bool new_quantize(const float * x, void * y, int64_t k);
}

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000) << 16, exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff, bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) {  // subnormal
        int shift = 0;
        while (!(man & 0x400)) { man <<= 1; shift++; }
        bits = sign | ((uint32_t) (127 - 15 - shift + 1) << 23) | ((man & 0x3ff) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp - 15 + 127) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t small_half(std::mt19937 & rng) {  // a positive fp16 in [2^-14, 2^-6): a weight block's scale
    return (uint16_t) ((1 + rng() % 8) << 10 | (rng() & 0x3ff));
}

static void fill(std::mt19937 & rng, void * p, size_t n) {
    for (size_t i = 0; i < n; i++) ((uint8_t *) p)[i] = (uint8_t) rng();
}

template <class F> static double best_of(int repeats, F f) {
    double best = 1e30;
    for (int r = 0; r < repeats; r++) {
        const auto t0 = std::chrono::steady_clock::now();
        f();
        const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = t < best ? t : best;
    }
    return best;
}

// One shape: every width, both types; a table row and a JSON object each.
static void measure(int K, int R, const std::vector<int> & widths, int repeats, std::string & json) {
    int max_w = 0;
    for (int w : widths) max_w = w > max_w ? w : max_w;
    const int nb = K / QK_K;
    std::mt19937 rng(1);
    std::vector<block_q8_K> y((size_t) nb * max_w);  // activations as ggml quantizes them: |q| <= 127, exact bsums
    for (auto & b : y) {
        b.d = 0.01f * (1 + rng() % 100);
        for (int i = 0; i < QK_K; i++) b.qs[i] = (int8_t) ((int) (rng() % 255) - 127);
        for (int j = 0; j < QK_K / 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += b.qs[16 * j + i];
            b.bsums[j] = (int16_t) s;
        }
    }
    std::vector<block_q6_K> x6((size_t) nb * R);
    for (auto & b : x6) {
        fill(rng, b.ql, sizeof b.ql);
        fill(rng, b.qh, sizeof b.qh);
        fill(rng, b.scales, sizeof b.scales);
        b.d = small_half(rng);
    }
    std::vector<block_q4_Kx8> x4((size_t) nb * R / 8);
    for (auto & b : x4) {
        fill(rng, b.qs, sizeof b.qs);
        fill(rng, b.scales, sizeof b.scales);
        for (int i = 0; i < 8; i++) {
            b.d[i] = small_half(rng);
            b.dmin[i] = small_half(rng);
        }
    }
    std::vector<float> a((size_t) R * max_w), b((size_t) R * max_w);
    const size_t ys = sizeof(block_q8_K) * nb, x6s = sizeof(block_q6_K) * nb;
    std::vector<float> act((size_t) K * max_w);  // activations as a layer's output: mostly small, a few outliers
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < act.size(); i++) act[i] = i % 97 == 0 ? 40.0f * normal(rng) : normal(rng);
    if (nb * max_w >= 4) {  // blocks 0-3: zeros; +-1000 tied for the largest (- first); a NaN; an infinity
        std::fill(act.begin(), act.begin() + QK_K, 0.0f);
        act[QK_K + 7] = -1000.0f;
        act[QK_K + 200] = 1000.0f;
        act[2 * QK_K + 3] = NAN;
        act[3 * QK_K + 100] = INFINITY;
    }
    std::vector<block_q8_K> qa((size_t) nb * max_w), qb((size_t) nb * max_w);
    for (int w : widths) {
        for (int kind = 0; kind < 3; kind++) {  // Q4_K, Q6_K, Q8_K (quantization)
            bool quantized = true;  // false: a quantizer declined (its kernels off), the Q8_K row means nothing
            auto run = [&](bool patched, float * dst) {
                if (kind == 2) {
                    auto quantize = patched ? ref_quantize : new_quantize;
                    quantized &= quantize(act.data(), (patched ? qa : qb).data(), (int64_t) K * w);
                } else if (kind == 1) {
                    (patched ? ref_q6 : new_q6)(K, dst, R, x6.data(), x6s, y.data(), ys, R, w);
                } else {
                    (patched ? ref_q4 : new_q4)(K, dst, R, x4.data(), y.data(), ys, R, w);
                }
            };
            run(true, a.data());
            run(false, b.data());
            const bool same = kind == 2 ? quantized && !memcmp(qa.data(), qb.data(), sizeof(block_q8_K) * nb * w)
                                        : !memcmp(a.data(), b.data(), sizeof(float) * (size_t) R * w);
            double t_ref = 1e30, t_new = 1e30;
            for (int r = 0; r < repeats; r++) {  // the two take turns
                const double tr = best_of(1, [&] { run(true, a.data()); });
                const double tn = best_of(1, [&] { run(false, b.data()); });
                t_ref = tr < t_ref ? tr : t_ref;
                t_new = tn < t_new ? tn : t_new;
            }
            const double macs = kind == 2 ? (double) K * w : (double) K * R * w;
            const char * type = kind == 2 ? "Q8_K" : kind == 1 ? "Q6_K" : "Q4_K";
            printf("%-5s %-5d %-5d %-6d %10.3f  %6.0f  %12.3f  %6.0f  %17.3f  %s\n", type, K, R, w, t_ref * 1e3,
                   macs / t_ref / 1e9, t_new * 1e3, macs / t_new / 1e9, t_new / t_ref,
                   !quantized ? "off" : same ? "identical" : "DIFFER");
            char row[256];
            snprintf(row, sizeof row,
                     "%s{\"type\": \"%s\", \"k\": %d, \"rows\": %d, \"width\": %d, \"patched_ms\": %.4f, "
                     "\"candidate_ms\": %.4f, \"identical\": %s}",
                     json.empty() ? "" : ", ", type, K, R, w, t_ref * 1e3, t_new * 1e3, same ? "true" : "false");
            json += row;
        }
    }
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s WIDTHS REPEATS K:ROWS...\n", argv[0]);
        return 2;
    }
    for (int i = 0; i < (1 << 16); i++) ggml_table_f32_f16[i] = half_to_float((uint16_t) i);
    std::vector<int> widths;
    for (char * t = strtok(argv[1], ","); t; t = strtok(nullptr, ",")) widths.push_back(atoi(t));
    const int repeats = atoi(argv[2]);
    printf("type  K     rows  width  patched ms  GMAC/s  candidate ms  GMAC/s  candidate/patched  bits\n");
    std::string json;
    for (int i = 3; i < argc; i++) {
        int K = 0, R = 0;
        if (sscanf(argv[i], "%d:%d", &K, &R) != 2 || K <= 0 || K % QK_K || R <= 0 || R % 8 || repeats <= 0) {
            fprintf(stderr, "a shape is K:ROWS, K a multiple of %d, ROWS of 8 (got %s)\n", QK_K, argv[i]);
            return 2;
        }
        measure(K, R, widths, repeats, json);
    }
    printf("{\"kernels\": [%s]}\n", json.c_str());
    return 0;
}
