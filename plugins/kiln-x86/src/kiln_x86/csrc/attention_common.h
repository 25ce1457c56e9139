// kiln-x86 paged attention: what the kernels of x86_attention.cpp and attention_decode.h share
// (the problem and work-item descriptions, per-thread buffers, and float32 vector helpers written
// with GCC vector extensions, so that they compile to AVX-512 or AVX2 as the CPU has them).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

namespace kiln_x86::attention {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (scores minus their running max), branch-free so that loops of it vectorize:
// x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error below
// 2e-7, about float32's rounding), times 2^n built in the exponent bits. Below kExpMin it returns
// 0, as it does for -inf (a masked score). Written once for a float and for 16 lanes (vf16):
// exp_nonpositive and exp_nonpositive16 differ only in how they round n (see the latter).
constexpr float kExpMin = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;  // ln2 = kLn2Hi - kLn2Lo, split so that n * kLn2Hi is exact
constexpr float kLn2Lo = 2.12194440e-4f;

// e^r for r = x - n ln2, where T is float or vf16.
template <typename T>
inline T exp_reduced(T x, T n) {
  const T r = (x - n * kLn2Hi) + n * kLn2Lo;
  T p = T{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

inline float exp_nonpositive(float x) {
  const bool underflow = !(x > kExpMin);
  x = underflow ? 0.0f : x;
  const float n = std::floor(x * kLog2e + 0.5f);
  const float p = exp_reduced(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}

struct WorkItem {
  int32_t req;
  int32_t kv_head;
  int32_t token_begin;  // the tile's query tokens, rows of `query` [token_begin, token_end)
  int32_t token_end;
  int32_t ctx_begin;    // the keys this item covers, positions [ctx_begin, ctx_end)
  int32_t ctx_end;
  int32_t partial;      // slot in the partial results of a split decode, or -1: write `out`
  int64_t cost;
};

struct Problem {
  const int32_t* query_start_loc;  // [B + 1]
  const int32_t* seq_lens;         // [B]
  const int32_t* block_table;      // [B, table_stride]
  int64_t table_stride;
  int64_t num_heads, num_kv_heads, group, head_size, block_size;
  int64_t q_stride_token, q_stride_head;      // query [T, H, D]
  int64_t kv_stride_block, kv_stride_slot, kv_stride_head;  // caches [nb, bs, Hkv, D]
  int64_t out_stride_token, out_stride_head;  // out [T, H, D]
  float scale;
  int64_t sliding_window;  // <= 0: none
  const int32_t* prompt_reqs = nullptr;  // [B], or none: 1 where a request's new rows are prompt's
};

// 16 float32 lanes (one AVX-512 register, two AVX2 ones), and loads that widen bf16 exactly.
typedef float vf16 __attribute__((vector_size(64)));
typedef uint16_t vu16x16 __attribute__((vector_size(32)));
typedef uint32_t vu32x16 __attribute__((vector_size(64)));

inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf16 load16(const c10::BFloat16* p) {
  vu16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const vu32x16 w = __builtin_convertvector(h, vu32x16) << 16;
  vf16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

typedef int32_t vi32x16 __attribute__((vector_size(64)));

inline vf16 splat(float x) { return vf16{} + x; }

// Lane j of the result: the sum of a[j]'s 16 lanes (an add tree that transposes as it goes: at
// each level, pairs of vectors swap halves of their lanes' partial sums).
inline vf16 sum_lanes16(const vf16* a) {
  vf16 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) {
    const vf16 x = a[2 * i], y = a[2 * i + 1];
    l1[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                    31);
  }
  for (int i = 0; i < 4; ++i) {
    const vf16 x = l1[2 * i], y = l1[2 * i + 1];
    l2[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                    31);
  }
  for (int i = 0; i < 2; ++i) {
    const vf16 x = l2[2 * i], y = l2[2 * i + 1];
    l3[i] = __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                    31);
  }
  return __builtin_shufflevector(l3[0], l3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(l3[0], l3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// exp_nonpositive on 16 lanes (rounding n to nearest with the 1.5 * 2^23 trick instead of floor:
// at a tie, r = +-ln2 / 2, the two may take neighbouring n, equally accurate but not the same bits).
inline vf16 exp_nonpositive16(vf16 x) {
  const vi32x16 in_range = x > splat(kExpMin);
  x = in_range ? x : splat(0.0f);
  const vf16 n = (x * kLog2e + 12582912.0f) - 12582912.0f;
  const vf16 p = exp_reduced(x, n);
  const vi32x16 bits = (__builtin_convertvector(n, vi32x16) + 127) << 23;
  vf16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return in_range ? p * scale : splat(0.0f);
}

// Per-thread buffers, grown to the largest item a thread has met (not zeroed).
struct Scratch {
  float *q = nullptr, *o = nullptr, *s = nullptr, *k = nullptr, *v = nullptr, *m = nullptr,
        *l = nullptr;
  Scratch() = default;
  // `rows` query rows of `d`, and scores against up to `keys` keys at a time.
  Scratch(int64_t rows, int64_t d, int64_t keys) { reserve(rows, d, keys); }
  void reserve(int64_t rows, int64_t d, int64_t keys) {
    q = grow(0, rows * d);
    o = grow(1, rows * d);
    s = grow(2, rows * keys);
    k = grow(3, keys * d);
    v = grow(4, keys * d);
    m = grow(5, rows);
    l = grow(6, rows);
  }

 private:
  float* grow(int i, int64_t size) {
    if (size > sizes_[i]) {
      bufs_[i].reset(new float[size]);
      sizes_[i] = size;
    }
    return bufs_[i].get();
  }
  std::unique_ptr<float[]> bufs_[7];
  int64_t sizes_[7] = {};
};

// The keys [lo, hi) an item may see (rows narrow it further: causal, sliding window).
struct KeyRange {
  int64_t lo, hi;
};

inline KeyRange key_range(const Problem& p, const WorkItem& it, int64_t pos0, int64_t num_tokens) {
  int64_t lo = it.ctx_begin;
  if (p.sliding_window > 0) lo = std::max<int64_t>(lo, pos0 - p.sliding_window + 1);
  return {lo, std::min<int64_t>(it.ctx_end, pos0 + num_tokens)};
}

}  // namespace kiln_x86::attention
