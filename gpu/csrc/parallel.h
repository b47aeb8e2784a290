// at::parallel_for without its first-call setup, for the CPU kernels.
//
// at::parallel_for begins with an inline setup that runs once per thread in each shared library
// that calls it (its "done" flag is a thread_local of the library): it sets the calling thread's
// OpenMP thread count to torch's shared one. On the engine's forward thread, whose count differs
// from every other thread's (gpu/torch_threads.py), that would undo its count in the middle of a
// step. This splits the same way and asks libtorch's at::get_num_threads, whose setup is
// libtorch's own and leaves the thread's count as it is.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace actorserve {

// f(first, last) over [0, n) in at most one chunk per thread, each at least `grain` long.
template <typename F>
void parallel_for(int64_t n, int64_t grain, const F& f) {
  if (n <= 0) {
    return;
  }
  const int64_t chunks = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (chunks <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(chunks))
  {
    const int64_t threads = omp_get_num_threads(), per = (n + threads - 1) / threads;
    const int64_t first = omp_get_thread_num() * per, last = std::min(n, first + per);
    if (first < last) {
      f(first, last);
    }
  }
}

}  // namespace actorserve
