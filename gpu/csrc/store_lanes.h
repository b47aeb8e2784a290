// Sixteen float32 lanes stored as T, rounded as store_f32 (cpu_math.h) rounds: for the AVX-512
// matmul kernels' outputs. Lanes past `count` are not written.
#pragma once

#include "cpu_math.h"

#include <immintrin.h>

#include <cstdint>

namespace actorserve {

template <typename T>
inline void store16(T* out, __m512 y, int64_t count) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, y);
  for (int64_t j = 0; j < count; ++j) store_f32(out + j, lanes[j]);
}

template <>
inline void store16<float>(float* out, __m512 y, int64_t count) {
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << count) - 1), y);
}

// Round to nearest even as store_f32<BFloat16> does, NaN as 0x7FC0.
template <>
inline void store16<c10::BFloat16>(c10::BFloat16* out, __m512 y, int64_t count) {
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(out, static_cast<__mmask16>((1u << count) - 1), _mm512_cvtepi32_epi16(rounded));
}

}  // namespace actorserve
