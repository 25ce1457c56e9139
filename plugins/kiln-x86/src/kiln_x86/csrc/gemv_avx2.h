// kiln-x86: the tiled int8 matmul's AVX2 (+ FMA, F16C) kernel, for CPUs without AVX512-VNNI.
// Included by x86_gemv.cpp inside its anonymous namespace, in place of the VNNI kernel's
// quantize_acts / tile_rows / max_rows / store_tile_row (it uses that file's Layout, Acts, kTile,
// kBlock and weight_bytes); x86_gemv.cpp's driver (gemv_kernel) runs either.
//
// The same results as the VNNI kernel, bit for bit:
// - Activations: rounded with the same float32 operations (max|x| over the block, 127 / amax,
//   x * id to nearest even, clamped to +-127; dx = amax / 127), so q, dx and the sums agree.
// - Integer sums: a 32-byte half of a 64-byte weight row is 8 channels x 4 inputs; vpmaddubsw
//   (u8 weights x s8 broadcast activations, pairs summed to int16) then vpmaddwd by ones gives
//   vpdpbusd's 4-product int32 sums. 4 to 6 bits: a pair is at most 2 * 63 * 127 < 2**15, so no
//   int16 saturates, and the offset enters as -offset * sum(qx) as in the VNNI kernel. 8 bits (u
//   up to 255): the signed weight w = u - 128 as |w| (<= 128) times qx with w's sign (vpsignb),
//   pairs at most 2 * 128 * 127 < 2**15; the sum then starts at -(offset - 128) * sum(qx). Integer
//   sums are exact in any order, so they equal VNNI's.
// - Float part: per block, per channel, the same operations in the same order:
//   acc = fma(float(isum), scale * dx, acc) per scale group, then acc = fma(min, dsum, acc).
// - Output: float32 as is; bfloat16 rounded to nearest even as the VNNI kernel's store_row.
#pragma once

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t reduce_add8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Rows m0..m1 of x, each on its own: the VNNI kernel's quantize_acts, 8 lanes at a time.
template <typename T>
void quantize_acts(const T* x, int64_t m0, int64_t m1, int64_t K, int8_t* q, float* dx,
                   int32_t* s16) {
  const int64_t nb = K / kBlock;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i lim = _mm256_set1_epi32(127), neg = _mm256_set1_epi32(-127);
  // packs_epi32 then packs_epi16 leave 4-byte groups in the order 0 2 4 6 1 3 5 7 of the input.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const T* xb = x + m * K + b * kBlock;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = load8(xb + 8 * i);
      const __m256 amax8 =
          _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                        _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
      const float amax = reduce_max8(amax8);
      const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m256i qi[4];
      for (int i = 0; i < 4; ++i)
        qi[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], id)), lim),
                                 neg);
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                               _mm256_packs_epi32(qi[2], qi[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * K + b * kBlock),
                          _mm256_permutevar8x32_epi32(bytes, order));
      dx[m * nb + b] = amax / 127.0f;
      s16[m * 2 * nb + 2 * b] = reduce_add8(_mm256_add_epi32(qi[0], qi[1]));
      s16[m * 2 * nb + 2 * b + 1] = reduce_add8(_mm256_add_epi32(qi[2], qi[3]));
    }
  }
}

// 8 channels' scales (or mins) from c0 of a block record's 16.
template <bool kF16>
inline __m256 load_scales8(const uint8_t* p, int c0) {
  if constexpr (kF16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * c0)));
  else
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + c0);
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Bytes 0xFF where bit i of m is set (byte i), else 0.
inline __m256i expand_mask(const uint8_t* p) {
  int32_t m;
  std::memcpy(&m, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(m), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                             2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bits = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
}

// Bit planes 4.. of one half h of one j, for the 8 channels of half q of the 64-byte row.
template <int kBits>
inline __m256i add_planes(__m256i v, const uint8_t* masks, int q) {
  v = _mm256_or_si256(v, _mm256_and_si256(expand_mask(masks + 4 * q), _mm256_set1_epi8(0x10)));
  if constexpr (kBits == 6)
    v = _mm256_or_si256(v, _mm256_and_si256(expand_mask(masks + 8 + 4 * q), _mm256_set1_epi8(0x20)));
  return v;
}

// 8 int32 lanes += the 4-product sums of u8 weights w and s8 activations x (pairs fit int16).
inline __m256i dot4(__m256i isum, __m256i w, __m256i x) {
  return _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

// res[t][r][c] for kRows rows r0.. and the 16 channels of each of kTiles tiles from `tile`, as
// the VNNI kernel's tile_rows (same sums, same float operations per element, same order); each
// tile's 16 channels are two halves q of 8 (bytes 32 q.. of each 64-byte row).
template <int kBits, int kGroups, bool kMins, bool kF16, int kRows, int kTiles>
void tile_rows(const Layout& w, const Acts& a, int64_t tile, int64_t r0, float* res) {
  constexpr int64_t kScale = kF16 ? 2 : 4;
  constexpr int64_t kWeights = weight_bytes(kBits);
  constexpr int kPlanes = kBits == 8 ? 0 : kBits - 4;
  const int64_t K = w.K, nb = w.nb;
  // 8 bits: the sums of (u - 128) * qx, so the offset's term is what is left of it.
  const int32_t offset = static_cast<int32_t>(kBits == 8 ? w.offset - 128 : w.offset);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const uint8_t* recs[kTiles];
  for (int t = 0; t < kTiles; ++t) recs[t] = w.data + (tile + t) * nb * w.rec;
  __m256 acc[kRows][kTiles][2];
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kTiles; ++t) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i isum[kRows][kTiles][2][kGroups];
    for (int r = 0; r < kRows; ++r) {
      const int32_t* s = a.s16 + (r0 + r) * 2 * nb + 2 * b;
      for (int t = 0; t < kTiles; ++t) {
        for (int q = 0; q < 2; ++q) {
          if constexpr (kMins) {
            isum[r][t][q][0] = _mm256_setzero_si256();
          } else if constexpr (kGroups == 1) {
            isum[r][t][q][0] = _mm256_set1_epi32(-offset * (s[0] + s[1]));
          } else {
            isum[r][t][q][0] = _mm256_set1_epi32(-offset * s[0]);
            isum[r][t][q][1] = _mm256_set1_epi32(-offset * s[1]);
          }
        }
      }
    }
    const int8_t* xq = a.q + r0 * K + b * kBlock;
    if constexpr (kBits == 8) {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < 4; ++j) {
          __m256i sw[kTiles][2], aw[kTiles][2];  // w = u - 128 and |w|
          for (int t = 0; t < kTiles; ++t) {
            for (int q = 0; q < 2; ++q) {
              const __m256i u =
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(recs[t] + (h * 4 + j) * 64 + 32 * q));
              sw[t][q] = _mm256_xor_si256(u, flip);
              aw[t][q] = _mm256_abs_epi8(sw[t][q]);
            }
          }
          for (int r = 0; r < kRows; ++r) {
            const __m256i x = bcast4(xq + r * K + 16 * h + 4 * j);
            for (int t = 0; t < kTiles; ++t) {
              for (int q = 0; q < 2; ++q)
                isum[r][t][q][0] = dot4(isum[r][t][q][0], aw[t][q], _mm256_sign_epi8(x, sw[t][q]));
            }
          }
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        __m256i lo[kTiles][2], hi[kTiles][2];
        for (int t = 0; t < kTiles; ++t) {
          for (int q = 0; q < 2; ++q) {
            const __m256i v =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(recs[t] + j * 64 + 32 * q));
            lo[t][q] = _mm256_and_si256(v, low4);
            hi[t][q] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if constexpr (kPlanes > 0) {
              const uint8_t* masks = recs[t] + 256 + j * 2 * kPlanes * 8;
              lo[t][q] = add_planes<kBits>(lo[t][q], masks, q);
              hi[t][q] = add_planes<kBits>(hi[t][q], masks + kPlanes * 8, q);
            }
          }
        }
        for (int r = 0; r < kRows; ++r) {
          const __m256i xl = bcast4(xq + r * K + 4 * j), xh = bcast4(xq + r * K + 16 + 4 * j);
          for (int t = 0; t < kTiles; ++t) {
            for (int q = 0; q < 2; ++q) {
              isum[r][t][q][0] = dot4(isum[r][t][q][0], lo[t][q], xl);
              isum[r][t][q][kGroups - 1] = dot4(isum[r][t][q][kGroups - 1], hi[t][q], xh);
            }
          }
        }
      }
    }
    for (int t = 0; t < kTiles; ++t) {
      const uint8_t* sp = recs[t] + kWeights;
      for (int q = 0; q < 2; ++q) {
        __m256 scale[kGroups];
        for (int g = 0; g < kGroups; ++g) scale[g] = load_scales8<kF16>(sp + g * kTile * kScale, 8 * q);
        const __m256 mins = kMins ? load_scales8<kF16>(sp + kGroups * kTile * kScale, 8 * q) : scale[0];
        for (int r = 0; r < kRows; ++r) {
          const __m256 d = _mm256_set1_ps(a.dx[(r0 + r) * nb + b]);
          __m256 v = acc[r][t][q];
          for (int g = 0; g < kGroups; ++g)
            v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][t][q][g]), _mm256_mul_ps(scale[g], d), v);
          if constexpr (kMins) v = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.dsum[(r0 + r) * nb + b]), v);
          acc[r][t][q] = v;
        }
      }
    }
    for (int t = 0; t < kTiles; ++t) recs[t] += w.rec;
  }
  for (int t = 0; t < kTiles; ++t) {
    for (int r = 0; r < kRows; ++r) {
      for (int q = 0; q < 2; ++q) _mm256_storeu_ps(res + (t * kRows + r) * kTile + 8 * q, acc[r][t][q]);
    }
  }
}

// Rows per pass over kTiles tiles (AVX2 has 16 vector registers: 2 accumulators per row and
// tile, the block's sums and weights beside them).
template <int kGroups, int kTiles>
constexpr int max_rows() {
  return kGroups == 2 ? 1 : (kTiles == 1 ? 4 : 2);
}

inline void store_tile_row(const float* res, float* out, int64_t count) {
  std::memcpy(out, res, count * sizeof(float));
}

inline void store_tile_row(const float* res, c10::BFloat16* out, int64_t count) {
  // Nearest even, as the VNNI kernel's store_row (results are finite).
  alignas(32) uint16_t bits[kTile];
  for (int q = 0; q < 2; ++q) {
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(res + 8 * q));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    // Values below 2**16: the unsigned pack is exact; it interleaves the 128-bit lanes.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_store_si128(reinterpret_cast<__m128i*>(bits + 8 * q), _mm256_castsi256_si128(packed));
  }
  std::memcpy(out, bits, count * sizeof(uint16_t));
}
