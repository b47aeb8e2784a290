// at::parallel_for's interface without its first-call setup, its work taken in pieces, for the CPU kernels.
//
// at::parallel_for begins with an inline setup that runs once per thread in each shared library
// that calls it (its "done" flag is a thread_local of the library): it sets the calling thread's
// OpenMP thread count to torch's shared one. On the engine's forward thread, whose count differs
// from every other thread's (gpu/torch_threads.py), that would undo its count in the middle of a
// step. This asks libtorch's at::get_num_threads instead, whose setup is libtorch's own and leaves
// the thread's count as it is.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace actorserve {

// Pieces per thread that parallel_for cuts: enough that the others absorb a preempted thread's
// share, few enough that each piece's setup (a block's widening, a prefetch) stays small. Measured
// on the two kinds of machine this runs on (2-core EPYC VMs, paired runs): on the AVX2 one, four
// pieces served gguf + int8 K/V at 16 clients 1.12x faster than one (6646863); on the AVX-512 one,
// one piece was the faster: served int8 + int8 K/V 1.04x and gguf + int8 K/V 1.08x (4 pairs each),
// the int8 decode step at batch 64 1.05x, the int8 matmuls at 64 rows 1.09x, one user the same.
// A piece's first weight block comes cold (the prefetch of the next block stays within a piece).
#if defined(__AVX512F__)
constexpr int64_t kPiecesPerThread = 1;
#else
constexpr int64_t kPiecesPerThread = 4;
#endif

// f(first, last) over [0, n) in kPiecesPerThread pieces a thread of at least `grain` (or one per
// thread where n is shorter), which the threads take in order from a shared counter. The serving
// threads share these cores: with several pieces a thread, one the OS preempts holds up only the
// piece it is in, where an equal split per thread (one piece each) left the others waiting at the
// region's end for all of its share.
template <typename F>
void parallel_for(int64_t n, int64_t grain, const F& f) {
  if (n <= 0) {
    return;
  }
  grain = std::max<int64_t>(grain, 1);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  const int64_t pieces = std::max(threads, std::min(threads * kPiecesPerThread, n / grain));
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(threads))
  for (int64_t p = next.fetch_add(1, std::memory_order_relaxed); p < pieces; p = next.fetch_add(1, std::memory_order_relaxed)) {
    f(p * n / pieces, (p + 1) * n / pieces);
  }
}

}  // namespace actorserve
