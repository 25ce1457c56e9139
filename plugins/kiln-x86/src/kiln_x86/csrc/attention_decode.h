// kiln-x86 paged attention: the decode kernel (one query token) with AVX-512 intrinsics, for
// float32 caches (AVX512F) and bfloat16 caches (AVX512-BF16 dot products).
//
// Contract: decode_avx512<T>(problem, item, ...) fills the scratch's o, m and l rows of the item's
// query heads exactly as x86_attention.cpp's portable attend_token does (unnormalized float32
// output, running max and sum), and returns true; it returns false, having done nothing, where the
// build or the head size has no kernel here (the caller then runs the portable one). The build is
// -march=native, so "here" is this CPU: a CPU without AVX512-BF16 builds its own extension, where
// bfloat16 takes the portable path.
//
// How: the context is walked 16 positions at a time, whatever the block size, with each position's
// cache offset taken from the block table (no copy of K or V, no allocation). For each of the query
// heads sharing the KV head (up to 4 per pass, so each K/V row is loaded from memory once for all
// of them), 16 dot products (bf16: _mm512_dpbf16_ps on the cache's own bf16 rows, exact products,
// float32 sums) are folded into one vector of 16 scores by a transposing add tree; an online
// softmax updates the running max and sum; then the probabilities, kept in float32, multiply the
// values, each V row widened to float32 in registers. bf16 widening without shuffles: a 32-bit
// lane holding elements (2i, 2i+1) gives element 2i by a left shift and 2i+1 by a mask, so the
// accumulators hold even, then odd elements, put back in order once at the end. The next 16 rows
// are prefetched into L1 while these are computed, and the 16 rows three chunks ahead into L2:
// blocks lie anywhere in the cache, where no hardware prefetcher follows, and one chunk's compute
// is shorter than a trip to memory (three ahead: 1.04-1.43x over one ahead, 30 layers' caches,
// docs/x86/attention.md).
#pragma once

#include "attention_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define KILN_X86_AVX512_DECODE 1
#include <immintrin.h>
#endif

namespace kiln_x86::attention {

#if defined(KILN_X86_AVX512_DECODE)

constexpr int kDecodeKeys = 16;  // keys per step: one vector of scores
#ifndef KILN_X86_AHEAD_CHUNKS
#define KILN_X86_AHEAD_CHUNKS 3
#endif
constexpr int kAheadKeys = KILN_X86_AHEAD_CHUNKS * kDecodeKeys;  // L2 prefetch distance

// How one dtype's cache rows are loaded. kPerLoad elements per 512-bit load, which widen to kWide
// float32 vectors; `store` puts a load's kWide accumulators back in element order.
template <typename T>
struct DecodeRows {
  static constexpr bool kAvailable = false;
};

template <>
struct DecodeRows<float> {
  static constexpr bool kAvailable = true;
  static constexpr int kPerLoad = 16;
  static constexpr int kWide = 1;
  using QVec = __m512;
  static QVec load_q(const float* q) { return _mm512_loadu_ps(q); }
  static __m512 dot(__m512 acc, QVec q, const float* k) {
    return _mm512_fmadd_ps(q, _mm512_loadu_ps(k), acc);
  }
  static void widen(const float* v, __m512* w) { w[0] = _mm512_loadu_ps(v); }
  static void store(const float* acc, float* dst) { _mm512_storeu_ps(dst, _mm512_load_ps(acc)); }
};

#if defined(__AVX512BF16__)
template <>
struct DecodeRows<c10::BFloat16> {
  static constexpr bool kAvailable = true;
  static constexpr int kPerLoad = 32;
  static constexpr int kWide = 2;  // even elements, then odd ones
  using QVec = __m512bh;
  static QVec load_q(const c10::BFloat16* q) { return (__m512bh)_mm512_loadu_si512(q); }
  static __m512 dot(__m512 acc, QVec q, const c10::BFloat16* k) {
    return _mm512_dpbf16_ps(acc, q, (__m512bh)_mm512_loadu_si512(k));
  }
  static void widen(const c10::BFloat16* v, __m512* w) {
    const __m512i x = _mm512_loadu_si512(v);
    w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    w[1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(0xffff0000u)));
  }
  static void store(const float* acc, float* dst) {
    const __m512 even = _mm512_load_ps(acc), odd = _mm512_load_ps(acc + 16);
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    _mm512_storeu_ps(dst, _mm512_permutex2var_ps(even, lo, odd));
    _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(even, hi, odd));
  }
};
#endif

// Cache offsets (block and slot; the KV head's is the caller's) of the kDecodeKeys positions from
// `pos`; those at or past `end` repeat `pos`'s, a row that is read and then masked.
inline void chunk_offsets(const Problem& p, const int32_t* table, int64_t pos, int64_t end,
                          int64_t* offset) {
  int64_t block = pos / p.block_size, slot = pos % p.block_size;
  if (slot + kDecodeKeys <= p.block_size && pos + kDecodeKeys <= end) {  // in one block
    const int64_t first = table[block] * p.kv_stride_block + slot * p.kv_stride_slot;
    for (int j = 0; j < kDecodeKeys; ++j) offset[j] = first + j * p.kv_stride_slot;
    return;
  }
  for (int j = 0; j < kDecodeKeys; ++j) {
    if (pos + j >= end) {
      offset[j] = offset[0];
      continue;
    }
    offset[j] = table[block] * p.kv_stride_block + slot * p.kv_stride_slot;
    if (++slot == p.block_size) {
      slot = 0;
      ++block;
    }
  }
}

// Prefetch the K and V rows at `offset` (a chunk's) with hint kHint.
template <typename T, int kD, int kHint>
inline void prefetch_rows(const T* key_head, const T* value_head, const int64_t* offset) {
  constexpr int kRowBytes = kD * static_cast<int>(sizeof(T));
  for (int j = 0; j < kDecodeKeys; ++j) {
    const char* k = reinterpret_cast<const char*>(key_head + offset[j]);
    const char* v = reinterpret_cast<const char*>(value_head + offset[j]);
    for (int b = 0; b < kRowBytes; b += 64) {
      _mm_prefetch(k + b, static_cast<_mm_hint>(kHint));
      _mm_prefetch(v + b, static_cast<_mm_hint>(kHint));
    }
  }
}

// Query heads g0 .. g0 + kRows - 1 of the item's group, head size kD.
template <typename T, int kD, int kRows>
void decode_rows(const Problem& p, const WorkItem& it, int64_t g0, const T* query,
                 const T* key_cache, const T* value_cache, Scratch& sc) {
  using R = DecodeRows<T>;
  constexpr int kLoads = kD / R::kPerLoad;  // loads per cache row
  constexpr int kAcc = kLoads * R::kWide;   // float32 vectors per output row
  const int64_t pos0 = p.seq_lens[it.req] - (p.query_start_loc[it.req + 1] - it.token_begin);
  const KeyRange range = key_range(p, it, pos0, 1);
  const int32_t* table = p.block_table + it.req * p.table_stride;
  const T* key_head = key_cache + it.kv_head * p.kv_stride_head;
  const T* value_head = value_cache + it.kv_head * p.kv_stride_head;

  typename R::QVec q[kRows][kLoads];
  for (int r = 0; r < kRows; ++r) {
    const T* src = query + it.token_begin * p.q_stride_token +
                   (it.kv_head * p.group + g0 + r) * p.q_stride_head;
    for (int c = 0; c < kLoads; ++c) q[r][c] = R::load_q(src + c * R::kPerLoad);
  }
  alignas(64) float out[kRows][kAcc * 16] = {};  // in R's lane order
  alignas(64) float prob[kRows][kDecodeKeys];
  float m[kRows], correction[kRows];
  __m512 sum[kRows];  // running sums of the probabilities, per lane
  for (int r = 0; r < kRows; ++r) {
    m[r] = kNegInf;
    sum[r] = _mm512_setzero_ps();
  }
  int64_t offset[kDecodeKeys], next[kDecodeKeys];
  if (range.lo < range.hi) chunk_offsets(p, table, range.lo, range.hi, next);
  for (int64_t c0 = range.lo; c0 < range.hi; c0 += kDecodeKeys) {
    std::memcpy(offset, next, sizeof(offset));
    const int64_t num_keys = std::min<int64_t>(kDecodeKeys, range.hi - c0);
    if (c0 + kDecodeKeys < range.hi) {
      chunk_offsets(p, table, c0 + kDecodeKeys, range.hi, next);
      prefetch_rows<T, kD, _MM_HINT_T0>(key_head, value_head, next);
      // The chunk after the next into L2: a chunk's compute is shorter than a trip to memory
      // for its 16 scattered rows, and L1 holds few misses in flight.
      if (c0 + kAheadKeys < range.hi) {
        int64_t ahead[kDecodeKeys];
        chunk_offsets(p, table, c0 + kAheadKeys, range.hi, ahead);
        prefetch_rows<T, kD, _MM_HINT_T1>(key_head, value_head, ahead);
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << num_keys) - 1);
    for (int r = 0; r < kRows; ++r) {
      vf16 dots[kDecodeKeys];
      for (int j = 0; j < kDecodeKeys; ++j) {
        const T* k = key_head + offset[j];
        __m512 acc = R::dot(_mm512_setzero_ps(), q[r][0], k);
        for (int c = 1; c < kLoads; ++c) acc = R::dot(acc, q[r][c], k + c * R::kPerLoad);
        dots[j] = acc;
      }
      __m512 s = _mm512_mul_ps(sum_lanes16(dots), _mm512_set1_ps(p.scale));
      s = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), valid, s);
      // The running max moves only when a score passes it (rare after the first keys): only
      // then the horizontal max, and the rescale of the sums and outputs.
      correction[r] = 1.0f;
      if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(m[r]), _CMP_GT_OQ) != 0) {
        const float new_max = _mm512_reduce_max_ps(s);
        correction[r] = exp_nonpositive(m[r] - new_max);  // 0 on the first keys
        sum[r] = _mm512_mul_ps(sum[r], _mm512_set1_ps(correction[r]));
        m[r] = new_max;
      }
      const __m512 e = exp_nonpositive16(s - m[r]);
      sum[r] = _mm512_add_ps(sum[r], e);
      _mm512_store_ps(prob[r], e);
    }
    // Probabilities times values, the rows' accumulators in registers over the chunk.
    __m512 acc[kRows][kAcc];
    for (int r = 0; r < kRows; ++r) {
      const __m512 scale = _mm512_set1_ps(correction[r]);
      for (int a = 0; a < kAcc; ++a) acc[r][a] = _mm512_mul_ps(_mm512_load_ps(out[r] + a * 16), scale);
    }
    for (int j = 0; j < kDecodeKeys; ++j) {  // masked keys: probability 0 on a finite row
      __m512 v[kAcc];
      for (int c = 0; c < kLoads; ++c) R::widen(value_head + offset[j] + c * R::kPerLoad, v + c * R::kWide);
      for (int r = 0; r < kRows; ++r) {
        const __m512 pj = _mm512_set1_ps(prob[r][j]);
        for (int a = 0; a < kAcc; ++a) acc[r][a] = _mm512_fmadd_ps(pj, v[a], acc[r][a]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int a = 0; a < kAcc; ++a) _mm512_store_ps(out[r] + a * 16, acc[r][a]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    float* dst = sc.o + (g0 + r) * kD;
    for (int c = 0; c < kLoads; ++c) {
      R::store(out[r] + c * R::kWide * 16, dst + c * R::kPerLoad);
    }
    sc.m[g0 + r] = m[r];
    sc.l[g0 + r] = _mm512_reduce_add_ps(sum[r]);
  }
}

// Every query head of the item's group, in passes of up to kMaxRows heads (the accumulators of a
// pass stay in registers).
template <typename T, int kD>
void decode_group(const Problem& p, const WorkItem& it, const T* query, const T* key_cache,
                  const T* value_cache, Scratch& sc) {
  constexpr int kMaxRows = kD <= 64 ? 4 : 2;
  for (int64_t g0 = 0; g0 < p.group; g0 += kMaxRows) {
    const int64_t rows = std::min<int64_t>(kMaxRows, p.group - g0);
    if (rows == 1) {
      decode_rows<T, kD, 1>(p, it, g0, query, key_cache, value_cache, sc);
    } else if (rows == 2) {
      decode_rows<T, kD, 2>(p, it, g0, query, key_cache, value_cache, sc);
    } else if constexpr (kMaxRows == 4) {
      if (rows == 3) {
        decode_rows<T, kD, 3>(p, it, g0, query, key_cache, value_cache, sc);
      } else {
        decode_rows<T, kD, 4>(p, it, g0, query, key_cache, value_cache, sc);
      }
    }
  }
}

template <typename T>
bool decode_avx512(const Problem& p, const WorkItem& it, const T* query, const T* key_cache,
                   const T* value_cache, Scratch& sc) {
  if constexpr (!DecodeRows<T>::kAvailable) {
    return false;
  } else {
    switch (p.head_size) {
      case 64:
        decode_group<T, 64>(p, it, query, key_cache, value_cache, sc);
        return true;
      case 128:
        decode_group<T, 128>(p, it, query, key_cache, value_cache, sc);
        return true;
      case 32:
        decode_group<T, 32>(p, it, query, key_cache, value_cache, sc);
        return true;
      default:
        return false;
    }
  }
}

#else

template <typename T>
bool decode_avx512(const Problem&, const WorkItem&, const T*, const T*, const T*, Scratch&) {
  return false;  // no AVX-512 in this build: the portable kernel runs
}

#endif

}  // namespace kiln_x86::attention
