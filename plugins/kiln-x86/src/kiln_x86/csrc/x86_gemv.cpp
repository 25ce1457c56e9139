// kiln-x86 decode matmul for GGUF weights in a tiled layout, with int8 activations (AVX512-VNNI;
// without it, the AVX2 kernel of gemv_avx2.h over the same layout, with the same results).
// kiln_x86/gemv.py packs the weights and documents the contract.
//
// Layout: output channels in tiles of 16; per tile, the K / 32 blocks of 32 inputs one after the
// other, each block one record (a tile is one linear stream of bytes):
//   [weights][scales: G x 16][mins: 16, if any]      (G = 32 / group: 1, or 2 for Q6_K's 16s)
// Each weight is an unsigned integer u (w = scale * (u - offset) + min) stored so that one 64-byte
// load holds 16 channels x 4 consecutive inputs, byte 4 c + t = channel c, input 4 j + t:
// - 4 to 6 bits: 4 loads j = 0..3, low nibbles inputs 4 j + t, high nibbles 16 + 4 j + t; for 5
//   and 6 bits then, per j, per half h (low, high nibbles), per bit plane p, a 64-bit mask whose
//   bit 4 c + t is bit 4 + p of that weight.
// - 8 bits: 8 loads (h, j), inputs 16 h + 4 j + t.
// Scales and mins are float16 (Q4_0, Q4_1, Q8_0: GGUF's own values) or float32 (K-quants: d
// times the 6-bit sub-block scale, exact in float32).
//
// Activations: each row is rounded once per call to int8 per block of 32, x ~= dx * qx with
// dx = max|x| / 127 and qx = x * (127 / max|x|) to nearest even (llama.cpp's Q8 activations).
// Then one vpdpbusd multiplies 16 channels' 4 bytes by a broadcast 4-byte slice of qx, so a
// block's 16 int32 sums need no horizontal reduction; the offset enters the integer sum exactly
// (it starts at -offset * sum(qx)), and once per block the sums become float32:
//   acc += float(isum) * (scale * dx) [+ min * (dx * sum(qx))].
// Every (row, channel) result is computed the same way whatever the number of rows or threads:
// a row's result does not depend on the other rows of the call.
//
// gemm_amx, for many rows (prefill) where the CPU has AMX-INT8: the same rounded activations and
// the same per-block float part, with a block's int32 sums for 16 rows x 16 channels from one
// tdpbssd (Q6_K: one per half block), up to 4 row groups per weight tile load. The tile layout is
// AMX's B-tile layout already (a row of 64 bytes = 16 channels x 4 inputs); unpacked to signed
// bytes u - offset, a block's sums are the VNNI kernel's integer sums exactly, and the float part
// runs the same operations in the same order, so every (row, channel) result equals gemv's bit for
// bit (the tests check it).
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "work_pool.h"

// The int8 kernel's instruction set, chosen at compile time (the build is -march=native):
// AVX512-VNNI (and AMX tiles for prefill where the CPU has them), else AVX2 with FMA and F16C
// (the same tiled layout, integer sums and float operations: the same results bit for bit),
// else no int8 kernel (gemv.available() is False).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KILN_GEMV_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KILN_GEMV_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KILN_GEMV_AVX2 1
#endif
#if defined(KILN_GEMV_VNNI) || defined(KILN_GEMV_AVX2)
#define KILN_GEMV_INT8 1
#include <immintrin.h>
#endif

// The dispatcher namespace of the ops (torch.ops.<name>): one per process, so a second build
// loaded beside the default one (the tests' AVX2 build on an AVX-512 machine) names its own.
#ifndef KILN_GEMV_LIBRARY
#define KILN_GEMV_LIBRARY kiln_x86_gemv
#endif

namespace {

constexpr int64_t kTile = 16;   // output channels per tile
constexpr int64_t kBlock = 32;  // inputs per block (one activation scale)

constexpr int64_t weight_bytes(int64_t bits) { return bits == 8 ? 512 : 256 + (bits - 4) * 64; }

struct Layout {
  const uint8_t* data;
  int64_t N, K, nb, tiles, rec;
  int64_t bits, groups, offset;
  bool mins, f16;
};

Layout make_layout(const at::Tensor& data, int64_t N, int64_t K, int64_t bits, int64_t group,
                   bool mins, bool f16, int64_t offset) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6 or 8, got ",
              bits);
  TORCH_CHECK(group == 32 || group == 16, "group must be 32 or 16, got ", group);
  TORCH_CHECK(K > 0 && K % kBlock == 0, "in_features ", K, " is not a positive multiple of 32");
  TORCH_CHECK(N > 0, "out_features must be positive");
  Layout w;
  w.data = data.data_ptr<uint8_t>();
  w.N = N;
  w.K = K;
  w.nb = K / kBlock;
  w.tiles = (N + kTile - 1) / kTile;
  w.bits = bits;
  w.groups = kBlock / group;
  TORCH_CHECK(!mins || offset == 0, "formats with mins have offset 0, got ", offset);
  w.offset = offset;
  w.mins = mins;
  w.f16 = f16;
  const int64_t s = f16 ? 2 : 4;
  w.rec = weight_bytes(bits) + w.groups * kTile * s + (mins ? kTile * s : 0);
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() &&
                  data.numel() == w.tiles * w.nb * w.rec,
              "data must be contiguous uint8 of ", w.tiles * w.nb * w.rec, " bytes, got ",
              data.numel());
  return w;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

inline float scale_at(const uint8_t* p, int64_t i, bool f16) {
  if (f16) return half_to_float(p + 2 * i);
  float f;
  std::memcpy(&f, p + 4 * i, 4);
  return f;
}

// Unsigned weight of channel c, input k (0..31) of one block record.
inline int weight_u(const uint8_t* rec, int64_t bits, int c, int k) {
  const int h = k >> 4, j = (k & 15) >> 2, idx = 4 * c + (k & 3);
  if (bits == 8) return rec[(h * 4 + j) * 64 + idx];
  const uint8_t byte = rec[j * 64 + idx];
  int u = h ? byte >> 4 : byte & 0xF;
  const int planes = static_cast<int>(bits) - 4;
  for (int p = 0; p < planes; ++p) {
    const uint8_t* mask = rec + 256 + ((j * 2 + h) * planes + p) * 8;
    u |= ((mask[idx >> 3] >> (idx & 7)) & 1) << (4 + p);
  }
  return u;
}

// Rows `ids` of the weight, [len(ids), K]: GGUF's dequantized values (float32 exactly; bfloat16
// rounded to nearest even). Scalar: used for embedding lookups and dense fallbacks.
template <typename T>
void dequantize_kernel(const Layout& w, const int64_t* ids, int64_t count, T* out) {
  const int64_t s = w.f16 ? 2 : 4;
  const int64_t wb = weight_bytes(w.bits);
  at::parallel_for(0, count, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = ids[i];
      const int c = static_cast<int>(n % kTile);
      const uint8_t* rec = w.data + (n / kTile) * w.nb * w.rec;
      T* orow = out + i * w.K;
      for (int64_t b = 0; b < w.nb; ++b, rec += w.rec) {
        const uint8_t* sp = rec + wb;
        const float m = w.mins ? scale_at(sp + w.groups * kTile * s, c, w.f16) : 0.0f;
        for (int k = 0; k < kBlock; ++k) {
          const float scale = scale_at(sp + (w.groups == 2 ? (k >> 4) : 0) * kTile * s, c, w.f16);
          // scale * (u - offset) is exact in float32: one rounding, as gguf forms the weight.
          const float v = scale * static_cast<float>(weight_u(rec, w.bits, c, k) - w.offset) + m;
          orow[b * kBlock + k] = kiln_x86::round_to<T>(v);
        }
      }
    }
  });
}

#if defined(KILN_GEMV_INT8)

// The activations of one call, rounded: q [M, K] int8, dx [M, nb], s16 [M, 2 nb] (sum of qx
// over each half block of 16).
struct Acts {
  const int8_t* q;
  const float* dx;
  const int32_t* s16;
  const float* dsum;  // [M, nb]: dx * float(sum of qx over the block)
};

#endif  // KILN_GEMV_INT8

#if defined(KILN_GEMV_VNNI)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

// Rows m0..m1 of x, each on its own (the same values whichever call or thread rounds a row).
template <typename T>
void quantize_acts(const T* x, int64_t m0, int64_t m1, int64_t K, int8_t* q, float* dx,
                   int32_t* s16) {
  const int64_t nb = K / kBlock;
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const T* xb = x + m * K + b * kBlock;
      const __m512 a = load16(xb), c = load16(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
      const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      // Nearest even (the default rounding mode); |x| * 127 / amax <= 127 (+ rounding).
      const __m512i lim = _mm512_set1_epi32(127), neg = _mm512_set1_epi32(-127);
      const __m512i qa =
          _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, id)), lim), neg);
      const __m512i qc =
          _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(c, id)), lim), neg);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + b * kBlock), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + b * kBlock + 16),
                       _mm512_cvtepi32_epi8(qc));
      dx[m * nb + b] = amax / 127.0f;
      s16[m * 2 * nb + 2 * b] = _mm512_reduce_add_epi32(qa);
      s16[m * 2 * nb + 2 * b + 1] = _mm512_reduce_add_epi32(qc);
    }
  }
}

template <bool kF16>
inline __m512 load_scales(const uint8_t* p) {
  if constexpr (kF16)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __mmask64 load_mask(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return _cvtu64_mask64(v);
}

// Bit planes 4.. of one half of one j: adds 16 << p where the plane's mask bit is set.
template <int kBits>
inline __m512i add_planes(__m512i v, const uint8_t* masks) {
  v = _mm512_mask_add_epi8(v, load_mask(masks), v, _mm512_set1_epi8(0x10));
  if constexpr (kBits == 6) v = _mm512_mask_add_epi8(v, load_mask(masks + 8), v, _mm512_set1_epi8(0x20));
  return v;
}

// Output channels n0..n1 (whole tiles but the last) of the weight, [n1 - n0, K], 16 channels
// of a block at a time: the block's bytes unpacked into 8 vectors (h, j) of 64 bytes (byte 4 c +
// t = input 16 h + 4 j + t of channel c), then each channel's 32 bytes gathered as 8 dwords.
// The same values as dequantize_kernel: scale * (u - offset) is exact, then + min.
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

template <typename T>
void dequantize_tiles(const Layout& w, int64_t n0, int64_t n1, T* out) {
  const int64_t s = w.f16 ? 2 : 4;
  const int64_t wb = weight_bytes(w.bits);
  const int planes = w.bits == 8 ? 0 : static_cast<int>(w.bits) - 4;
  const __m256i lanes = _mm256_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448);
  const __m512 offset = _mm512_set1_ps(static_cast<float>(w.offset));
  at::parallel_for(n0 / kTile, (n1 + kTile - 1) / kTile, 4, [&](int64_t t0, int64_t t1) {
    alignas(64) uint8_t bytes[512];
    float scales[2][kTile], mins[kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* rec = w.data + t * w.nb * w.rec;
      const int64_t c0 = std::max<int64_t>(n0, t * kTile), c1 = std::min<int64_t>(n1, (t + 1) * kTile);
      for (int64_t b = 0; b < w.nb; ++b, rec += w.rec) {
        if (w.bits == 8) {
          std::memcpy(bytes, rec, 512);
        } else {
          const __m512i low4 = _mm512_set1_epi8(0x0F);
          for (int j = 0; j < 4; ++j) {
            const __m512i v = _mm512_loadu_si512(rec + j * 64);
            __m512i half[2] = {_mm512_and_si512(v, low4),
                               _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
            for (int h = 0; h < 2; ++h) {
              for (int p = 0; p < planes; ++p) {
                const __mmask64 m = load_mask(rec + 256 + ((j * 2 + h) * planes + p) * 8);
                half[h] = _mm512_mask_add_epi8(half[h], m, half[h], _mm512_set1_epi8(16 << p));
              }
              _mm512_store_si512(bytes + (h * 4 + j) * 64, half[h]);
            }
          }
        }
        const uint8_t* sp = rec + wb;
        for (int c = 0; c < kTile; ++c) {
          for (int g = 0; g < w.groups; ++g) scales[g][c] = scale_at(sp + g * kTile * s, c, w.f16);
          mins[c] = w.mins ? scale_at(sp + w.groups * kTile * s, c, w.f16) : 0.0f;
        }
        for (int64_t n = c0; n < c1; ++n) {
          const int c = static_cast<int>(n - t * kTile);
          const __m256i u8 = _mm256_i32gather_epi32(
              reinterpret_cast<const int*>(bytes), _mm256_add_epi32(lanes, _mm256_set1_epi32(4 * c)), 1);
          const __m512 m = _mm512_set1_ps(mins[c]);
          T* orow = out + (n - n0) * w.K + b * kBlock;
          for (int h = 0; h < 2; ++h) {
            const __m128i q = h ? _mm256_extracti128_si256(u8, 1) : _mm256_castsi256_si128(u8);
            const __m512 u = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), offset);
            const __m512 scale = _mm512_set1_ps(scales[w.groups == 2 ? h : 0][c]);
            store16(orow + 16 * h, _mm512_add_ps(_mm512_mul_ps(u, scale), m));
          }
        }
      }
    }
  });
}

// res[t][r][c] for kRows rows r0.. of the activations and the 16 channels of each of kTiles
// tiles from `tile` (res: kTiles blocks of kRows x 16): a pass over two tiles loads each
// broadcast activation once for both. Every (row, channel) element gets the same integer sums and
// the same float operations in the same order whatever kRows and kTiles.
template <int kBits, int kGroups, bool kMins, bool kF16, int kRows, int kTiles>
void tile_rows(const Layout& w, const Acts& a, int64_t tile, int64_t r0, float* res) {
  constexpr int64_t kScale = kF16 ? 2 : 4;
  constexpr int64_t kWeights = weight_bytes(kBits);
  constexpr int kPlanes = kBits == 8 ? 0 : kBits - 4;
  const int64_t K = w.K, nb = w.nb;
  const int32_t offset = static_cast<int32_t>(w.offset);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* recs[kTiles];
  for (int t = 0; t < kTiles; ++t) recs[t] = w.data + (tile + t) * nb * w.rec;
  __m512 acc[kRows][kTiles];
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kTiles; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m512i isum[kRows][kTiles][kGroups];
    for (int r = 0; r < kRows; ++r) {
      const int32_t* s = a.s16 + (r0 + r) * 2 * nb + 2 * b;
      for (int t = 0; t < kTiles; ++t) {
        // Formats with mins have offset 0 (make_layout checks it): no offset term, whose
        // broadcast from a general register took a shuffle-port slot per row and block.
        if constexpr (kMins) {
          isum[r][t][0] = _mm512_setzero_si512();
        } else if constexpr (kGroups == 1) {
          isum[r][t][0] = _mm512_set1_epi32(-offset * (s[0] + s[1]));
        } else {
          isum[r][t][0] = _mm512_set1_epi32(-offset * s[0]);
          isum[r][t][1] = _mm512_set1_epi32(-offset * s[1]);
        }
      }
    }
    const int8_t* xq = a.q + r0 * K + b * kBlock;
    if constexpr (kBits == 8) {
      for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < 4; ++j) {
          __m512i v[kTiles];
          for (int t = 0; t < kTiles; ++t) v[t] = _mm512_loadu_si512(recs[t] + (h * 4 + j) * 64);
          for (int r = 0; r < kRows; ++r) {
            const __m512i x = bcast4(xq + r * K + 16 * h + 4 * j);
            for (int t = 0; t < kTiles; ++t) isum[r][t][0] = _mm512_dpbusd_epi32(isum[r][t][0], v[t], x);
          }
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        __m512i lo[kTiles], hi[kTiles];
        for (int t = 0; t < kTiles; ++t) {
          const __m512i v = _mm512_loadu_si512(recs[t] + j * 64);
          lo[t] = _mm512_and_si512(v, low4);
          hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          if constexpr (kPlanes > 0) {
            const uint8_t* masks = recs[t] + 256 + j * 2 * kPlanes * 8;
            lo[t] = add_planes<kBits>(lo[t], masks);
            hi[t] = add_planes<kBits>(hi[t], masks + kPlanes * 8);
          }
        }
        for (int r = 0; r < kRows; ++r) {
          const __m512i xl = bcast4(xq + r * K + 4 * j), xh = bcast4(xq + r * K + 16 + 4 * j);
          for (int t = 0; t < kTiles; ++t) {
            isum[r][t][0] = _mm512_dpbusd_epi32(isum[r][t][0], lo[t], xl);
            isum[r][t][kGroups - 1] = _mm512_dpbusd_epi32(isum[r][t][kGroups - 1], hi[t], xh);
          }
        }
      }
    }
    __m512 scale[kTiles][kGroups], mins[kTiles];
    for (int t = 0; t < kTiles; ++t) {
      const uint8_t* sp = recs[t] + kWeights;
      for (int g = 0; g < kGroups; ++g) scale[t][g] = load_scales<kF16>(sp + g * kTile * kScale);
      mins[t] = kMins ? load_scales<kF16>(sp + kGroups * kTile * kScale) : scale[t][0];
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512 d = _mm512_set1_ps(a.dx[(r0 + r) * nb + b]);
      for (int t = 0; t < kTiles; ++t) {
        for (int g = 0; g < kGroups; ++g) {
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][t][g]),
                                      _mm512_mul_ps(scale[t][g], d), acc[r][t]);
        }
        // dsum: dx * sum(qx), formed once per call; broadcast from memory (a load, not a shuffle).
        if constexpr (kMins)
          acc[r][t] = _mm512_fmadd_ps(mins[t], _mm512_set1_ps(a.dsum[(r0 + r) * nb + b]), acc[r][t]);
      }
    }
    for (int t = 0; t < kTiles; ++t) recs[t] += w.rec;
  }
  for (int t = 0; t < kTiles; ++t) {
    for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(res + (t * kRows + r) * kTile, acc[r][t]);
  }
}

// Rows per pass over kTiles tiles: every row's accumulators stay in registers.
template <int kGroups, int kTiles>
constexpr int max_rows() {
  return (kGroups == 2 ? 4 : 8) / kTiles;
}

inline void store_row(const float* res, float* out, __mmask16 mask) {
  _mm512_mask_storeu_ps(out, mask, _mm512_loadu_ps(res));
}

inline void store_row(const float* res, c10::BFloat16* out, __mmask16 mask) {
  // Nearest even, as torch rounds float32 to bfloat16 (results are finite).
  const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(res));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  _mm256_mask_storeu_epi16(out, mask, _mm512_cvtepi32_epi16(r));
}

// Row r of a tile's results (res: 16 floats) into its first `count` output channels.
template <typename T>
inline void store_tile_row(const float* res, T* out, int64_t count) {
  store_row(res, out, static_cast<__mmask16>((1u << count) - 1));
}

#elif defined(KILN_GEMV_AVX2)
#include "gemv_avx2.h"
#endif

#if defined(KILN_GEMV_INT8)

template <int kBits, int kGroups, bool kMins, bool kF16, int kTiles, int kRows = 1>
void tile_rows_n(int rows, const Layout& w, const Acts& a, int64_t tile, int64_t r0, float* res) {
  if constexpr (kRows <= max_rows<kGroups, kTiles>()) {
    if (rows == kRows)
      return tile_rows<kBits, kGroups, kMins, kF16, kRows, kTiles>(w, a, tile, r0, res);
    tile_rows_n<kBits, kGroups, kMins, kF16, kTiles, kRows + 1>(rows, w, a, tile, r0, res);
  }
}

// Rows per chunk of a many-row call (prefill without AMX): a chunk's rounded activations stay in
// L2 while every tile of the weight streams past them.
constexpr int64_t kVnniChunkRows = 64;

// The rows of one chunk, rounded into the calling thread's scratch (`Acts` of rows r0..r1 start
// at their row 0): each row on its own, so whichever thread rounds a row rounds it the same way.
struct ChunkActs {
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int32_t> s16;
  std::vector<float> dsum;
  int64_t chunk = -1;
  uint64_t call = 0;

  // The rounded rows of `chunk` (valid once `round` has run for it).
  Acts acts() { return Acts{q.data(), dx.data(), s16.data(), dsum.data()}; }

  template <typename T>
  Acts round(const T* x, int64_t r0, int64_t r1, int64_t K) {
    const int64_t nb = K / kBlock, rows = r1 - r0;
    q.resize(rows * K);
    dx.resize(rows * nb);
    s16.resize(rows * 2 * nb);
    quantize_acts(x + r0 * K, 0, rows, K, q.data(), dx.data(), s16.data());
    // The min term's factor dx * sum(qx) per block (the same float product wherever formed).
    dsum.resize(rows * nb);
    for (int64_t i = 0; i < rows * nb; ++i)
      dsum[i] = dx[i] * static_cast<float>(s16[2 * i] + s16[2 * i + 1]);
    return Acts{q.data(), dx.data(), s16.data(), dsum.data()};
  }
};

// x [M, K] @ w.T -> out [M, N]. Work items (chunk of kVnniChunkRows rows, output tile),
// chunk-major, in one parallel region: a thread rounds each chunk it reaches once (a chunk split
// between two threads is rounded by both, identically) and runs its tiles over the chunk's rows,
// kMaxRows at a time.
template <int kBits, int kGroups, bool kMins, bool kF16, typename T, typename X>
void gemv_kernel(const Layout& w, const X* x, int64_t M, T* out) {
  constexpr int kPairRows = max_rows<kGroups, 2>(), kOneRows = max_rows<kGroups, 1>();
  const int64_t chunks = (M + kVnniChunkRows - 1) / kVnniChunkRows;
  // Work per chunk: pairs of tiles (the last may be one) from 8 rows of one-scale-per-block
  // formats, where loading each broadcast activation once for two tiles measured faster (one
  // core, Zen 5, 2,000 rows: Q4_1 1.05-1.07x, Q8_0 1.25x), else single tiles (a decode's row:
  // the same or slower in pairs; Q6_K, whose two sums per block leave two rows a pass: 0.87x).
  const int64_t per_item = kGroups == 1 && M >= 8 ? 2 : 1;
  const int64_t pairs = (w.tiles + per_item - 1) / per_item;
  // Enough items per task that a task streams at least ~32 KiB of weights.
  const int64_t grain = std::max<int64_t>(1, 32768 / (per_item * w.nb * w.rec));
  // A call's number: a thread's scratch holds a chunk of this call only (a thread may run
  // several pieces of one call, and pieces of later calls).
  static std::atomic<uint64_t> num_calls{0};
  const uint64_t call = ++num_calls;
  auto items = [&](int64_t i0, int64_t i1) {
    // Scratch reused by later calls on this thread.
    thread_local ChunkActs acts;
    if (acts.call != call) {
      acts.call = call;
      acts.chunk = -1;
    }
    Acts a = acts.acts();
    alignas(64) float res[2 * kPairRows * kTile + kOneRows * kTile];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t chunk = i / pairs, t = per_item * (i % pairs);
      const int64_t c0 = chunk * kVnniChunkRows, c1 = std::min(M, c0 + kVnniChunkRows);
      if (chunk != acts.chunk) {
        a = acts.round(x, c0, c1, w.K);
        acts.chunk = chunk;
      }
      const int64_t num_tiles = std::min<int64_t>(per_item, w.tiles - t);
      const int max_rows = num_tiles == 2 ? kPairRows : kOneRows;
      for (int64_t r0 = 0; r0 < c1 - c0; r0 += max_rows) {
        const int rows = static_cast<int>(std::min<int64_t>(max_rows, c1 - c0 - r0));
        if (num_tiles == 2)
          tile_rows_n<kBits, kGroups, kMins, kF16, 2>(rows, w, a, t, r0, res);
        else
          tile_rows_n<kBits, kGroups, kMins, kF16, 1>(rows, w, a, t, r0, res);
        for (int64_t k = 0; k < num_tiles; ++k) {
          const int64_t n0 = (t + k) * kTile;
          const int64_t count = std::min<int64_t>(kTile, w.N - n0);
          for (int r = 0; r < rows; ++r)
            store_tile_row(res + (k * rows + r) * kTile, out + (c0 + r0 + r) * w.N + n0, count);
        }
      }
    }
  };
  const int64_t num_items = chunks * pairs;
  kiln_x86::WorkPool& pool = kiln_x86::WorkPool::instance();
  if (pool.helpers() == 0) return at::parallel_for(0, num_items, grain, items);
  // With helper threads: pieces of `grain` items, claimed by the caller and the helpers.
  const int64_t pieces = (num_items + grain - 1) / grain;
  pool.run(pieces, [&](int64_t p) { items(p * grain, std::min(num_items, (p + 1) * grain)); });
}

template <int kBits, int kGroups, bool kMins, bool kF16>
struct GemvKernel {
  template <typename T, typename X>
  static void run(const Layout& w, const X* x, int64_t M, T* out) {
    gemv_kernel<kBits, kGroups, kMins, kF16>(w, x, M, out);
  }
};

// Kernel<bits, groups, mins, f16>::run(w, args...) for w's format.
template <template <int, int, bool, bool> class Kernel, typename... Args>
void dispatch_format(const Layout& w, Args... args) {
  const int code = static_cast<int>(w.bits) * 100 + static_cast<int>(w.groups) * 10 +
                   (w.mins ? 2 : 0) + (w.f16 ? 1 : 0);
  switch (code) {
    case 411: return Kernel<4, 1, false, true>::run(w, args...);   // Q4_0
    case 413: return Kernel<4, 1, true, true>::run(w, args...);    // Q4_1
    case 811: return Kernel<8, 1, false, true>::run(w, args...);   // Q8_0
    case 412: return Kernel<4, 1, true, false>::run(w, args...);   // Q4_K
    case 512: return Kernel<5, 1, true, false>::run(w, args...);   // Q5_K
    case 620: return Kernel<6, 2, false, false>::run(w, args...);  // Q6_K
    default: TORCH_CHECK(false, "no tiled kernel for this format (code ", code, ")");
  }
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-d [rows, in_features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x's dtype ",
              x.scalar_type(), " is not supported (float32, bfloat16)");
}

// x [M, K] (float32 or bfloat16) @ w.T -> [M, N] in x's dtype.
at::Tensor gemv(const at::Tensor& x, const at::Tensor& data, int64_t N, int64_t bits,
                int64_t group, bool mins, bool f16, int64_t offset) {
  check_x(x);
  const Layout w = make_layout(data, N, x.size(1), bits, group, mins, f16, offset);
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0);
  auto out = at::empty({M, N}, xc.options());
  if (M == 0) return out;
  if (xc.scalar_type() == at::kFloat)
    dispatch_format<GemvKernel>(w, xc.data_ptr<float>(), M, out.data_ptr<float>());
  else
    dispatch_format<GemvKernel>(w, xc.data_ptr<c10::BFloat16>(), M,
                                out.data_ptr<c10::BFloat16>());
  return out;
}

#endif  // KILN_GEMV_INT8

#if defined(KILN_GEMV_AMX)

// Linux gives a process AMX's tile data only on request; until then a tile instruction faults.
// Asked once per process; false where the kernel (or a hypervisor) refuses.
bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

constexpr int64_t kChunkRows = 256;  // rows per work item (a tile's weights unpacked once each)

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: int32 sums [16 rows, 16 channels] in tiles 0..3, one per row group of a batch (Q6_K:
// two row groups, tiles 2 i and 2 i + 1 for its half blocks); activations [16 rows, 32 / groups
// bytes] in tiles 4, 5 (alternating row groups, or Q6_K's halves), the block's weights [32 /
// groups / 4 rows, 64 bytes] in 6 (Q6_K: 6, 7). Tile state is per thread: each task configures
// it. (gcc's tile intrinsics take literal tile numbers.)
constexpr TileConfig tile_config(int groups) {
  const int bytes = static_cast<int>(kBlock) / groups;
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = bytes;
    cfg.rows[t + 2] = bytes / 4;
    cfg.colsb[t + 2] = 64;
  }
  return cfg;
}

template <int kGroups>
void configure_tiles() {
  // Static: gcc's _tile_loadconfig tells the compiler it reads 8 bytes of the 64, so a local
  // config's other stores could be dropped.
  static constexpr TileConfig kConfig = tile_config(kGroups);
  _tile_loadconfig(&kConfig);
}

// One tile's weights as signed bytes u - offset, [nb][8 x 64] (row h * 4 + j: inputs 16 h + 4 j
// + t of the 16 channels), the B tiles of its blocks.
template <int kBits>
void unpack_signed(const Layout& w, int64_t tile, int8_t* dst) {
  constexpr int kPlanes = kBits == 8 ? 0 : kBits - 4;
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(w.offset));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* rec = w.data + tile * w.nb * w.rec;
  for (int64_t b = 0; b < w.nb; ++b, rec += w.rec, dst += 512) {
    for (int j = 0; j < 4; ++j) {
      __m512i lo, hi;
      if constexpr (kBits == 8) {
        lo = _mm512_loadu_si512(rec + j * 64);
        hi = _mm512_loadu_si512(rec + (4 + j) * 64);
      } else {
        const __m512i v = _mm512_loadu_si512(rec + j * 64);
        lo = _mm512_and_si512(v, low4);
        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if constexpr (kPlanes > 0) {
          const uint8_t* masks = rec + 256 + j * 2 * kPlanes * 8;
          lo = add_planes<kBits>(lo, masks);
          hi = add_planes<kBits>(hi, masks + kPlanes * 8);
        }
      }
      // u - offset fits int8 for every format (Q8_0: 0..255 - 128), so the wrap is exact.
      _mm512_storeu_si512(dst + j * 64, _mm512_sub_epi8(lo, offset));
      _mm512_storeu_si512(dst + (4 + j) * 64, _mm512_sub_epi8(hi, offset));
    }
  }
}

// One block's int32 sums for `groups16` (1..4 / groups) row groups of 16 rows (xq: the first row's
// block, rows K bytes apart), stored to sums [row group][half][16 rows][16 channels].
template <int kGroups>
inline void block_sums(const int8_t* xq, int64_t K, const int8_t* wq, int groups16,
                       int32_t* sums) {
  constexpr int64_t kSums = 16 * kTile;
  const int64_t next = 16 * K;
  if constexpr (kGroups == 1) {
    _tile_loadd(6, wq, 64);
    _tile_zero(0);
    _tile_loadd(4, xq, K);
    _tile_dpbssd(0, 4, 6);
    if (groups16 > 1) {
      _tile_zero(1);
      _tile_loadd(5, xq + next, K);
      _tile_dpbssd(1, 5, 6);
    }
    if (groups16 > 2) {
      _tile_zero(2);
      _tile_loadd(4, xq + 2 * next, K);
      _tile_dpbssd(2, 4, 6);
    }
    if (groups16 > 3) {
      _tile_zero(3);
      _tile_loadd(5, xq + 3 * next, K);
      _tile_dpbssd(3, 5, 6);
    }
    _tile_stored(0, sums, 64);
    if (groups16 > 1) _tile_stored(1, sums + kSums, 64);
    if (groups16 > 2) _tile_stored(2, sums + 2 * kSums, 64);
    if (groups16 > 3) _tile_stored(3, sums + 3 * kSums, 64);
  } else {
    _tile_loadd(6, wq, 64);
    _tile_loadd(7, wq + 256, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(4, xq, K);
    _tile_loadd(5, xq + 16, K);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 5, 7);
    if (groups16 > 1) {
      _tile_zero(2);
      _tile_zero(3);
      _tile_loadd(4, xq + next, K);
      _tile_loadd(5, xq + next + 16, K);
      _tile_dpbssd(2, 4, 6);
      _tile_dpbssd(3, 5, 7);
    }
    _tile_stored(0, sums, 64);
    _tile_stored(1, sums + kSums, 64);
    if (groups16 > 1) {
      _tile_stored(2, sums + 2 * kSums, 64);
      _tile_stored(3, sums + 3 * kSums, 64);
    }
  }
}

// The rounded activations as the AMX kernel reads them: q [padded rows, K] as gemv's, and per
// block b the rows' dx and dx * sum(qx) (tile_rows' min factor, formed as it forms it) at b *
// padded + row, so that 16 rows' factors sit side by side. Rows past M are zeros.
struct BlockActs {
  const int8_t* q;
  const float* dx;
  const float* dsum;
  int64_t padded;
};

// One block's float part for `rows` rows (tile_rows' operations in its order): acc += float(isum)
// * (scale * dx) per group [+ min * (dx * sum(qx))]; acc [rows][16 channels].
template <int kGroups, bool kMins, bool kF16>
inline void add_block(const float* dx, const float* dsum, const uint8_t* sp, const int32_t* sums,
                      int rows, float* acc) {
  constexpr int64_t kScale = kF16 ? 2 : 4;
  __m512 scale[kGroups];
  for (int g = 0; g < kGroups; ++g) scale[g] = load_scales<kF16>(sp + g * kTile * kScale);
  const __m512 mins = kMins ? load_scales<kF16>(sp + kGroups * kTile * kScale) : scale[0];
  for (int r = 0; r < rows; ++r) {
    const __m512 d = _mm512_set1_ps(dx[r]);
    const int32_t* s = sums + ((r / 16) * kGroups * 16 + r % 16) * kTile;
    __m512 v = _mm512_load_ps(acc + r * kTile);
    for (int g = 0; g < kGroups; ++g) {
      const __m512i isum = _mm512_load_si512(s + g * 16 * kTile);
      v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scale[g], d), v);
    }
    if constexpr (kMins) v = _mm512_fmadd_ps(mins, _mm512_set1_ps(dsum[r]), v);
    _mm512_store_ps(acc + r * kTile, v);
  }
}

// Up to 64 / groups rows r0.. (padded to whole row groups: q, dx, dsum hold zeros past M) x the
// 16 channels of `tile` into acc [rows][16]. A batch of row groups shares each block's weight
// tile; a block's sums are read one block after their tile stores (two buffers): loads right
// behind a tile store wait for it to retire, which stalled the float part on every block.
template <int kBits, int kGroups, bool kMins, bool kF16>
void amx_rows(const Layout& w, const BlockActs& a, const int8_t* wq, int64_t tile, int64_t r0,
              int groups16, float* acc) {
  constexpr int64_t kSums = 4 * 16 * kTile;
  const int64_t K = w.K, nb = w.nb;
  const int rows = groups16 * 16;
  alignas(64) int32_t sums[2][kSums];
  std::fill(acc, acc + rows * kTile, 0.0f);
  const uint8_t* sp = w.data + tile * nb * w.rec + weight_bytes(kBits);
  const int8_t* xq = a.q + r0 * K;
  const float* dx = a.dx + r0;
  const float* dsum = a.dsum + r0;
  for (int64_t b = 0; b <= nb; ++b) {
    if (b < nb) block_sums<kGroups>(xq + b * kBlock, K, wq + b * 512, groups16, sums[b & 1]);
    if (b > 0) {
      const int64_t p = b - 1;
      add_block<kGroups, kMins, kF16>(dx + p * a.padded, dsum + p * a.padded, sp + p * w.rec,
                                      sums[p & 1], rows, acc);
    }
  }
}

template <int kBits, int kGroups, bool kMins, bool kF16>
struct AmxKernel {
  // Work items: (chunk of kChunkRows rows, output tile), chunk-major, split over threads.
  template <typename T>
  static void run(const Layout& w, const BlockActs& a, int64_t M, T* out) {
    const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
    at::parallel_for(0, chunks * w.tiles, 1, [&](int64_t i0, int64_t i1) {
      configure_tiles<kGroups>();
      std::vector<int8_t> wq(w.nb * 512);
      alignas(64) float res[64 * kTile];
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t chunk = i / w.tiles, t = i % w.tiles;
        unpack_signed<kBits>(w, t, wq.data());
        // gcc's tile loads do not tell the compiler they read memory: the stores land first.
        asm volatile("" ::: "memory");
        const int64_t n0 = t * kTile;
        const __mmask16 mask = static_cast<__mmask16>((1u << std::min(kTile, w.N - n0)) - 1);
        const int64_t r1 = std::min(M, (chunk + 1) * kChunkRows);
        constexpr int64_t kBatch = 64 / kGroups;
        for (int64_t r0 = chunk * kChunkRows; r0 < r1; r0 += kBatch) {
          const int64_t rows = std::min<int64_t>(kBatch, r1 - r0);
          amx_rows<kBits, kGroups, kMins, kF16>(w, a, wq.data(), t, r0, (rows + 15) / 16, res);
          for (int64_t r = 0; r < rows; ++r)
            store_row(res + r * kTile, out + (r0 + r) * w.N + n0, mask);
        }
      }
      _tile_release();
    });
  }
};

// gemv's result for any number of rows through AMX tiles (the rows rounded in parallel).
at::Tensor gemm_amx(const at::Tensor& x, const at::Tensor& data, int64_t N, int64_t bits,
                    int64_t group, bool mins, bool f16, int64_t offset) {
  check_x(x);
  TORCH_CHECK(amx_ready(), "this process may not use AMX tiles (arch_prctl refused)");
  const Layout w = make_layout(data, N, x.size(1), bits, group, mins, f16, offset);
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = w.K, nb = w.nb;
  auto out = at::empty({M, N}, xc.options());
  if (M == 0) return out;
  const int64_t padded = (M + 15) / 16 * 16;
  std::vector<int8_t> q(padded * K);
  std::vector<float> dx(M * nb), dx_t(nb * padded, 0.0f), dsum_t(nb * padded, 0.0f);
  std::vector<int32_t> s16(M * 2 * nb);
  std::fill(q.begin() + M * K, q.end(), 0);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    if (xc.scalar_type() == at::kFloat)
      quantize_acts(xc.data_ptr<float>(), m0, m1, K, q.data(), dx.data(), s16.data());
    else
      quantize_acts(xc.data_ptr<c10::BFloat16>(), m0, m1, K, q.data(), dx.data(), s16.data());
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t i = m * nb + b;
        dx_t[b * padded + m] = dx[i];
        dsum_t[b * padded + m] = dx[i] * static_cast<float>(s16[2 * i] + s16[2 * i + 1]);
      }
    }
  });
  const BlockActs a{q.data(), dx_t.data(), dsum_t.data(), padded};
  if (out.scalar_type() == at::kFloat)
    dispatch_format<AmxKernel>(w, a, M, out.data_ptr<float>());
  else
    dispatch_format<AmxKernel>(w, a, M, out.data_ptr<c10::BFloat16>());
  return out;
}

#endif  // KILN_GEMV_AMX

at::Tensor dequantize(const at::Tensor& data, const at::Tensor& ids, int64_t N, int64_t K,
                      int64_t bits, int64_t group, bool mins, bool f16, int64_t offset,
                      at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype ", dtype,
              " is not supported (float32, bfloat16)");
  const Layout w = make_layout(data, N, K, bits, group, mins, f16, offset);
  const auto idx = ids.to(at::kLong).contiguous().reshape({-1});
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "row id ", ip[i], " out of range [0, ", N, ")");
  auto out = at::empty({idx.numel(), K}, data.options().dtype(dtype));
  auto run = [&](auto* op) {
#if defined(KILN_GEMV_VNNI)
    // A range of whole rows (the dense fallback): 16 channels per block at a time.
    const int64_t count = idx.numel();
    bool range = count >= kTile;
    for (int64_t i = 1; range && i < count; ++i) range = ip[i] == ip[0] + i;
    if (range) return dequantize_tiles(w, ip[0], ip[0] + count, op);
#endif
    dequantize_kernel(w, ip, idx.numel(), op);
  };
  if (dtype == at::kFloat) run(out.data_ptr<float>());
  else run(out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace

// The same functions as dispatcher ops, so that torch.compile traces them as opaque nodes
// (kiln_x86.gemv gives them fake implementations); eager calls use the pybind functions.
TORCH_LIBRARY(KILN_GEMV_LIBRARY, m) {
  m.def(
      "dequantize(Tensor data, Tensor ids, int N, int K, int bits, int group, bool mins, bool f16, "
      "int offset, ScalarType dtype) -> Tensor");
#if defined(KILN_GEMV_INT8)
  m.def(
      "gemv(Tensor x, Tensor data, int N, int bits, int group, bool mins, bool f16, int offset) -> "
      "Tensor");
#endif
#if defined(KILN_GEMV_AMX)
  m.def(
      "gemm_amx(Tensor x, Tensor data, int N, int bits, int group, bool mins, bool f16, int "
      "offset) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(KILN_GEMV_LIBRARY, CPU, m) {
  m.impl("dequantize", &dequantize);
#if defined(KILN_GEMV_INT8)
  m.impl("gemv", &gemv);
#endif
#if defined(KILN_GEMV_AMX)
  m.impl("gemm_amx", &gemm_amx);
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize", &dequantize, "rows of a tiled GGUF weight, float32 or bfloat16");
  m.def(
      "set_pool_helpers",
      [](const std::vector<int>& cpus) { kiln_x86::WorkPool::instance().set_helpers(cpus); },
      "one helper thread per core id (-1: unpinned) that shares gemv's calls with the caller");
  m.def(
      "pool_helpers", [] { return kiln_x86::WorkPool::instance().helpers(); },
      "the number of helper threads gemv's decode calls share their work with");
  m.def(
      "pool_handle",
      [] { return reinterpret_cast<uintptr_t>(kiln_x86::WorkPool::handle()); },
      "the address of this pool's entry points, for another kiln-x86 extension's attach_pool");
#if defined(KILN_GEMV_INT8)
  m.def("gemv", &gemv,
        "x @ w.T for a tiled GGUF weight, activations rounded to int8 (AVX512-VNNI or AVX2)");
#endif
#if defined(KILN_GEMV_AMX)
  m.def("gemm_amx", &gemm_amx, "gemv's results for many rows, through AMX tiles");
  m.def("amx_ready", &amx_ready, "whether this process may use AMX tiles (asks Linux once)");
#endif
}
