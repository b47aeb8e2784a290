// Scratch memory a thread keeps across kernel calls, 64-byte aligned as torch's allocations are:
// made anew per call (three at::empty a gguf_matmul call) it cost a one-token decode step 2-7%,
// and at std::vector's 16-byte alignment half of the AVX2 kernel's 32-byte loads crossed a cache
// line (BENCHMARKS.md).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>

namespace actorserve {

template <typename T>
class ThreadBuffer {
 public:
  // At least `count` elements, their contents left from earlier calls.
  T* get(int64_t count) {
    if (count > capacity_) {
      constexpr size_t kAlign = 64;
      const size_t bytes = (static_cast<size_t>(count) * sizeof(T) + kAlign - 1) / kAlign * kAlign;
      void* memory = std::aligned_alloc(kAlign, bytes);
      if (memory == nullptr) throw std::bad_alloc();
      data_.reset(static_cast<T*>(memory));
      capacity_ = count;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  int64_t capacity_ = 0;
};

}  // namespace actorserve
