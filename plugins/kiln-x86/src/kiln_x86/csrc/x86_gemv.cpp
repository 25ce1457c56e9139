// kiln-x86 decode matmul for GGUF weights in a tiled layout, with int8 activations (AVX512-VNNI).
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
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KILN_GEMV_VNNI 1
#include <immintrin.h>
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

#if defined(KILN_GEMV_VNNI)

// The activations of one call, rounded: q [M, K] int8, dx [M, nb], s16 [M, 2 nb] (sum of qx
// over each half block of 16).
struct Acts {
  const int8_t* q;
  const float* dx;
  const int32_t* s16;
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

template <typename T>
void quantize_acts(const T* x, int64_t M, int64_t K, int8_t* q, float* dx, int32_t* s16) {
  const int64_t nb = K / kBlock;
  for (int64_t m = 0; m < M; ++m) {
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

// res[r][c] for kRows rows r0.. of the activations and the 16 channels of `tile`.
template <int kBits, int kGroups, bool kMins, bool kF16, int kRows>
void tile_rows(const Layout& w, const Acts& a, int64_t tile, int64_t r0, float* res) {
  constexpr int64_t kScale = kF16 ? 2 : 4;
  constexpr int64_t kWeights = weight_bytes(kBits);
  constexpr int kPlanes = kBits == 8 ? 0 : kBits - 4;
  const int64_t K = w.K, nb = w.nb;
  const int32_t offset = static_cast<int32_t>(w.offset);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* rec = w.data + tile * nb * w.rec;
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, rec += w.rec) {
    __m512i isum[kRows][kGroups];
    for (int r = 0; r < kRows; ++r) {
      const int32_t* s = a.s16 + (r0 + r) * 2 * nb + 2 * b;
      if constexpr (kGroups == 1) {
        isum[r][0] = _mm512_set1_epi32(-offset * (s[0] + s[1]));
      } else {
        isum[r][0] = _mm512_set1_epi32(-offset * s[0]);
        isum[r][1] = _mm512_set1_epi32(-offset * s[1]);
      }
    }
    const int8_t* xq = a.q + r0 * K + b * kBlock;
    if constexpr (kBits == 8) {
      for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(rec + (h * 4 + j) * 64);
          for (int r = 0; r < kRows; ++r)
            isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], v, bcast4(xq + r * K + 16 * h + 4 * j));
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(rec + j * 64);
        __m512i lo = _mm512_and_si512(v, low4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if constexpr (kPlanes > 0) {
          const uint8_t* masks = rec + 256 + j * 2 * kPlanes * 8;
          lo = add_planes<kBits>(lo, masks);
          hi = add_planes<kBits>(hi, masks + kPlanes * 8);
        }
        for (int r = 0; r < kRows; ++r) {
          isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], lo, bcast4(xq + r * K + 4 * j));
          isum[r][kGroups - 1] =
              _mm512_dpbusd_epi32(isum[r][kGroups - 1], hi, bcast4(xq + r * K + 16 + 4 * j));
        }
      }
    }
    const uint8_t* sp = rec + kWeights;
    __m512 scale[kGroups];
    for (int g = 0; g < kGroups; ++g) scale[g] = load_scales<kF16>(sp + g * kTile * kScale);
    const __m512 mins = kMins ? load_scales<kF16>(sp + kGroups * kTile * kScale) : scale[0];
    for (int r = 0; r < kRows; ++r) {
      const float dx = a.dx[(r0 + r) * nb + b];
      const __m512 d = _mm512_set1_ps(dx);
      for (int g = 0; g < kGroups; ++g)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][g]), _mm512_mul_ps(scale[g], d), acc[r]);
      if constexpr (kMins) {
        const int32_t* s = a.s16 + (r0 + r) * 2 * nb + 2 * b;
        acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(dx * static_cast<float>(s[0] + s[1])), acc[r]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(res + r * kTile, acc[r]);
}

// Rows per pass over a tile: every row's accumulators stay in registers.
template <int kGroups>
constexpr int max_rows() {
  return kGroups == 2 ? 4 : 8;
}

template <int kBits, int kGroups, bool kMins, bool kF16, int kRows = 1>
void tile_rows_n(int rows, const Layout& w, const Acts& a, int64_t tile, int64_t r0, float* res) {
  if constexpr (kRows <= max_rows<kGroups>()) {
    if (rows == kRows) return tile_rows<kBits, kGroups, kMins, kF16, kRows>(w, a, tile, r0, res);
    tile_rows_n<kBits, kGroups, kMins, kF16, kRows + 1>(rows, w, a, tile, r0, res);
  }
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

template <int kBits, int kGroups, bool kMins, bool kF16, typename T>
void gemv_kernel(const Layout& w, const Acts& a, int64_t M, T* out) {
  constexpr int kMaxRows = max_rows<kGroups>();
  // Enough tiles per task that a task streams at least ~32 KiB of weights.
  const int64_t grain = std::max<int64_t>(1, 32768 / (w.nb * w.rec));
  at::parallel_for(0, w.tiles, grain, [&](int64_t t0, int64_t t1) {
    alignas(64) float res[kMaxRows * kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile;
      const int64_t count = std::min<int64_t>(kTile, w.N - n0);
      const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
      for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - r0));
        tile_rows_n<kBits, kGroups, kMins, kF16>(rows, w, a, t, r0, res);
        for (int r = 0; r < rows; ++r) store_row(res + r * kTile, out + (r0 + r) * w.N + n0, mask);
      }
    }
  });
}

template <typename T>
void gemv_dispatch(const Layout& w, const Acts& a, int64_t M, T* out) {
  const int code = static_cast<int>(w.bits) * 100 + static_cast<int>(w.groups) * 10 +
                   (w.mins ? 2 : 0) + (w.f16 ? 1 : 0);
  switch (code) {
    case 411: return gemv_kernel<4, 1, false, true>(w, a, M, out);   // Q4_0
    case 413: return gemv_kernel<4, 1, true, true>(w, a, M, out);    // Q4_1
    case 811: return gemv_kernel<8, 1, false, true>(w, a, M, out);   // Q8_0
    case 412: return gemv_kernel<4, 1, true, false>(w, a, M, out);   // Q4_K
    case 512: return gemv_kernel<5, 1, true, false>(w, a, M, out);   // Q5_K
    case 620: return gemv_kernel<6, 2, false, false>(w, a, M, out);  // Q6_K
    default: TORCH_CHECK(false, "no tiled kernel for this format (code ", code, ")");
  }
}

// x [M, K] (float32 or bfloat16) @ w.T -> [M, N] in x's dtype.
at::Tensor gemv(const at::Tensor& x, const at::Tensor& data, int64_t N, int64_t bits,
                int64_t group, bool mins, bool f16, int64_t offset) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-d [rows, in_features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x's dtype ",
              x.scalar_type(), " is not supported (float32, bfloat16)");
  const Layout w = make_layout(data, N, x.size(1), bits, group, mins, f16, offset);
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = w.K;
  auto out = at::empty({M, N}, xc.options());
  if (M == 0) return out;
  // Scratch for the rounded activations, reused by later calls on this thread.
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> dx;
  thread_local std::vector<int32_t> s16;
  q.resize(M * K);
  dx.resize(M * w.nb);
  s16.resize(M * 2 * w.nb);
  if (xc.scalar_type() == at::kFloat)
    quantize_acts(xc.data_ptr<float>(), M, K, q.data(), dx.data(), s16.data());
  else
    quantize_acts(xc.data_ptr<c10::BFloat16>(), M, K, q.data(), dx.data(), s16.data());
  const Acts a{q.data(), dx.data(), s16.data()};
  if (out.scalar_type() == at::kFloat) gemv_dispatch(w, a, M, out.data_ptr<float>());
  else gemv_dispatch(w, a, M, out.data_ptr<c10::BFloat16>());
  return out;
}

#endif  // KILN_GEMV_VNNI

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
TORCH_LIBRARY(kiln_x86_gemv, m) {
  m.def(
      "dequantize(Tensor data, Tensor ids, int N, int K, int bits, int group, bool mins, bool f16, "
      "int offset, ScalarType dtype) -> Tensor");
#if defined(KILN_GEMV_VNNI)
  m.def(
      "gemv(Tensor x, Tensor data, int N, int bits, int group, bool mins, bool f16, int offset) -> "
      "Tensor");
#endif
}

TORCH_LIBRARY_IMPL(kiln_x86_gemv, CPU, m) {
  m.impl("dequantize", &dequantize);
#if defined(KILN_GEMV_VNNI)
  m.impl("gemv", &gemv);
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize", &dequantize, "rows of a tiled GGUF weight, float32 or bfloat16");
#if defined(KILN_GEMV_VNNI)
  m.def("gemv", &gemv, "x @ w.T for a tiled GGUF weight, activations rounded to int8 (VNNI)");
#endif
}
