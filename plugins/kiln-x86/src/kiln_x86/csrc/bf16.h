// kiln-x86: float32 <-> bfloat16 conversions shared by the kernels, written branch-free so that
// the loops calling them vectorize. The bfloat16 rounding is c10's: round to nearest even, NaN
// kept a quiet NaN, so a kernel's bfloat16 results equal what torch would round to.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace kiln_x86 {

inline float to_float(float v) { return v; }

inline float to_float(c10::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
inline T round_to(float v);

template <>
inline float round_to<float>(float v) {
  return v;
}

template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t rounded = (v != v) ? 0x7fc00000u : u + 0x7fffu + ((u >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(rounded >> 16), c10::BFloat16::from_bits());
}

}  // namespace kiln_x86
