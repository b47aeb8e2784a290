// How the VNNI linear kernels (int8_matmul.cpp, gguf_matmul.cpp) share a layer's 64-row weight
// blocks between threads once a batch has several rows: by halves (32 outputs), so that a layer of
// 9 blocks splits 9 and 9 instead of 5 and 4, and each thread fetching the next block while it
// multiplies the current one.
#pragma once

#include "parallel.h"

#include <cstdint>

namespace actorserve {

// f(block, half, fetch_next) for every half of `blocks` weight blocks, over the threads; fetch_next
// on a block's first half when the same thread takes the next block too.
template <typename F>
void for_each_half_block(int64_t blocks, const F& f) {
  parallel_for(2 * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t unit = first; unit < last; ++unit) {
      const int64_t block = unit / 2;
      f(block, unit % 2, unit % 2 == 0 && 2 * (block + 1) < last);
    }
  });
}

// The share `pass` of `passes` of `bytes` at `next` (or nothing where next is null) fetched into
// the cache, spread over a block's passes so the loads do not come in one burst.
inline void prefetch_share(const void* next, int64_t bytes, int64_t pass, int64_t passes) {
  if (next == nullptr) return;
  const char* p = static_cast<const char*>(next);
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t i = pass * lines / passes; i < (pass + 1) * lines / passes; ++i) __builtin_prefetch(p + 64 * i, 0, 2);
}

}  // namespace actorserve
