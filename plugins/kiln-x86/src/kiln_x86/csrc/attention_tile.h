// kiln-x86 paged attention: the two products of a prefill tile (scores = Q . K^T, then
// output += P . V), written so that every row's bits depend on that row alone.
//
// Contract: row r of a product is computed by the same instructions in the same order whatever
// the tile's row count, the chunk's key count and the CPU's library: each score is one chain of
// fused multiply-adds over the head dimension (bf16: AVX512-BF16 dot products of pairs, in pair
// order), each output element one chain over the chunk's keys in key order. Rows are padded to
// kTileRows and keys to kKeyPad, so a single instantiation of each kernel ever runs, and no
// remainder loop rounds a tile's last rows differently. A prefix-cache hit's remaining prompt rows
// (or a later chunk of a long prompt) therefore get the bits the whole prompt's prefill gave them,
// on any CPU: a BLAS call, whose blocking and so whose rounding depends on the row count and the
// CPU (MKL's kernels on an AMD EPYC split the sums differently for 56 rows than for 64), cannot
// promise that.
//
// Layouts (row-major, float32 unless said): q [kTileRows-padded rows, dp]; keys transposed,
// kt [d, n_pad] (bf16 build with AVX512-BF16: pairs of elements in a uint32, [ceil(d / 2), n_pad]);
// s [rows, n_pad]; v [n_pad, dp]; o [rows, dp]. dp is d rounded up to 16 lanes (padding zero),
// n_pad the chunk's keys rounded up to kKeyPad (padding keys zero, masked by the caller).
#pragma once

#include <type_traits>

#include "attention_common.h"
#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KILN_X86_BF16_TILE 1
#include <immintrin.h>
#endif

namespace kiln_x86::attention {

using kiln_x86::to_float;

constexpr int64_t kTileRows = 4;  // query rows per pass of both products
// Vectors per pass: kTileRows x that many accumulators (16 with AVX-512, enough to hide the
// products' latency; with AVX2 a vf16 is two of its 16 registers).
#if defined(__AVX512F__)
constexpr int kPassVecs = 4;
#else
constexpr int kPassVecs = 2;
#endif
constexpr int64_t kKeyPad = 16;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// s[r, j] for kTileRows rows and kVecs * 16 keys from j0: float32 queries and keys.
template <int kVecs>
inline void scores_pass(const float* q, int64_t q_stride, int64_t d, const float* kt,
                        int64_t n_pad, int64_t j0, float* s) {
  vf16 acc[kTileRows][kVecs] = {};
  for (int64_t i = 0; i < d; ++i) {
    vf16 k[kVecs];
    for (int c = 0; c < kVecs; ++c) k[c] = load16(kt + i * n_pad + j0 + c * 16);
    for (int r = 0; r < kTileRows; ++r) {
      const float qi = q[r * q_stride + i];
      for (int c = 0; c < kVecs; ++c) acc[r][c] += qi * k[c];
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    for (int c = 0; c < kVecs; ++c) {
      std::memcpy(s + r * n_pad + j0 + c * 16, &acc[r][c], sizeof(vf16));
    }
  }
}

#if defined(KILN_X86_BF16_TILE)
// The same with bf16 pairs: q2 [kTileRows, dh], kt2 [dh, n_pad], dh = ceil(d / 2) uint32s.
template <int kVecs>
inline void scores_pass_bf16(const uint32_t* q2, int64_t dh, const uint32_t* kt2, int64_t n_pad,
                             int64_t j0, float* s) {
  __m512 acc[kTileRows][kVecs];
  for (auto& row : acc) {
    for (auto& a : row) a = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < dh; ++i) {
    __m512bh k[kVecs];
    for (int c = 0; c < kVecs; ++c) {
      k[c] = (__m512bh)_mm512_loadu_si512(kt2 + i * n_pad + j0 + c * 16);
    }
    for (int r = 0; r < kTileRows; ++r) {
      const __m512bh qi = (__m512bh)_mm512_set1_epi32(static_cast<int>(q2[r * dh + i]));
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qi, k[c]);
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(s + r * n_pad + j0 + c * 16, acc[r][c]);
  }
}
#endif

// o[r, c0 : c0 + 16 * kVecs] += sum over keys j of p[r, j] * v[j, ...], for kTileRows rows.
template <int kVecs>
inline void output_pass(const float* p, int64_t n_pad, const float* v, int64_t dp, int64_t c0,
                        float* o) {
  vf16 acc[kTileRows][kVecs];
  for (int r = 0; r < kTileRows; ++r) {
    for (int c = 0; c < kVecs; ++c) acc[r][c] = load16(o + r * dp + c0 + c * 16);
  }
  for (int64_t j = 0; j < n_pad; ++j) {
    vf16 x[kVecs];
    for (int c = 0; c < kVecs; ++c) x[c] = load16(v + j * dp + c0 + c * 16);
    for (int r = 0; r < kTileRows; ++r) {
      const float pj = p[r * n_pad + j];
      for (int c = 0; c < kVecs; ++c) acc[r][c] += pj * x[c];
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    for (int c = 0; c < kVecs; ++c) std::memcpy(o + r * dp + c0 + c * 16, &acc[r][c], sizeof(vf16));
  }
}

// Every (kTileRows-padded) row's output: passes of kPassVecs vectors, then of one (an element's
// chain of products is the same in either).
inline void output_product(const float* p, int64_t rows_pad, int64_t n_pad, const float* v,
                           int64_t dp, float* o) {
  for (int64_t r = 0; r < rows_pad; r += kTileRows) {
    const float* pr = p + r * n_pad;
    float* orow = o + r * dp;
    int64_t c0 = 0;
    for (; c0 + 16 * kPassVecs <= dp; c0 += 16 * kPassVecs) {
      output_pass<kPassVecs>(pr, n_pad, v, dp, c0, orow);
    }
    for (; c0 < dp; c0 += 16) output_pass<1>(pr, n_pad, v, dp, c0, orow);
  }
}

// A chunk's keys and values, copied from the paged cache into the products' layouts, and the
// tile's queries: float32 for float32 caches, and for bf16 ones without AVX512-BF16 (widened
// exactly); bf16 pairs for the scores where the CPU has AVX512-BF16.
template <typename T>
struct TileOperands {
#if defined(KILN_X86_BF16_TILE)
  static constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
#else
  static constexpr bool kPairs = false;
#endif

  // Query row `r` (d elements) into the q buffer.
  static void put_query(const T* src, int64_t d, int64_t dp, int64_t r, float* q) {
    if constexpr (kPairs) {
      const int64_t dh = (d + 1) / 2;
      auto* q2 = reinterpret_cast<uint32_t*>(q) + r * dh;
      for (int64_t i = 0; i < dh; ++i) q2[i] = pair(src, d, 2 * i);
    } else {
      for (int64_t i = 0; i < d; ++i) q[r * dp + i] = to_float(src[i]);
    }
  }

  // Key `j` of the chunk (d elements) into column j of the transposed key buffer.
  static void put_key(const T* src, int64_t d, int64_t n_pad, int64_t j, float* kt) {
    if constexpr (kPairs) {
      auto* kt2 = reinterpret_cast<uint32_t*>(kt);
      for (int64_t i = 0; i < (d + 1) / 2; ++i) kt2[i * n_pad + j] = pair(src, d, 2 * i);
    } else {
      for (int64_t i = 0; i < d; ++i) kt[i * n_pad + j] = to_float(src[i]);
    }
  }

  // s [rows_pad, n_pad] for every row of the q buffer: passes of kPassVecs key vectors, then of
  // one (a score's chain of products is the same in either).
  static void scores(const float* q, int64_t rows_pad, int64_t d, int64_t dp, const float* kt,
                     int64_t n_pad, float* s) {
    for (int64_t r = 0; r < rows_pad; r += kTileRows) {
      int64_t j0 = 0;
      for (; j0 + 16 * kPassVecs <= n_pad; j0 += 16 * kPassVecs) {
        scores_pass<kPassVecs>(q, r, d, dp, kt, n_pad, j0, s);
      }
      for (; j0 < n_pad; j0 += 16) scores_pass<1>(q, r, d, dp, kt, n_pad, j0, s);
    }
  }

  // Zeroes the key buffer's padding columns [n, n_pad).
  static void pad_keys(int64_t n, int64_t n_pad, int64_t d, float* kt) {
    if constexpr (kPairs) {
      auto* kt2 = reinterpret_cast<uint32_t*>(kt);
      for (int64_t i = 0; i < (d + 1) / 2; ++i) std::fill(kt2 + i * n_pad + n, kt2 + (i + 1) * n_pad, 0u);
    } else {
      for (int64_t i = 0; i < d; ++i) std::fill(kt + i * n_pad + n, kt + (i + 1) * n_pad, 0.0f);
    }
  }

  // Zeroes query rows [rows, rows_pad).
  static void pad_queries(int64_t rows, int64_t rows_pad, int64_t d, int64_t dp, float* q) {
    if constexpr (kPairs) {
      const int64_t dh = (d + 1) / 2;
      auto* q2 = reinterpret_cast<uint32_t*>(q);
      std::fill(q2 + rows * dh, q2 + rows_pad * dh, 0u);
    } else {
      std::fill(q + rows * dp, q + rows_pad * dp, 0.0f);
    }
  }

 private:
  template <int kVecs>
  static void scores_pass(const float* q, int64_t r, int64_t d, int64_t dp, const float* kt,
                          int64_t n_pad, int64_t j0, float* s) {
    if constexpr (kPairs) {
#if defined(KILN_X86_BF16_TILE)
      const int64_t dh = (d + 1) / 2;
      scores_pass_bf16<kVecs>(reinterpret_cast<const uint32_t*>(q) + r * dh, dh,
                              reinterpret_cast<const uint32_t*>(kt), n_pad, j0, s + r * n_pad);
#endif
    } else {
      kiln_x86::attention::scores_pass<kVecs>(q + r * dp, dp, d, kt, n_pad, j0, s + r * n_pad);
    }
  }

  // Elements i and i + 1 of a bf16 row as one uint32 (the second zero past the row's end).
  static uint32_t pair(const T* src, int64_t d, int64_t i) {
    uint16_t lo, hi = 0;
    std::memcpy(&lo, src + i, sizeof(lo));
    if (i + 1 < d) std::memcpy(&hi, src + i + 1, sizeof(hi));
    return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
};

}  // namespace kiln_x86::attention
