// kiln-x86 mixture-of-experts kernel: the `fused_moe` op (kiln.model_executor.layers.fused_moe)
// for decode-sized batches, routing included, in one call.
//
// For hidden [T, H], router logits [T, E], the local experts' w13 [L, 2I, H] (gate rows, then up
// rows) and w2 [L, H, I], w13[i] being expert expert_offset + i (L = E, offset 0 without expert
// parallelism):
//   scores   = softmax(logits) or sigmoid(logits), float32; each token's top_k experts (highest
//              score first; on equal scores the lower index), weights renormalized if asked;
//   act[p]   = silu(w13[e, :I] . x_t) * (w13[e, I:] . x_t)   for each routed pair p = (t, e)
//   out[t]   = sum_k weight[t, k] * (w2[e_k] . act[p_k])      float32 sums, rounded once,
//              over the slots k whose expert is local (the others' pairs are never computed).
// Only the routed experts' rows are read: the pairs are grouped by expert, and each work item
// (an expert's block of rows) reads its rows once for all of that expert's tokens, each loaded
// element serving up to 4 of them (dot_rows: AVX-512 FMAs, and AVX512-BF16 dot products for the
// bfloat16 gate/up products, whose inputs are bfloat16 already). Work items of
// every routed expert run in one parallel loop, so one token's two experts share the cores.
//
// Why: at decode sizes the reference's per-expert loop is a dozen ATen calls per expert (gather,
// two matmuls, activation, weighted index_add) plus a host sync for the expert counts, each
// paying dispatch and a wake of torch's thread team; here it is one call. Larger batches
// (prefills) run the reference, whose per-expert matmuls are blocked (the Python side routes).
//
// Also the dispatcher op torch.ops.kiln_x86_moe.fused_moe, so a traced graph records it.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using kiln_x86::round_to;
using kiln_x86::to_float;

constexpr int64_t kRowBlock = 16;  // rows of one work item (one expert's)
#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;  // dot_rows multiplies bfloat16 rows by bfloat16 rows
#else
constexpr bool kBf16Dot = false;
#endif

// out[t] = sum_i a[i] * x[t][i] in float32, for t < kRows: each element of the weight row `a` is
// loaded once for all kRows input rows (an expert's tokens). With AVX-512: fused multiply-adds in
// 16 lanes, and for bfloat16 inputs and weights AVX512-BF16 dot products (the products exact,
// float32 sums); elsewhere a scalar loop.
template <int kRows, typename TA, typename TX>
void dot_rows(const TA* a, const TX* const* x, int64_t n, float* out) {
  int64_t i = 0;
  float sum[kRows] = {};
#if defined(__AVX512F__)
  __m512 acc[kRows];
  for (int t = 0; t < kRows; ++t) acc[t] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<TA, c10::BFloat16> && std::is_same_v<TX, c10::BFloat16>) {
    for (; i + 32 <= n; i += 32) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(a + i);
      for (int t = 0; t < kRows; ++t) {
        acc[t] = _mm512_dpbf16_ps(acc[t], w, (__m512bh)_mm512_loadu_si512(x[t] + i));
      }
    }
  }
#endif
  if constexpr (std::is_same_v<TX, float>) {
    for (; i + 16 <= n; i += 16) {
      __m512 w;
      if constexpr (std::is_same_v<TA, float>) {
        w = _mm512_loadu_ps(a + i);
      } else {
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i));
        w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
      }
      for (int t = 0; t < kRows; ++t) {
        acc[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x[t] + i), acc[t]);
      }
    }
  }
  for (int t = 0; t < kRows; ++t) sum[t] = _mm512_reduce_add_ps(acc[t]);
#endif
  for (int t = 0; t < kRows; ++t) {
    for (int64_t k = i; k < n; ++k) sum[t] += to_float(a[k]) * to_float(x[t][k]);
    out[t] = sum[t];
  }
}

// out[t] = sum_i a[i] * x[t][i] for t < count, in passes over `a` for up to 4 rows of x.
template <typename TA, typename TX>
void dot_many(const TA* a, const TX* const* x, int64_t count, int64_t n, float* out) {
  int64_t t = 0;
  for (; t + 4 <= count; t += 4) dot_rows<4>(a, x + t, n, out + t);
  for (; t + 2 <= count; t += 2) dot_rows<2>(a, x + t, n, out + t);
  if (t < count) dot_rows<1>(a, x + t, n, out + t);
}

struct Routing {
  std::vector<int64_t> ids;      // [T * K] expert of each (token, slot)
  std::vector<float> weights;    // [T * K]
};

Routing route(const at::Tensor& logits, int64_t top_k, bool renormalize, bool softmax) {
  const at::Tensor l = logits.to(at::kFloat).contiguous();
  const float* lp = l.data_ptr<float>();
  const int64_t num_tokens = l.size(0), num_experts = l.size(1);
  Routing r{std::vector<int64_t>(num_tokens * top_k), std::vector<float>(num_tokens * top_k)};
  std::vector<float> scores(num_experts);
  std::vector<int64_t> order(num_experts);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* row = lp + t * num_experts;
    if (softmax) {
      const float peak = *std::max_element(row, row + num_experts);
      float sum = 0.f;
      for (int64_t e = 0; e < num_experts; ++e) sum += scores[e] = std::exp(row[e] - peak);
      for (int64_t e = 0; e < num_experts; ++e) scores[e] /= sum;
    } else {
      for (int64_t e = 0; e < num_experts; ++e) scores[e] = 1.f / (1.f + std::exp(-row[e]));
    }
    for (int64_t e = 0; e < num_experts; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) {
                        return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
                      });
    float total = 0.f;
    for (int64_t k = 0; k < top_k; ++k) total += scores[order[k]];
    for (int64_t k = 0; k < top_k; ++k) {
      r.ids[t * top_k + k] = order[k];
      r.weights[t * top_k + k] = renormalize ? scores[order[k]] / total : scores[order[k]];
    }
  }
  return r;
}

template <typename T>
at::Tensor fused_moe_impl(const at::Tensor& hidden, const Routing& r, const at::Tensor& w13,
                          const at::Tensor& w2, int64_t top_k, int64_t expert_offset) {
  const int64_t num_tokens = hidden.size(0), h = hidden.size(1);
  const int64_t num_experts = w13.size(0), inter = w2.size(2);
  const int64_t num_pairs = num_tokens * top_k;
  // Each pair's local expert, or num_experts (a bucket never computed) for another rank's.
  std::vector<int64_t> local(num_pairs);
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int64_t e = r.ids[p] - expert_offset;
    local[p] = (0 <= e && e < num_experts) ? e : num_experts;
  }
  // The pairs grouped by expert (counting sort, stable): pair_order[start[e] .. start[e + 1]).
  std::vector<int64_t> start(num_experts + 2, 0), pair_order(num_pairs);
  for (int64_t p = 0; p < num_pairs; ++p) ++start[local[p] + 1];
  for (int64_t e = 0; e <= num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < num_pairs; ++p) pair_order[fill[local[p]]++] = p;
  // Work items: (expert, first row) over the routed experts only.
  std::vector<std::pair<int64_t, int64_t>> up_items, down_items;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (start[e] == start[e + 1]) continue;
    for (int64_t j = 0; j < inter; j += kRowBlock) up_items.emplace_back(e, j);
    for (int64_t j = 0; j < h; j += kRowBlock) down_items.emplace_back(e, j);
  }
  const T* xp = hidden.data_ptr<T>();
  const T* w13p = w13.data_ptr<T>();
  const T* w2p = w2.data_ptr<T>();
  // Each grouped pair's input row, for the up (x) and the down (act) products: an expert's are
  // the runs [start[e], start[e + 1]), and each weight row is read once for all of them.
  // bfloat16 inputs are multiplied as they are (AVX512-BF16), others as float32.
  using XRow = std::conditional_t<kBf16Dot && std::is_same_v<T, c10::BFloat16>, T, float>;
  std::vector<float> xf;
  if constexpr (std::is_same_v<XRow, float>) {
    xf.resize(num_tokens * h);
    for (int64_t i = 0; i < num_tokens * h; ++i) xf[i] = to_float(xp[i]);
  }
  std::vector<float> act(num_pairs * inter), y(num_pairs * h);
  std::vector<const XRow*> x_of(num_pairs);
  std::vector<const float*> act_of(num_pairs);
  for (int64_t q = 0; q < num_pairs; ++q) {
    const int64_t token = pair_order[q] / top_k;
    if constexpr (std::is_same_v<XRow, float>) {
      x_of[q] = xf.data() + token * h;
    } else {
      x_of[q] = xp + token * h;
    }
    act_of[q] = act.data() + pair_order[q] * inter;
  }
  const int64_t num_up = static_cast<int64_t>(up_items.size());
  at::parallel_for(0, num_up, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(num_pairs), upv(num_pairs);
    for (int64_t item = begin; item < end; ++item) {
      const auto [e, j0] = up_items[item];
      const T* we = w13p + e * 2 * inter * h;
      const int64_t first = start[e], count = start[e + 1] - start[e];
      for (int64_t j = j0; j < std::min(j0 + kRowBlock, inter); ++j) {
        dot_many(we + j * h, x_of.data() + first, count, h, gate.data());
        dot_many(we + (inter + j) * h, x_of.data() + first, count, h, upv.data());
        for (int64_t t = 0; t < count; ++t) {
          const float g = gate[t];
          act[pair_order[first + t] * inter + j] = g / (1.f + std::exp(-g)) * upv[t];
        }
      }
    }
  });
  const int64_t num_down = static_cast<int64_t>(down_items.size());
  at::parallel_for(0, num_down, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> part(num_pairs);
    for (int64_t item = begin; item < end; ++item) {
      const auto [e, j0] = down_items[item];
      const T* we = w2p + e * h * inter;
      const int64_t first = start[e], count = start[e + 1] - start[e];
      for (int64_t j = j0; j < std::min(j0 + kRowBlock, h); ++j) {
        dot_many(we + j * inter, act_of.data() + first, count, inter, part.data());
        for (int64_t t = 0; t < count; ++t) y[pair_order[first + t] * h + j] = part[t];
      }
    }
  });
  at::Tensor out = at::empty({num_tokens, h}, hidden.options());
  T* op = out.data_ptr<T>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < h; ++i) {
      float sum = 0.f;
      for (int64_t k = 0; k < top_k; ++k) {
        if (local[t * top_k + k] == num_experts) continue;  // another rank's expert
        sum += r.weights[t * top_k + k] * y[(t * top_k + k) * h + i];
      }
      op[t * h + i] = round_to<T>(sum);
    }
  }
  return out;
}

// See the file comment: [T, H] hidden states, [T, E] router logits -> [T, H].
at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& router_logits,
                     const at::Tensor& w13, const at::Tensor& w2, int64_t top_k,
                     bool renormalize, std::string scoring_func, int64_t expert_offset) {
  TORCH_CHECK(hidden.dim() == 2 && router_logits.dim() == 2 && w13.dim() == 3 && w2.dim() == 3,
              "fused_moe: hidden [T, H], router_logits [T, E], w13 [L, 2I, H], w2 [L, H, I]");
  TORCH_CHECK(hidden.is_contiguous() && w13.is_contiguous() && w2.is_contiguous(),
              "fused_moe: contiguous hidden states and weights only");
  TORCH_CHECK(hidden.scalar_type() == w13.scalar_type() && w2.scalar_type() == w13.scalar_type(),
              "fused_moe: one dtype for the hidden states and the weights");
  const int64_t num_experts = w13.size(0), h = hidden.size(1), inter = w2.size(2);
  const int64_t num_global = router_logits.size(1);
  TORCH_CHECK(router_logits.size(0) == hidden.size(0) && 0 <= expert_offset &&
                  expert_offset + num_experts <= num_global &&
                  w13.size(1) == 2 * inter && w13.size(2) == h && w2.size(0) == num_experts &&
                  w2.size(1) == h,
              "fused_moe: shapes do not match");
  TORCH_CHECK(1 <= top_k && top_k <= num_global, "fused_moe: top_k outside 1 .. E");
  TORCH_CHECK(scoring_func == "softmax" || scoring_func == "sigmoid",
              "fused_moe: scoring_func must be softmax or sigmoid");
  const Routing r = route(router_logits, top_k, renormalize, scoring_func == "softmax");
  if (hidden.scalar_type() == at::kFloat) {
    return fused_moe_impl<float>(hidden, r, w13, w2, top_k, expert_offset);
  }
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16, "fused_moe: float32 or bfloat16 only");
  return fused_moe_impl<c10::BFloat16>(hidden, r, w13, w2, top_k, expert_offset);
}

}  // namespace

TORCH_LIBRARY(kiln_x86_moe, m) {
  m.def(
      "fused_moe(Tensor hidden_states, Tensor router_logits, Tensor w13, Tensor w2, int top_k, "
      "bool renormalize, str scoring_func, int expert_offset=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_x86_moe, CPU, m) { m.impl("fused_moe", &fused_moe); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_moe", &fused_moe, "routed experts' SwiGLU sum, routing included");
}
