// kiln-x86 dense bfloat16 matmul (AVX512-BF16): y = x @ W.T + bias for any number of rows, on
// the work pool (the model's thread and its helpers). kiln_x86/dense.py packs the weights and
// documents the contract.
//
// Layout: output channels in tiles of 16 (the last one padded with zero channels); per tile, the
// K / 2 input pairs one after the other, each one 64-byte line holding 16 channels x 2 inputs,
// element 2 c + t = channel c, input 2 p + t. One vdpbf16ps then adds a pair of inputs, broadcast
// from a row of x, times that line to the tile's 16 float32 sums: no horizontal reduction, and a
// decode row reads each weight line once, at memory speed.
//
// Work: chunks of (up to kRowsPerChunk rows) x (a group of 2 or 4 tiles), claimed from the work
// pool; inside a chunk, blocks of up to 6 rows x the group's tiles keep their sums in registers
// (one 64-byte weight line feeds every row of the block). Every (row, channel) result is one
// float32 chain over the input pairs in order, then plus the bias, rounded once to bfloat16: the
// same whatever the number of rows, the blocking or the threads, bit for bit.
#include <torch/extension.h>

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "work_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#define KILN_DENSE_BF16 1
#endif

namespace {

#ifdef KILN_DENSE_BF16

constexpr int64_t kTile = 16;
constexpr int64_t kRowsPerChunk = 48;
constexpr int kMaxRows = 6;
constexpr int64_t kPrefetchLines = 8;

struct Problem {
  const uint16_t* x;      // [rows, k]
  const uint16_t* w;      // [tiles, k / 2, 32]
  const float* bias;      // [tiles * 16] or null
  uint16_t* y;            // [rows, n]
  int64_t rows, k, n, tiles;
};

// Rows [r0, r0 + R) x tiles [t0, t0 + T) of y.
template <int R, int T>
void block(const Problem& p, int64_t r0, int64_t t0) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t pairs = p.k / 2;
  const uint16_t* w[T];
  for (int t = 0; t < T; ++t) w[t] = p.w + (t0 + t) * pairs * 32;
  const uint16_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.x + (r0 + r) * p.k;
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh lines[T];
    for (int t = 0; t < T; ++t) {
      _mm_prefetch(reinterpret_cast<const char*>(w[t] + (i + kPrefetchLines) * 32), _MM_HINT_T0);
      lines[t] = (__m512bh)_mm512_loadu_si512(w[t] + i * 32);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x[r] + 2 * i, sizeof(pair));
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], lines[t], b);
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t c0 = (t0 + t) * kTile;
    const int64_t valid = std::min<int64_t>(kTile, p.n - c0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + c0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][t], bias));
      _mm256_mask_storeu_epi16(p.y + (r0 + r) * p.n + c0, mask, (__m256i)out);
    }
  }
}

template <int T>
void rows_block(const Problem& p, int64_t r0, int rows, int64_t t0) {
  switch (rows) {
    case 1: return block<1, T>(p, r0, t0);
    case 2: return block<2, T>(p, r0, t0);
    case 3: return block<3, T>(p, r0, t0);
    case 4: return block<4, T>(p, r0, t0);
    case 5: return block<5, T>(p, r0, t0);
    default: return block<6, T>(p, r0, t0);
  }
}

void tiles_block(const Problem& p, int64_t r0, int rows, int64_t t0, int tiles) {
  switch (tiles) {
    case 1: return rows_block<1>(p, r0, rows, t0);
    case 2: return rows_block<2>(p, r0, rows, t0);
    case 3: return rows_block<3>(p, r0, rows, t0);
    default: return rows_block<4>(p, r0, rows, t0);
  }
}

#endif  // KILN_DENSE_BF16

// x [rows, k] bf16 @ tiled [tiles, k / 2, 32] bf16 (+ bias [tiles * 16] float32) -> [rows, n].
at::Tensor linear(const at::Tensor& x, const at::Tensor& tiled, const c10::optional<at::Tensor>& bias,
                  int64_t n) {
#ifdef KILN_DENSE_BF16
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "dense linear: x must be contiguous [rows, k] bfloat16");
  TORCH_CHECK(tiled.dim() == 3 && tiled.scalar_type() == at::kBFloat16 && tiled.is_contiguous() &&
                  tiled.size(2) == 32 && tiled.size(1) * 2 == x.size(1) &&
                  tiled.size(0) * kTile >= n && (tiled.size(0) - 1) * kTile < n,
              "dense linear: the tiled weight [ceil(n / 16), k / 2, 32] does not match x and n");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->size(0) == tiled.size(0) * kTile,
                "dense linear: bias must be float32 [tiles * 16] (zero past n)");
  }
  Problem p{};
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  p.x = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  p.w = reinterpret_cast<const uint16_t*>(tiled.data_ptr<at::BFloat16>());
  p.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  p.y = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  p.rows = x.size(0);
  p.k = x.size(1);
  p.n = n;
  p.tiles = tiled.size(0);
  if (p.rows == 0) return y;
  // Decode-sized calls: groups of 2 tiles, so that a small layer still has chunks for every
  // thread; larger ones: 4, so that a block's weight lines feed 6 rows x 4 tiles of sums.
  const int group = p.rows <= 4 ? 2 : 4;
  const int64_t groups = (p.tiles + group - 1) / group;
  const int64_t row_chunks = (p.rows + kRowsPerChunk - 1) / kRowsPerChunk;
  kiln_x86::parallel_range(0, groups * row_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t g = c / row_chunks, rc = c % row_chunks;
      const int64_t t0 = g * group;
      const int tiles = static_cast<int>(std::min<int64_t>(group, p.tiles - t0));
      const int64_t r_end = std::min(p.rows, (rc + 1) * kRowsPerChunk);
      for (int64_t r0 = rc * kRowsPerChunk; r0 < r_end; r0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, r_end - r0));
        tiles_block(p, r0, rows, t0, tiles);
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "dense linear: built without AVX512-BF16");
  return x;
#endif
}

}  // namespace

// A dispatcher op, so that a traced decode graph records the call with the tiled weight as its
// constant and replays it without returning to Python.
#ifdef KILN_DENSE_BF16
TORCH_LIBRARY(kiln_x86_dense_bf16, m) {
  m.def("linear(Tensor x, Tensor tiled, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_x86_dense_bf16, CPU, m) { m.impl("linear", &linear); }
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#ifdef KILN_DENSE_BF16
  m.def("linear", &linear, "x @ W.T + bias, bfloat16, W in the 16-channel tiled layout");
#endif
  kiln_x86::def_attach_pool(m);
}
