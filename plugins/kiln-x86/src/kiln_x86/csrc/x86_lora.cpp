// kiln-x86 LoRA kernel: the `lora_apply` op (kiln.model_executor.layers.lora) for decode-sized
// batches, on the calling thread.
//
// For each token t with slot s = indices[t] >= 0 (slots first_slot .. end_slot - 1 only):
//   shrink[k] = sum_i lora_a[s, k, i] * x[t, i]                       (k < K, float32 sums)
//   y[t, o]  += sum_k shrink[k] * lora_b[s, k, o]                      (float32, rounded once)
// lora_b is block-diagonal (a fused layer's n slices): with the slices' widths given, row k
// (block k / (K / n)) is read and added over its slice's columns only. Rows of A past an
// adapter's rank are zero: their shrink is zero and the expand skips them.
//
// Why one thread: at decode sizes (a few tokens, rank 8-16) the op is a few hundred thousand
// multiply-adds, far less than the cost of waking and joining torch's OpenMP team on a busy
// machine; three small ATen calls per layer (shrink, mask, expand) each pay that. The Python side
// routes larger batches (prefills) to the reference, whose matmuls are blocked and parallel.
#include <torch/extension.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

#include "bf16.h"
#include "dot.h"

namespace {

using kiln_x86::dot;
using kiln_x86::round_to;
using kiln_x86::to_float;

template <typename T>
void lora_apply_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                     const at::Tensor& lora_b, const at::Tensor& indices, int64_t first_slot,
                     int64_t end_slot, const std::vector<int64_t>& slices) {
  const int64_t num_tokens = x.size(0), in = x.size(1);
  const int64_t width = lora_a.size(1), out = lora_b.size(2);
  // Each row's output columns: its block's slice, or every column without slices.
  const int64_t block = slices.empty() ? width : width / static_cast<int64_t>(slices.size());
  std::vector<int64_t> col_begin(width, 0), col_end(width, out);
  if (!slices.empty()) {
    int64_t offset = 0;
    for (size_t i = 0; i < slices.size(); ++i) {
      for (int64_t k = i * block; k < (static_cast<int64_t>(i) + 1) * block; ++k) {
        col_begin[k] = offset;
        col_end[k] = offset + slices[i];
      }
      offset += slices[i];
    }
  }
  const T* xp = x.data_ptr<T>();
  const T* ap = lora_a.data_ptr<T>();
  const T* bp = lora_b.data_ptr<T>();
  const int64_t* slot_of = indices.data_ptr<int64_t>();
  T* yp = y.data_ptr<T>();
  std::vector<float> xf(in), shrink(width), acc(out);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t s = slot_of[t];
    if (s < first_slot || s >= end_slot) continue;  // -1: the base model
    for (int64_t i = 0; i < in; ++i) xf[i] = to_float(xp[t * in + i]);
    const T* a = ap + s * width * in;
    for (int64_t k = 0; k < width; ++k) shrink[k] = dot(a + k * in, xf.data(), in);
    T* yt = yp + t * out;
    for (int64_t o = 0; o < out; ++o) acc[o] = to_float(yt[o]);
    const T* b = bp + s * width * out;
    for (int64_t k = 0; k < width; ++k) {
      const float c = shrink[k];
      if (c == 0.f) continue;  // a row past the adapter's rank
      const T* bk = b + k * out;
      for (int64_t o = col_begin[k]; o < col_end[k]; ++o) acc[o] += c * to_float(bk[o]);
    }
    for (int64_t o = 0; o < out; ++o) yt[o] = round_to<T>(acc[o]);
  }
}

// y [T, out] += each token's adapter, in place; returns y.
at::Tensor lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a,
                      const at::Tensor& lora_b, const at::Tensor& indices, int64_t first_slot,
                      int64_t end_slot, const std::vector<int64_t>& slices) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3,
              "lora_apply: y [T, out], x [T, in], lora_a [S, K, in], lora_b [S, K, out]");
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && lora_a.is_contiguous() &&
                  lora_b.is_contiguous() && indices.is_contiguous(),
              "lora_apply: contiguous tensors only");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && lora_a.scalar_type() == y.scalar_type() &&
                  lora_b.scalar_type() == y.scalar_type(),
              "lora_apply: one dtype for y, x, lora_a and lora_b");
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.numel() == x.size(0),
              "lora_apply: indices [T] int64");
  TORCH_CHECK(lora_a.size(2) == x.size(1) && lora_b.size(2) == y.size(1) &&
                  lora_a.size(1) == lora_b.size(1) && lora_a.size(0) == lora_b.size(0) &&
                  y.size(0) == x.size(0),
              "lora_apply: shapes do not match");
  TORCH_CHECK(0 <= first_slot && first_slot <= end_slot && end_slot <= lora_a.size(0),
              "lora_apply: slot range outside the slots");
  int64_t total = 0;
  for (int64_t size : slices) total += size;
  TORCH_CHECK(slices.empty() || (total == y.size(1) &&
                                 lora_a.size(1) % static_cast<int64_t>(slices.size()) == 0),
              "lora_apply: the slices must sum to out and divide K");
  if (y.scalar_type() == at::kFloat) {
    lora_apply_impl<float>(y, x, lora_a, lora_b, indices, first_slot, end_slot, slices);
  } else if (y.scalar_type() == at::kBFloat16) {
    lora_apply_impl<c10::BFloat16>(y, x, lora_a, lora_b, indices, first_slot, end_slot,
                                   slices);
  } else {
    TORCH_CHECK(false, "lora_apply: float32 or bfloat16 only");
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_apply", &lora_apply, "per-token LoRA added to a linear layer's output (in place)");
}
