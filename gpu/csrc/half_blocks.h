// How the VNNI linear kernels (int8_matmul.cpp, gguf_matmul.cpp) walk a layer's 64-row weight
// blocks: once a batch has several rows, by halves (32 outputs) shared between threads, so that a
// layer of 9 blocks splits 9 and 9 instead of 5 and 4; within a block, a few activation rows a pass,
// each thread fetching its next block meanwhile.
#pragma once

#include "parallel.h"

#include <algorithm>
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

// pass.template operator()<R>(row) for one pass of the R = n rows from `row` (1 <= n <= MaxRows):
// the pass's row count is a template argument, so its accumulators stay in registers.
template <int MaxRows, typename Pass>
inline void pass_of(int64_t n, int64_t row, const Pass& pass) {
  if constexpr (MaxRows == 1) {
    pass.template operator()<1>(row);
  } else if (n == MaxRows) {
    pass.template operator()<MaxRows>(row);
  } else {
    pass_of<MaxRows - 1>(n, row, pass);
  }
}

// `rows` activation rows against one weight block in passes of MaxRows (the last takes what is
// left), fetching a share of `next_bytes` at `next` (or nothing where next is null) before each.
template <int MaxRows, typename Pass>
inline void row_passes(int64_t rows, const void* next, int64_t next_bytes, const Pass& pass) {
  const int64_t passes = (rows + MaxRows - 1) / MaxRows;
  for (int64_t row = 0, i = 0; row < rows; row += MaxRows, ++i) {
    prefetch_share(next, next_bytes, i, passes);
    pass_of<MaxRows>(std::min<int64_t>(MaxRows, rows - row), row, pass);
  }
}

}  // namespace actorserve
