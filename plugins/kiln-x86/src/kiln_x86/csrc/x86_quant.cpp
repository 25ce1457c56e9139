// kiln-x86 weight-only matmul for GGUF quantized weights (kiln_x86/quant.py packs them).
//
// Packed layout, one row per output channel n, groups of `group` weights along the input:
//   w[n, k] = scales[n, g] * q[n, k] + mins[n, g]    (g = k / group; no mins: symmetric)
// - 4-bit (Q4_0, Q4_1, Q4_K): qweight uint8 [N, K / 2]; group 32; each group is 16 bytes, byte i
//   holding element i in its low nibble and element i + 16 in its high one (GGUF's Q4_0 order).
//   Without mins the nibble is offset by 8: w = scale * (q - 8) (Q4_0).
// - 8-bit (Q8_0, Q5_K, Q6_K): qweight int8 [N, K]; group 32 (Q6_K: 16).
// Every product scale * q is exact in float32 (at most 24 significant bits), and the weight is
// formed with one rounding, as gguf's dequantization forms it, so the weights used here are
// GGUF's dequantized weights bit for bit; only the order of the float32 sums differs.
//
// matmul: for a few rows (decode) each weight group is decoded once into float32 registers and
// multiplied into up to 4 activation rows at a time (the weights are read once: the memory
// bound); parallel over output channels on torch's threads. Many rows (prefill) are the caller's
// choice: dequantize, then torch's dense GEMM.
//
// Built with -march=native: AVX-512 where the CPU has it, else AVX2 + FMA, else scalar loops.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// 16 float32 lanes: one zmm register, two ymm registers, or a plain array.
#if defined(__AVX512F__)
struct Vec {
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float f) { return {_mm512_set1_ps(f)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec from_i8(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))};
  }
  // Elements 0..15 (low nibbles) or 16..31 (high nibbles) of a 16-byte 4-bit group.
  static Vec nibbles(const uint8_t* p, bool high) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    if (high) b = _mm512_srli_epi32(b, 4);
    return {_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  // Rounded to bfloat16, nearest even (finite values: weights).
  void store_bf16(uint16_t* p) const {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(r));
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
};
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  __m256 lo, hi;
  static Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec set1(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec from_i8(const int8_t* p) {
    const __m128i b = _mm_loadu_si128((const __m128i*)p);
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
  }
  static Vec nibbles(const uint8_t* p, bool high) {
    __m128i b = _mm_loadu_si128((const __m128i*)p);
    if (high) b = _mm_srli_epi16(b, 4);
    b = _mm_and_si128(b, _mm_set1_epi8(0xF));
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  static __m256i round_bf16(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
  }
  // Rounded to bfloat16, nearest even (finite values: weights).
  void store_bf16(uint16_t* p) const {
    // packus interleaves 128-bit lanes; the permute puts the 16 results back in order.
    const __m256i packed = _mm256_packus_epi32(round_bf16(lo), round_bf16(hi));
    _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(packed, 0xD8));
  }
  float sum() const {
    __m256 s = _mm256_add_ps(lo, hi);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }
};
inline Vec fma(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
#else
struct Vec {
  float v[16];
  static Vec zero() { return set1(0.0f); }
  static Vec set1(float f) {
    Vec r;
    for (int i = 0; i < 16; ++i) r.v[i] = f;
    return r;
  }
  static Vec load(const float* p) {
    Vec r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static Vec from_i8(const int8_t* p) {
    Vec r;
    for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  static Vec nibbles(const uint8_t* p, bool high) {
    Vec r;
    for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(high ? p[i] >> 4 : p[i] & 0xF);
    return r;
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
  void store_bf16(uint16_t* p) const {
    for (int i = 0; i < 16; ++i) p[i] = c10::BFloat16(v[i]).x;
  }
  float sum() const {
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
  }
};
inline Vec fma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < 16; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline Vec mul(Vec a, Vec b) {
  for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i];
  return a;
}
inline Vec sub(Vec a, Vec b) {
  for (int i = 0; i < 16; ++i) a.v[i] -= b.v[i];
  return a;
}
inline Vec add(Vec a, Vec b) {
  for (int i = 0; i < 16; ++i) a.v[i] += b.v[i];
  return a;
}
#endif

// The packed weight of one call, as raw pointers.
struct Packed {
  const uint8_t* qweight;  // row n starts at qweight + n * row_bytes
  const float* scales;     // [N, K / group]
  const float* mins;       // [N, K / group], or null: symmetric
  int64_t N, K, group, bits, row_bytes;
};

// Weights k = 16 j .. 16 j + 15 of a row (chunk j), dequantized; exact (see the file comment).
// `shift` is log2(group / 16): chunk j's scale is s[j >> shift].
template <bool kFourBit, bool kHasMins>
inline Vec weights(const uint8_t* row, const float* s, const float* m, int64_t j, int shift) {
  const int64_t g = j >> shift;
  const Vec scale = Vec::set1(s[g]);
  if (kFourBit) {
    const Vec q = Vec::nibbles(row + g * 16, j & 1);
    if (kHasMins) return fma(q, scale, Vec::set1(m[g]));
    return mul(sub(q, Vec::set1(8.0f)), scale);
  }
  const Vec q = Vec::from_i8(reinterpret_cast<const int8_t*>(row) + j * 16);
  if (kHasMins) return fma(q, scale, Vec::set1(m[g]));
  return mul(q, scale);
}

// out[r, n] = sum_k x[r, k] w[n, k] for kRows rows of x (row stride K) and one weight row.
// Few rows get several accumulators each, so that the FMAs do not wait on one another.
template <int kRows, bool kFourBit, bool kHasMins>
void dot_rows(const Packed& p, int64_t n, const float* x, float* out, int64_t ldo) {
  constexpr int kChains = kRows == 1 ? 4 : (kRows == 2 ? 2 : 1);
  const uint8_t* row = p.qweight + n * p.row_bytes;
  const int64_t groups = p.K / p.group;
  const float* s = p.scales + n * groups;
  const float* m = kHasMins ? p.mins + n * groups : nullptr;
  const int shift = p.group == 32 ? 1 : 0;
  const int64_t chunks = p.K / 16;
  Vec acc[kRows][kChains];
  for (int r = 0; r < kRows; ++r)
    for (int a = 0; a < kChains; ++a) acc[r][a] = Vec::zero();
  int64_t j = 0;
  for (; j + kChains <= chunks; j += kChains) {
    for (int a = 0; a < kChains; ++a) {
      const Vec w = weights<kFourBit, kHasMins>(row, s, m, j + a, shift);
      for (int r = 0; r < kRows; ++r)
        acc[r][a] = fma(w, Vec::load(x + r * p.K + (j + a) * 16), acc[r][a]);
    }
  }
  for (; j < chunks; ++j) {
    const Vec w = weights<kFourBit, kHasMins>(row, s, m, j, shift);
    for (int r = 0; r < kRows; ++r) acc[r][0] = fma(w, Vec::load(x + r * p.K + j * 16), acc[r][0]);
  }
  for (int r = 0; r < kRows; ++r) {
    Vec total = acc[r][0];
    for (int a = 1; a < kChains; ++a) total = add(total, acc[r][a]);
    out[r * ldo + n] = total.sum();
  }
}

template <bool kFourBit, bool kHasMins>
void matmul_kernel(const Packed& p, const float* x, int64_t M, float* out) {
  // Enough output channels per task that a task reads at least ~64 KiB of weights.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, p.row_bytes));
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) dot_rows<4, kFourBit, kHasMins>(p, n, x + r * p.K, out + r * p.N, p.N);
      const float* xr = x + r * p.K;
      float* orow = out + r * p.N;
      switch (M - r) {
        case 3: dot_rows<3, kFourBit, kHasMins>(p, n, xr, orow, p.N); break;
        case 2: dot_rows<2, kFourBit, kHasMins>(p, n, xr, orow, p.N); break;
        case 1: dot_rows<1, kFourBit, kHasMins>(p, n, xr, orow, p.N); break;
        default: break;
      }
    }
  });
}

Packed unpack_args(const at::Tensor& qweight, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& mins, int64_t in_features, int64_t group,
                   int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group % 16 == 0 && in_features % group == 0 && (bits == 8 || group == 32),
              "group ", group, " does not divide in_features ", in_features,
              " (4-bit weights use groups of 32, 8-bit ones multiples of 16)");
  TORCH_CHECK(qweight.is_contiguous() && qweight.dim() == 2 && qweight.element_size() == 1,
              "qweight must be a contiguous 2-d uint8/int8 tensor");
  const int64_t N = qweight.size(0);
  const int64_t row_bytes = bits == 4 ? in_features / 2 : in_features;
  TORCH_CHECK(qweight.size(1) == row_bytes, "qweight has ", qweight.size(1), " bytes per row, ",
              row_bytes, " expected");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == N * (in_features / group),
              "scales must be contiguous float32 [out_features, in_features / group]");
  const float* m = nullptr;
  if (mins.has_value()) {
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->is_contiguous() &&
                    mins->numel() == scales.numel(),
                "mins must be like scales");
    m = mins->data_ptr<float>();
  }
  return {static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(), m, N,
          in_features, group, bits, row_bytes};
}

// x [M, K] (float32 or bfloat16) @ w.T -> [M, N] in x's dtype, float32 accumulation.
at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& mins, int64_t group, int64_t bits) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-d [rows, in_features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x's dtype ", x.scalar_type(), " is not supported (float32, bfloat16)");
  const Packed p = unpack_args(qweight, scales, mins, x.size(1), group, bits);
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  auto out = at::empty({M, p.N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (M > 0 && p.N > 0) {
    if (bits == 4 && p.mins) matmul_kernel<true, true>(p, xp, M, op);
    else if (bits == 4) matmul_kernel<true, false>(p, xp, M, op);
    else if (p.mins) matmul_kernel<false, true>(p, xp, M, op);
    else matmul_kernel<false, false>(p, xp, M, op);
  }
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// ---- Many rows: activations rounded to int8, u8 x s8 dot products (AVX512-VNNI vpdpbusd) ----
//
// Each activation row is quantized once per call, per block of 32 (the weight groups):
// x[k] ~= dx[b] * qx[k], qx in [-127, 127], dx = max|x| / 127. Each weight group is turned into
// unsigned bytes u = q + o (4-bit: the nibble, o = 0; 8-bit: q + 128 by flipping the sign bit, o =
// 128) and, per block, sum_k w[k] x[k] ~= d * dx * sum_k u[k] qx[k] + (mins - o' * d) * dx *
// sum_k qx[k], where o' = o + 8 for Q4_0's offset nibbles. The integer sums are exact; the
// error is the activations' rounding (at most dx / 2 per element).
constexpr int kQBlock = 32;

// The quantized activations of one call: int8 rows padded to whole pairs of blocks (64 bytes),
// dx repeated 8 times per block (the lanes of one block in a vpdpbusd result) and dx * sum(qx)
// per block, padded to 16 blocks with zeros.
struct QuantizedRows {
  at::Tensor q, dx8, sx;
  int64_t row_q, row_dx8, row_sx;
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / kQBlock;
  QuantizedRows r;
  r.row_q = (nb + 1) / 2 * 64;
  r.row_dx8 = (nb + 1) / 2 * 16;
  r.row_sx = (nb + 15) / 16 * 16;
  auto opts = at::TensorOptions().dtype(at::kFloat);
  r.q = at::zeros({M, r.row_q}, opts.dtype(at::kChar));
  r.dx8 = at::zeros({M, r.row_dx8}, opts);
  r.sx = at::zeros({M, r.row_sx}, opts);
  int8_t* qp = r.q.data_ptr<int8_t>();
  float* dp = r.dx8.data_ptr<float>();
  float* sp = r.sx.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + m * K + b * kQBlock;
        const __m512 a = _mm512_loadu_ps(xb), c = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
        const float d = amax / 127.0f;
        const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        // Nearest even (the default rounding mode); |x| * 127 / amax <= 127 (+ rounding).
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id));
        const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, id));
        const __m512i lo = _mm512_max_epi32(_mm512_min_epi32(qa, _mm512_set1_epi32(127)),
                                            _mm512_set1_epi32(-127));
        const __m512i hi = _mm512_max_epi32(_mm512_min_epi32(qc, _mm512_set1_epi32(127)),
                                            _mm512_set1_epi32(-127));
        _mm_storeu_si128((__m128i*)(qp + m * r.row_q + b * kQBlock), _mm512_cvtepi32_epi8(lo));
        _mm_storeu_si128((__m128i*)(qp + m * r.row_q + b * kQBlock + 16), _mm512_cvtepi32_epi8(hi));
        _mm256_storeu_ps(dp + m * r.row_dx8 + b * 8, _mm256_set1_ps(d));
        sp[m * r.row_sx + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi)));
      }
    }
  });
  return r;
}

// Weight blocks b, b + 1 of a row as 64 unsigned bytes in the activations' element order
// (`two` false: block b only, the upper 32 bytes zero; the activations there are zero too).
template <bool kFourBit>
inline __m512i weight_bytes(const uint8_t* row, int64_t b, bool two) {
  if (kFourBit) {
    // 16 bytes per block: low nibbles are elements 0..15, high ones 16..31.
    const __m256i g = two ? _mm256_loadu_si256((const __m256i*)(row + b * 16))
                          : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(row + b * 16)));
    const __m512i dup = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                                 _mm512_castsi256_si512(g));
    const __m512i shifted = _mm512_srlv_epi64(dup, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F));
  }
  const __m512i q = _mm512_maskz_loadu_epi8(two ? ~0ULL : 0xFFFFFFFFULL, row + b * kQBlock);
  return _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80)));
}

// out[r, n] for kRows activation rows and output channels n0..n1.
template <int kRows, bool kFourBit>
void int8_rows(const Packed& p, const QuantizedRows& xq, int64_t r0, int64_t n0, int64_t n1,
               float offset, float* corr, float* out) {
  const int64_t nb = p.K / kQBlock;
  const int8_t* q = xq.q.data_ptr<int8_t>() + r0 * xq.row_q;
  const float* dx8 = xq.dx8.data_ptr<float>() + r0 * xq.row_dx8;
  const float* sx = xq.sx.data_ptr<float>() + r0 * xq.row_sx;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.qweight + n * p.row_bytes;
    const float* s = p.scales + n * nb;
    const float* m = p.mins ? p.mins + n * nb : nullptr;
    // Per block, what multiplies dx * sum(qx): the min less the bytes' offset times the scale.
    for (int64_t b = 0; b < nb; ++b) corr[b] = (m ? m[b] : 0.0f) + offset * s[b];
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
      const bool two = b + 1 < nb;
      const __m512i w = weight_bytes<kFourBit>(row, b, two);
      const __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(s[b]), _mm256_set1_ps(two ? s[b + 1] : 0.0f), 1);
      for (int r = 0; r < kRows; ++r) {
        const __m512i xv = _mm512_loadu_si512(q + r * xq.row_q + b * kQBlock);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
        const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(dx8 + r * xq.row_dx8 + b * 8));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
      }
    }
    for (int64_t b = 0; b < xq.row_sx; b += 16) {
      const __m512 c = _mm512_loadu_ps(corr + b);
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm512_fmadd_ps(c, _mm512_loadu_ps(sx + r * xq.row_sx + b), acc[r]);
    }
    for (int r = 0; r < kRows; ++r) out[(r0 + r) * p.N + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

template <bool kFourBit>
void int8_kernel(const Packed& p, const QuantizedRows& xq, int64_t M, float offset, float* out) {
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, p.row_bytes));
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> corr(xq.row_sx, 0.0f);  // zero past the last block
    // A few output channels at a time through every row tile: their weights stay in L1.
    constexpr int64_t kChannels = 8;
    for (int64_t c0 = n0; c0 < n1; c0 += kChannels) {
      const int64_t c1 = std::min(n1, c0 + kChannels);
      int64_t r = 0;
      for (; r + 8 <= M; r += 8) int8_rows<8, kFourBit>(p, xq, r, c0, c1, offset, corr.data(), out);
      switch (M - r) {
        case 7: int8_rows<7, kFourBit>(p, xq, r, c0, c1, offset, corr.data(), out); break;
        case 6: int8_rows<6, kFourBit>(p, xq, r, c0, c1, offset, corr.data(), out); break;
        case 5: int8_rows<5, kFourBit>(p, xq, r, c0, c1, offset, corr.data(), out); break;
        case 4: int8_rows<4, kFourBit>(p, xq, r, c0, c1, offset, corr.data(), out); break;
        case 3: int8_rows<3, kFourBit>(p, xq, r, c0, c1, offset, corr.data(), out); break;
        case 2: int8_rows<2, kFourBit>(p, xq, r, c0, c1, offset, corr.data(), out); break;
        case 1: int8_rows<1, kFourBit>(p, xq, r, c0, c1, offset, corr.data(), out); break;
        default: break;
      }
    }
  });
}

// x [M, K] @ w.T with x rounded to int8 per block of 32 (groups of 32 only): [M, N] in x's dtype.
at::Tensor qmatmul_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t group, int64_t bits) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-d [rows, in_features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x's dtype ", x.scalar_type(), " is not supported (float32, bfloat16)");
  TORCH_CHECK(group == kQBlock, "the int8 kernel takes groups of 32, got ", group);
  const Packed p = unpack_args(qweight, scales, mins, x.size(1), group, bits);
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  auto out = at::empty({M, p.N}, xf.options());
  if (M > 0 && p.N > 0) {
    const QuantizedRows xq = quantize_rows(xf.data_ptr<float>(), M, p.K);
    // The unsigned bytes' offset: 8-bit q + 128; Q4_0's nibbles are q + 8 (no mins).
    const float offset = bits == 8 ? -128.0f : (p.mins ? 0.0f : -8.0f);
    if (bits == 4) int8_kernel<true>(p, xq, M, offset, out.data_ptr<float>());
    else int8_kernel<false>(p, xq, M, offset, out.data_ptr<float>());
  }
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}
#endif

inline void store_as(const Vec& w, float* out) { w.store(out); }

// Round to nearest even, as torch's float32 -> bfloat16 conversion does.
inline void store_as(const Vec& w, c10::BFloat16* out) {
  w.store_bf16(reinterpret_cast<uint16_t*>(out));
}

template <typename T, bool kFourBit, bool kHasMins>
void dequantize_kernel(const Packed& p, T* out) {
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, p.row_bytes));
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = p.qweight + n * p.row_bytes;
      const int64_t groups = p.K / p.group;
      const float* s = p.scales + n * groups;
      const float* m = kHasMins ? p.mins + n * groups : nullptr;
      const int shift = p.group == 32 ? 1 : 0;
      T* orow = out + n * p.K;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        // 32 weights per conversion instruction (K is a multiple of 32), nearest even.
        for (int64_t j = 0; j < p.K / 16; j += 2) {
          const __m512bh w = _mm512_cvtne2ps_pbh(weights<kFourBit, kHasMins>(row, s, m, j + 1, shift).v,
                                                 weights<kFourBit, kHasMins>(row, s, m, j, shift).v);
          _mm512_storeu_si512(orow + j * 16, (__m512i)w);
        }
        continue;
      }
#endif
      for (int64_t j = 0; j < p.K / 16; ++j) {
        store_as(weights<kFourBit, kHasMins>(row, s, m, j, shift), orow + j * 16);
      }
    }
  });
}

// The weight [N, K] in float32 (GGUF's dequantized values, bit for bit) or bfloat16 (those
// values rounded to nearest even).
at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& mins, int64_t in_features, int64_t group,
                      int64_t bits, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype ", dtype,
              " is not supported (float32, bfloat16)");
  const Packed p = unpack_args(qweight, scales, mins, in_features, group, bits);
  auto out = at::empty({p.N, in_features}, scales.options().dtype(dtype));
  auto run = [&](auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    if (bits == 4 && p.mins) dequantize_kernel<T, true, true>(p, op);
    else if (bits == 4) dequantize_kernel<T, true, false>(p, op);
    else if (p.mins) dequantize_kernel<T, false, true>(p, op);
    else dequantize_kernel<T, false, false>(p, op);
  };
  if (dtype == at::kFloat) run(out.data_ptr<float>());
  else run(out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace

// The same functions as dispatcher ops, so that torch.compile traces them as opaque nodes
// (kiln_x86.quant gives them fake implementations); eager calls use the pybind functions.
TORCH_LIBRARY(kiln_x86_quant, m) {
  m.def(
      "qmatmul(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int group, int bits) -> "
      "Tensor");
  m.def(
      "dequantize(Tensor qweight, Tensor scales, Tensor? mins, int in_features, int group, int bits, "
      "ScalarType dtype) -> Tensor");
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.def(
      "qmatmul_int8(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int group, int bits) -> "
      "Tensor");
#endif
}

TORCH_LIBRARY_IMPL(kiln_x86_quant, CPU, m) {
  m.impl("qmatmul", &qmatmul);
  m.impl("dequantize", &dequantize);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.impl("qmatmul_int8", &qmatmul_int8);
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "x @ dequantized(w).T for a packed GGUF weight");
  m.def("dequantize", &dequantize, "the weight of a packed GGUF weight, float32 or bfloat16");
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.def("qmatmul_int8", &qmatmul_int8,
        "x @ dequantized(w).T with x rounded to int8 per block of 32 (AVX512-VNNI)");
#endif
}
