// The AVX-512 intrinsics the kernels use (F, BW, BF16, VNNI), emulated by SIMDe (Debian:
// libsimde-dev), so that their 512-bit paths can be tested on a CPU without them. Only gpu/cpu_ops.py's emulated build
// includes it (ACTORSERVE_EMULATE_AVX512BF16=1); it is slow and not for serving.
#pragma once

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstdint>
#include <cstring>

// Missing from SIMDe 0.7: float32 to bfloat16, rounding to nearest even as vcvtneps2bf16 does.
static inline simde__m256bh actorserve_cvtneps_pbh(simde__m512 a) {
  float f[16];
  uint16_t bf[16];
  std::memcpy(f, &a, sizeof f);
  for (int i = 0; i < 16; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &f[i], sizeof bits);
    bf[i] = f[i] != f[i] ? 0x7FC0u : static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
  simde__m256bh out;
  std::memcpy(&out, bf, sizeof out);
  return out;
}
#define _mm512_cvtneps_pbh actorserve_cvtneps_pbh

// Missing from SIMDe 0.7 as well: int32 to float32 and int8 to int32 (the int8 K/V path's score
// and value conversions), lane by lane.
template <typename From, typename To, typename Out, typename In>
static inline Out actorserve_convert16(In a) {
  From x[16];
  To y[16];
  std::memcpy(x, &a, sizeof x);
  for (int k = 0; k < 16; ++k) y[k] = static_cast<To>(x[k]);
  Out out;
  std::memcpy(&out, y, sizeof out);
  return out;
}
#define _mm512_cvtepi32_ps(a) actorserve_convert16<int32_t, float, simde__m512>(a)
#define _mm512_cvtepi8_epi32(a) actorserve_convert16<int8_t, int32_t, simde__m512i>(a)
