// kiln-x86 paged attention: the two products of a prefill tile (scores = Q . K^T, then
// output += P . V), written so that every row's bits depend on that row alone.
//
// Contract: row r of a product is computed by the same instructions in the same order whatever
// the tile's row count, the chunk's key count and the CPU's library: each score is one chain of
// fused multiply-adds over the head dimension (bf16: AVX512-BF16 dot products of pairs, in pair
// order), each output element one chain over the chunk's keys in key order (bf16 with
// AVX512-BF16: dot products of pairs of keys, the probabilities rounded to bf16, as flash
// attention does; float32 caches and CPUs without AVX512-BF16: float32 FMAs). Rows are padded to
// kTileRows and keys to kKeyPad, so a single instantiation of each kernel ever runs, and no
// remainder loop rounds a tile's last rows differently. A prefix-cache hit's remaining prompt rows
// (or a later chunk of a long prompt) therefore get the bits the whole prompt's prefill gave them,
// on any CPU: a BLAS call, whose blocking and so whose rounding depends on the row count and the
// CPU (MKL's kernels on an AMD EPYC split the sums differently for 56 rows than for 64), cannot
// promise that.
//
// Layouts (row-major, float32 unless said): q [kTileRows-padded rows, dp]; a packed chunk of keys
// (TileOperands): keys transposed, kt [d, ld] (bf16 pairs of head elements in a uint32 with
// AVX512-BF16: [ceil(d / 2), ld]), then values, v [ld, dp] (bf16 pairs of keys: [ld / 2, dp]);
// s [rows, n_pad]; o [rows, dp]. dp is d rounded up to 16 lanes (padding zero), ld the chunk's
// keys rounded up to kKeyPad, n_pad the keys a tile reads of it (rounded up to kKeyPad; padding
// keys zero, masked by the caller).
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

// s[r, j] for kTileRows rows and kVecs * 16 keys from j0: float32 queries and keys (kt's rows
// `ld` apart, s's n_pad).
template <int kVecs>
inline void scores_pass(const float* q, int64_t q_stride, int64_t d, const float* kt, int64_t ld,
                        int64_t n_pad, int64_t j0, float* s) {
  vf16 acc[kTileRows][kVecs] = {};
  for (int64_t i = 0; i < d; ++i) {
    vf16 k[kVecs];
    for (int c = 0; c < kVecs; ++c) k[c] = load16(kt + i * ld + j0 + c * 16);
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
// The same with bf16 pairs: q2 [kTileRows, dh], kt2 [dh, ld], dh = ceil(d / 2) uint32s.
template <int kVecs>
inline void scores_pass_bf16(const uint32_t* q2, int64_t dh, const uint32_t* kt2, int64_t ld,
                             int64_t n_pad, int64_t j0, float* s) {
  __m512 acc[kTileRows][kVecs];
  for (auto& row : acc) {
    for (auto& a : row) a = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < dh; ++i) {
    __m512bh k[kVecs];
    for (int c = 0; c < kVecs; ++c) {
      k[c] = (__m512bh)_mm512_loadu_si512(kt2 + i * ld + j0 + c * 16);
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

#if defined(KILN_X86_BF16_TILE)
// o[r, c0 : c0 + 16 * kVecs] += sum over key pairs i of p[r, 2i..2i+1] . v2[i, ...]: bf16
// probabilities p16 (row r at p16 + r * p_stride, n_pad of them) and values in pairs of keys,
// v2 [n_pad / 2, dp] (uint32: key 2i low, 2i + 1 high), one dot product of pairs per key pair.
template <int kVecs>
inline void output_pass_bf16(const uint16_t* p16, int64_t p_stride, int64_t n_pad,
                             const uint32_t* v2, int64_t dp, int64_t c0, float* o) {
  __m512 acc[kTileRows][kVecs];
  for (int r = 0; r < kTileRows; ++r) {
    for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_loadu_ps(o + r * dp + c0 + c * 16);
  }
  for (int64_t i = 0; i < n_pad / 2; ++i) {
    __m512bh x[kVecs];
    for (int c = 0; c < kVecs; ++c) {
      x[c] = (__m512bh)_mm512_loadu_si512(v2 + i * dp + c0 + c * 16);
    }
    for (int r = 0; r < kTileRows; ++r) {
      uint32_t pair;
      std::memcpy(&pair, p16 + r * p_stride + 2 * i, sizeof(pair));
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pr, x[c]);
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(o + r * dp + c0 + c * 16, acc[r][c]);
  }
}

inline void output_product_bf16(const uint16_t* p16, int64_t p_stride, int64_t rows_pad,
                                int64_t n_pad, const uint32_t* v2, int64_t dp, float* o) {
  for (int64_t r = 0; r < rows_pad; r += kTileRows) {
    const uint16_t* pr = p16 + r * p_stride;
    float* orow = o + r * dp;
    int64_t c0 = 0;
    for (; c0 + 16 * kPassVecs <= dp; c0 += 16 * kPassVecs) {
      output_pass_bf16<kPassVecs>(pr, p_stride, n_pad, v2, dp, c0, orow);
    }
    for (; c0 < dp; c0 += 16) output_pass_bf16<1>(pr, p_stride, n_pad, v2, dp, c0, orow);
  }
}
#endif

// A chunk's keys and values, packed from the paged cache into the products' layouts once per
// (request, kv head, chunk) for all the tiles that read it, and the tile's queries. float32 for
// float32 caches and for bf16 ones without AVX512-BF16 (widened exactly): keys transposed
// [d, ld], values [ld, dp]. bf16 caches where the CPU has AVX512-BF16 (kPairs): keys in pairs of
// head elements [ceil(d / 2), ld], values in pairs of keys [ld / 2, dp], and both products are
// dot products of bf16 pairs (the probabilities rounded to bf16 for the second).
template <typename T>
struct TileOperands {
#if defined(KILN_X86_BF16_TILE)
  static constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
#else
  static constexpr bool kPairs = false;
#endif
#if defined(KILN_X86_F32_PROBS)  // float32 probabilities (benchmarks/attention_bench.py
                                  // --f32-probabilities builds it to time the difference)
  static constexpr bool kPairProbs = false;
#else
  static constexpr bool kPairProbs = kPairs;
#endif

  // Floats (4-byte words) of one packed chunk of `ld` keys (a multiple of kKeyPad).
  static int64_t key_words(int64_t d, int64_t ld) { return (kPairs ? (d + 1) / 2 : d) * ld; }
  static int64_t chunk_words(int64_t d, int64_t dp, int64_t ld) {
    return key_words(d, ld) + (kPairProbs ? ld / 2 : ld) * dp;
  }

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

  // Keys and values j < n of one chunk (row j's elements at key_cache + offset(j), d of them,
  // and the same offset in value_cache) into `chunk`; keys [n, ld) are zero.
  template <typename Offset>
  static void pack_chunk(const T* key_cache, const T* value_cache, const Offset& offset,
                         int64_t n, int64_t d, int64_t dp, int64_t ld, float* chunk) {
    float* kt = chunk;
    float* v = chunk + key_words(d, ld);
    std::fill(chunk, chunk + chunk_words(d, dp, ld), 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = offset(j);
      if constexpr (kPairs) {
        auto* kt2 = reinterpret_cast<uint32_t*>(kt);
        for (int64_t i = 0; i < (d + 1) / 2; ++i) kt2[i * ld + j] = pair(key_cache + at, d, 2 * i);
      } else {
        for (int64_t i = 0; i < d; ++i) kt[i * ld + j] = to_float(key_cache[at + i]);
      }
      const T* src = value_cache + at;
      if constexpr (kPairProbs) {
        // Key j's value element c is the (j % 2) half of pair (j / 2, c).
        uint16_t* dst = reinterpret_cast<uint16_t*>(v) + (j / 2) * dp * 2 + (j % 2);
        for (int64_t c = 0; c < d; ++c) std::memcpy(dst + 2 * c, src + c, sizeof(uint16_t));
      } else {
        for (int64_t i = 0; i < d; ++i) v[j * dp + i] = to_float(src[i]);
      }
    }
  }

  // s [rows_pad, n_pad] for every row of the q buffer against the chunk's first n_pad keys:
  // passes of kPassVecs key vectors, then of one (a score's chain of products is the same in
  // either).
  static void scores(const float* q, int64_t rows_pad, int64_t d, int64_t dp, const float* chunk,
                     int64_t ld, int64_t n_pad, float* s) {
    for (int64_t r = 0; r < rows_pad; r += kTileRows) {
      int64_t j0 = 0;
      for (; j0 + 16 * kPassVecs <= n_pad; j0 += 16 * kPassVecs) {
        scores_pass<kPassVecs>(q, r, d, dp, chunk, ld, n_pad, j0, s);
      }
      for (; j0 < n_pad; j0 += 16) scores_pass<1>(q, r, d, dp, chunk, ld, n_pad, j0, s);
    }
  }

  // o += P . V over the chunk's first n_pad keys; s holds the probabilities (kPairs: rounded to
  // bf16 in place, each row's n_pad values at the start of its row).
  static void output(const float* s, int64_t rows_pad, int64_t n_pad, const float* chunk,
                     int64_t d, int64_t dp, int64_t ld, float* o) {
    const float* v = chunk + key_words(d, ld);
    if constexpr (kPairProbs) {
#if defined(KILN_X86_BF16_TILE)
      output_product_bf16(reinterpret_cast<const uint16_t*>(s), 2 * n_pad, rows_pad, n_pad,
                          reinterpret_cast<const uint32_t*>(v), dp, o);
#endif
    } else {
      output_product(s, rows_pad, n_pad, v, dp, o);
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
                          int64_t ld, int64_t n_pad, int64_t j0, float* s) {
    if constexpr (kPairs) {
#if defined(KILN_X86_BF16_TILE)
      const int64_t dh = (d + 1) / 2;
      scores_pass_bf16<kVecs>(reinterpret_cast<const uint32_t*>(q) + r * dh, dh,
                              reinterpret_cast<const uint32_t*>(kt), ld, n_pad, j0,
                              s + r * n_pad);
#endif
    } else {
      kiln_x86::attention::scores_pass<kVecs>(q + r * dp, dp, d, kt, ld, n_pad, j0,
                                              s + r * n_pad);
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
