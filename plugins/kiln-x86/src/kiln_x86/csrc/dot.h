// kiln-x86: a float32 dot product of a float32 or bfloat16 row with a float32 vector, in
// kLanes partial sums (a loop the compiler vectorizes without reassociating a single sum), shared
// by the decode-sized kernels (x86_lora.cpp).
#pragma once

#include <cstdint>

#include "bf16.h"

namespace kiln_x86 {

constexpr int kLanes = 16;

// sum_i a[i] * x[i] in float32 with kLanes partial sums.
template <typename T>
float dot(const T* a, const float* x, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) part[j] += to_float(a[i + j]) * x[i + j];
  }
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += part[j];
  for (; i < n; ++i) sum += to_float(a[i]) * x[i];
  return sum;
}

}  // namespace kiln_x86
