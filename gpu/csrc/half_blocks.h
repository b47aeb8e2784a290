// How the linear kernels (int8_matmul.cpp, gguf_matmul.cpp) walk a layer's 64-row weight
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

// What one pass of rows over a weight block fetches of the next block: share `pass` of `passes`,
// spread over the pass's own steps: `per_step(steps)` lines at each of its `steps` groups of inputs
// (`step(i, per)`). In one burst a pass over few rows asked for hundreds of lines at once, more
// than a core keeps in flight: spread, a batch-1 gguf decode step ran 1.16x as fast (BENCHMARKS.md).
struct NextBlock {
  const char* next = nullptr;  // nothing to fetch where null
  int64_t first = 0, last = 0;  // the share's lines

  NextBlock(const void* block, int64_t bytes, int64_t pass, int64_t passes) : next(static_cast<const char*>(block)) {
    const int64_t lines = (bytes + 63) / 64;
    first = pass * lines / passes, last = (pass + 1) * lines / passes;
  }

  int64_t per_step(int64_t steps) const { return (last - first + steps - 1) / steps; }

  void step(int64_t i, int64_t per) const {
    if (next == nullptr) return;
    for (int64_t line = first + i * per, end = std::min(last, line + per); line < end; ++line) __builtin_prefetch(next + 64 * line, 0, 2);
  }
};

// pass.template operator()<R>(row, fetch) for one pass of the R = n rows from `row` (1 <= n <=
// MaxRows): the pass's row count is a template argument, so its accumulators stay in registers.
template <int MaxRows, typename Pass>
inline void pass_of(int64_t n, int64_t row, const NextBlock& fetch, const Pass& pass) {
  if constexpr (MaxRows == 1) {
    pass.template operator()<1>(row, fetch);
  } else if (n == MaxRows) {
    pass.template operator()<MaxRows>(row, fetch);
  } else {
    pass_of<MaxRows - 1>(n, row, fetch, pass);
  }
}

// `rows` activation rows against one weight block in passes of MaxRows (the last takes what is
// left), each fetching its share of `next_bytes` at `next` (or nothing where next is null).
template <int MaxRows, typename Pass>
inline void row_passes(int64_t rows, const void* next, int64_t next_bytes, const Pass& pass) {
  const int64_t passes = (rows + MaxRows - 1) / MaxRows;
  for (int64_t row = 0, i = 0; row < rows; row += MaxRows, ++i) {
    pass_of<MaxRows>(std::min<int64_t>(MaxRows, rows - row), row, NextBlock(next, next_bytes, i, passes), pass);
  }
}

}  // namespace actorserve
