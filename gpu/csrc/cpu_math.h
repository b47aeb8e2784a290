// Scalar helpers for the CPU kernels, written so that loops over them vectorise: an exp (libm's
// expf is a call per element) and bfloat16 conversions by bit operations (c10's are not
// vectorised by the compiler).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

namespace actorserve {

// exp(x) for x <= 0 (scores less their maximum), vectorisable: 2^n * p(r) with r = x - n ln 2.
// Relative error ~2e-7; exp(-inf) = 0.
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.f);  // below, 2^n would leave float's normal range
  const float n = std::nearbyint(clamped * 1.44269504f);
  const float r = clamped - n * 0.693145752f - n * 1.42860677e-6f;  // ln 2 split in two for accuracy
  float p = 1.98756912e-4f;
  p = p * r + 1.39819994e-3f;
  p = p * r + 8.33345205e-3f;
  p = p * r + 4.16657962e-2f;
  p = p * r + 1.66666657e-1f;
  p = p * r + 0.5f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  float result;
  std::memcpy(&result, &bits, sizeof result);
  return x < -87.f ? 0.f : result;
}

// x * sigmoid(x), through exp(-|x|) so the exp never overflows.
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  const float sigmoid = (x >= 0.f ? 1.f : e) / (1.f + e);
  return x * sigmoid;
}

// Element loads and stores through float: bfloat16 widens by a shift and narrows by rounding to
// nearest even (NaN stays NaN), exactly as c10::BFloat16 does; other types convert as usual.
template <typename T>
inline float load_f32(const T* p) {
  return static_cast<float>(*p);
}

template <typename T>
inline void store_f32(T* p, float x) {
  *p = static_cast<T>(x);
}

template <>
inline float load_f32<c10::BFloat16>(const c10::BFloat16* p) {
  const uint32_t bits = static_cast<uint32_t>(p->x) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

template <>
inline void store_f32<c10::BFloat16>(c10::BFloat16* p, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  p->x = static_cast<uint16_t>(x != x ? 0x7FC0u : rounded);
}

// x rounded to T and back: where the torch code materialises an intermediate in T.
template <typename T>
inline float round_to(float x) {
  T t;
  store_f32(&t, x);
  return load_f32(&t);
}

}  // namespace actorserve
