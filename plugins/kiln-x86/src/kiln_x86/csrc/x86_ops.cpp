// kiln-x86 fused CPU kernels: add + RMSNorm, neox rotary embedding, SiLU-and-mul.
//
// Each kernel makes one pass over its rows (add + RMSNorm parallel over rows: on the work
// pool's helpers where it has any, else on torch's OpenMP threads; work_pool.h) and reproduces
// the rounding steps of the Python reference it replaces
// (kiln.model_executor.layers.*.forward_native): float32 statistics, results rounded to the input
// dtype where the reference rounds. Built with -ffp-contract=off so that float32
// products are not fused into FMAs the reference does not use.
//
// The ops are declared in the `kiln_x86` torch library (callable as torch.ops.kiln_x86.*, and so
// opaque nodes under torch.compile) and also bound directly for eager calls, which skip the
// dispatcher.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "bf16.h"
#include "work_pool.h"

namespace {

// Rows per parallel task: below this much work (elements) a call stays on one thread.
constexpr int64_t kGrainElems = 16384;

int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems));
}

using kiln_x86::round_to;
using kiln_x86::to_float;

// Runs fn(tag) with a value of the kernel's element type: float32 and bfloat16 only.
template <typename Fn>
void dispatch_dtype(at::ScalarType dtype, const char* op, Fn&& fn) {
  if (dtype == at::kFloat) {
    fn(float{});
  } else if (dtype == at::kBFloat16) {
    fn(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": dtype ", dtype, " is not supported (float32, bfloat16)");
  }
}

void check_cpu_contiguous_last(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " must be contiguous in its last dim");
}

// bfloat16 add + RMSNorm in Hugging Face's rounding order, in two passes around one ATen
// reduction: pass 1 rounds x + residual to bfloat16 and writes its float32 squares; ATen's own
// `mean` averages them (the sum in the reference's order, so the variance is the reference's
// bit for bit); pass 2 scales by 1 / sqrt(variance + eps) (IEEE division and square root, as
// ATen's rsqrt), rounds, and multiplies by the weight with one more rounding, as the reference's
// bfloat16 `weight * x` does.
std::vector<at::Tensor> rms_norm_bf16(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                      const at::Tensor& weight, double eps) {
  using T = c10::BFloat16;
  const int64_t d = x.size(-1);
  const auto x2 = x.reshape({-1, d});
  const int64_t rows = x2.size(0);
  at::Tensor r2, sum;
  if (residual.has_value()) {
    r2 = residual->reshape({-1, d});
    sum = at::empty({rows, d}, x.options());
  }
  const auto w = weight.contiguous();
  auto squares = at::empty({rows, d}, x.options().dtype(at::kFloat));
  auto out = at::empty({rows, d}, x.options());
  const T* xp = x2.data_ptr<T>();
  const T* rp = residual.has_value() ? r2.data_ptr<T>() : nullptr;
  T* sp = residual.has_value() ? sum.data_ptr<T>() : nullptr;
  float* qp = squares.data_ptr<float>();
  const int64_t xs = x2.stride(0), rs = residual.has_value() ? r2.stride(0) : 0;
  kiln_x86::parallel_range(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = xp + t * xs;
      float* q = qp + t * d;
      if (rp != nullptr) {
        const T* rr = rp + t * rs;
        T* sr = sp + t * d;
        for (int64_t i = 0; i < d; ++i) {
          const float v = to_float(round_to<T>(to_float(xr[i]) + to_float(rr[i])));
          sr[i] = round_to<T>(v);
          q[i] = v * v;
        }
      } else {
        for (int64_t i = 0; i < d; ++i) {
          const float v = to_float(xr[i]);
          q[i] = v * v;
        }
      }
    }
  });
  const auto variance = squares.mean(-1);  // [rows] float32
  const float* vp = variance.data_ptr<float>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* src = rp != nullptr ? sp : xp;
  const int64_t ss = rp != nullptr ? d : xs;
  const float e = static_cast<float>(eps);
  kiln_x86::parallel_range(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float scale = 1.0f / std::sqrt(vp[t] + e);
      const T* xr = src + t * ss;
      T* o = op + t * d;
      for (int64_t i = 0; i < d; ++i) {
        const float h = to_float(round_to<T>(to_float(xr[i]) * scale));
        o[i] = round_to<T>(to_float(wp[i]) * h);
      }
    }
  });
  auto shape = x.sizes().vec();
  if (residual.has_value()) return {out.view(shape), sum.view(shape)};
  return {out.view(shape)};
}

// x (+ residual) -> (normed, x + residual), as the reference computes it, so the results are
// bit-identical: float32 is F.rms_norm's fused kernel (one ATen op after the add); bfloat16 is
// rms_norm_bf16 above (one ATen op). (A fully one-pass kernel summed the squares in another order
// than ATen's `mean`, which changes the last bit of some results; Kiln's tests hold the norm to
// bitwise equality with Hugging Face's.)
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps) {
  check_cpu_contiguous_last(x, "x");
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.numel() == d, "weight has ", weight.numel(), " elements, x's last dim is ", d);
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must have x's shape and dtype");
  }
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16) {
    return rms_norm_bf16(x, residual, weight, eps);
  }
  at::Tensor sum = residual.has_value() ? at::add(x, *residual) : x;
  at::Tensor out;
  if (sum.scalar_type() == at::kFloat) {
    out = at::rms_norm(sum, {d}, weight, eps);
  } else {
    auto xf = sum.to(at::kFloat);
    auto variance = xf.pow(2).mean(-1, /*keepdim=*/true);
    out = weight * (xf * at::rsqrt(variance + eps)).to(sum.scalar_type());
  }
  if (residual.has_value()) return {out, sum};
  return {out};
}

// [..., 2d] -> [..., d]: silu(gate) * up with ATen's own vectorized kernels, the reference's two
// ops and roundings exactly; what is saved is the Python and dispatch work around them. (A loop
// of scalar expf here measured slower than ATen's vectorized silu.)
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_cpu_contiguous_last(x, "x");
  TORCH_CHECK(x.size(-1) % 2 == 0, "x's last dim must be even, got ", x.size(-1));
  const int64_t d = x.size(-1) / 2;
  auto out = at::silu(x.narrow(-1, 0, d));
  out.mul_(x.narrow(-1, d, d));
  return out;
}

// Neox rotary embedding of every head of one tensor: (x1 c - x2 s, x2 c + x1 s), each product
// and each sum rounded to T as the reference's separate ops do.
template <typename T>
void rotary_kernel(const int64_t* pos, const T* cache, const T* x, T* out, int64_t tokens,
                   int64_t heads, int64_t head_dim, int64_t max_position) {
  const int64_t half = head_dim / 2;
  // On the calling thread: inside a parallel region (the work pool's or OpenMP's) this loop
  // measured 8x slower on one thread (2,000 tokens x 9 heads: 3.9 ms against 0.5 ms a call).
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t p = pos[t];
    TORCH_CHECK(p >= 0 && p < max_position, "position ", p, " is outside the rotary cache (",
                max_position, " positions)");
    const T* cos = cache + p * head_dim;
    const T* sin = cos + half;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + (t * heads + h) * head_dim;
      T* oh = out + (t * heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_float(xh[i]);
        const float x2 = to_float(xh[i + half]);
        const float c = to_float(cos[i]);
        const float s = to_float(sin[i]);
        const float a = to_float(round_to<T>(x1 * c));
        const float b = to_float(round_to<T>(x2 * s));
        const float e = to_float(round_to<T>(x2 * c));
        const float f = to_float(round_to<T>(x1 * s));
        oh[i] = round_to<T>(a - b);
        oh[i + half] = round_to<T>(e + f);
      }
    }
  }
}

std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                         const at::Tensor& key, const at::Tensor& cos_sin_cache,
                                         int64_t head_dim) {
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() &&
                  cos_sin_cache.scalar_type() == query.scalar_type(),
              "query, key and cos_sin_cache must share a dtype");
  TORCH_CHECK(head_dim % 2 == 0 && cos_sin_cache.size(-1) == head_dim,
              "cos_sin_cache must be [max_position, head_dim] with an even head_dim");
  auto pc = positions.contiguous();
  auto cc = cos_sin_cache.contiguous();
  const int64_t tokens = pc.numel();
  std::vector<at::Tensor> outs;
  for (const auto& x : {query, key}) {
    check_cpu_contiguous_last(x, "query/key");
    auto xc = x.contiguous();
    TORCH_CHECK(tokens == 0 || xc.numel() % (tokens * head_dim) == 0,
                "query/key must be [num_tokens, num_heads * head_dim]");
    const int64_t heads = tokens ? xc.numel() / tokens / head_dim : 0;
    auto out = at::empty_like(xc);
    dispatch_dtype(xc.scalar_type(), "kiln_x86_rotary", [&](auto tag) {
    using scalar_t = decltype(tag);
      rotary_kernel<scalar_t>(pc.data_ptr<int64_t>(), cc.data_ptr<scalar_t>(),
                              xc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), tokens, heads,
                              head_dim, cc.size(0));
    });
    outs.push_back(out.view({tokens, -1}));
  }
  return outs;
}

}  // namespace

TORCH_LIBRARY(kiln_x86, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> Tensor[]");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def(
      "rotary_embedding(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, "
      "int head_dim) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(kiln_x86, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "add + RMSNorm");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up");
  m.def("rotary_embedding", &rotary_embedding, "neox rotary embedding of query and key");
  kiln_x86::def_attach_pool(m);
}
