#pragma once

// LibTorch's CPU allocator with a count of live bytes, their peak, and allocation calls: installed
// with c10::SetCPUAllocator over the allocator it wraps, it measures what a piece of code
// allocates in tensors (lm_memory, and the distributed tests' bound on full checkpoints).

#include <c10/core/Allocator.h>

#include <atomic>
#include <cstdint>
#include <utility>

namespace lm {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* ctx = new Context{std::move(inner), static_cast<int64_t>(n), this};
    const int64_t now = live_ += static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    ++calls_;
    if (n > 16) ++large_calls_;
    allocated_ += static_cast<int64_t>(n);
    return {data, ctx, &release, device};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  int64_t calls() const { return calls_; }
  int64_t allocated() const { return allocated_; }
  int64_t large_calls() const { return large_calls_; }  // of more than 16 bytes
  /// Starts a new peak from what is live now, and returns that.
  int64_t reset_peak() {
    peak_ = live_.load();
    return peak_;
  }

 private:
  struct Context {
    c10::DataPtr inner;
    int64_t bytes;
    CountingAllocator* owner;
  };
  static void release(void* p) {
    auto* ctx = static_cast<Context*>(p);
    ctx->owner->live_ -= ctx->bytes;
    delete ctx;  // frees through the base allocator's deleter
  }

  c10::Allocator* base_;
  std::atomic<int64_t> live_{0}, peak_{0}, calls_{0}, allocated_{0}, large_calls_{0};
};

}  // namespace lm
