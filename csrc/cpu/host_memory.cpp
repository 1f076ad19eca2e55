// Large CPU tensors' memory kept for reuse, apart from malloc's heap (accel/runtime/host_memory.py says why).
//
// HostCachingAllocator takes torch's CPU allocations of at least `min_bytes`; smaller ones go to the allocator it
// replaced (torch's default: malloc). A large block is an anonymous mapping of whole pages. When its tensor is
// freed, the block is kept, and a later allocation takes the smallest kept block that holds it with at most an
// eighth to spare: a training step of static shapes finds every large tensor's memory already mapped and faulted
// in, from its second step on. On a miss the least recently kept blocks are unmapped first, as many as it takes to
// keep what this allocator maps within a quarter above the peak of its live blocks (or the new block, where the
// live ones grow): shapes that change from step to step cost page faults, not memory without bound. glibc's heap,
// asked to keep large blocks instead (M_MMAP_MAX 0), let small blocks settle inside freed large ones, so that
// the next large block no longer fit: a packed Llama's CPU steps over rows of differing samples grew its memory
// by 250-750 MB a step, without end.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace accel {
namespace {

constexpr size_t kPage = 4096;

class HostCachingAllocator final : public c10::Allocator {
 public:
  HostCachingAllocator(c10::Allocator* fallback, size_t min_bytes)
      : fallback_(fallback), fallback_deleter_(fallback->raw_deleter()), min_bytes_(min_bytes) {}

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < min_bytes_) return fallback_->allocate(nbytes);
    void* ptr = take(nbytes);
    c10::profiledCPUMemoryReporter().New(ptr, nbytes);
    return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
  }

  // raw_allocate()'s blocks, small ones included, are freed through this: it tells them apart.
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Unmaps every kept block; returns their bytes.
  int64_t release_kept() {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t bytes = kept_bytes_;
    while (!lru_.empty()) unmap_oldest_kept();
    return static_cast<int64_t>(bytes);
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {static_cast<int64_t>(mapped_bytes_), static_cast<int64_t>(kept_bytes_), hits_, misses_,
            static_cast<int64_t>(peak_live_)};
  }

  size_t min_bytes() const { return min_bytes_; }

  // Held across fork() (pthread_atfork), as glibc holds malloc's locks: the child inherits the blocks in a
  // consistent state, never in the middle of another thread's take or give_back.
  void lock_for_fork() { mu_.lock(); }
  void unlock_after_fork() { mu_.unlock(); }

  static HostCachingAllocator* instance;

 private:
  struct Block {
    size_t size;                     // mapped bytes
    std::list<void*>::iterator lru;  // its place in lru_ while kept
  };

  static void release(void* ptr) { instance->give_back(ptr); }

  void* take(size_t nbytes) {
    const size_t want = (nbytes + kPage - 1) / kPage * kPage;
    std::lock_guard<std::mutex> lock(mu_);
    const auto fit = by_size_.lower_bound(want);
    if (fit != by_size_.end() && fit->first - want <= want / 8) {
      void* ptr = fit->second;
      by_size_.erase(fit);
      Block& block = blocks_.at(ptr);
      lru_.erase(block.lru);
      kept_bytes_ -= block.size;
      peak_live_ = std::max(peak_live_, mapped_bytes_ - kept_bytes_);
      ++hits_;
      return ptr;
    }
    ++misses_;
    // Kept blocks may hold up to a quarter of the live peak beyond it: a step of static shapes whose other
    // allocations come and go in sizes that change (per-sample attention) keeps its large blocks.
    const size_t limit = peak_live_ + peak_live_ / 4;
    while (!lru_.empty() && mapped_bytes_ + want > limit) unmap_oldest_kept();
    void* ptr = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      while (!lru_.empty()) unmap_oldest_kept();
      ptr = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    if (ptr == MAP_FAILED) {
      c10::profiledCPUMemoryReporter().OutOfMemory(nbytes);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "accel's host allocator: out of memory mapping ", nbytes,
                       " bytes (", mapped_bytes_, " bytes mapped already)");
    }
    blocks_.emplace(ptr, Block{want, {}});
    mapped_bytes_ += want;
    peak_live_ = std::max(peak_live_, mapped_bytes_ - kept_bytes_);
    return ptr;
  }

  void give_back(void* ptr) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = blocks_.find(ptr);
      if (it != blocks_.end()) {
        c10::profiledCPUMemoryReporter().Delete(ptr);
        Block& block = it->second;
        block.lru = lru_.insert(lru_.end(), ptr);
        by_size_.emplace(block.size, ptr);
        kept_bytes_ += block.size;
        return;
      }
    }
    fallback_deleter_(ptr);  // a small block of the allocator this one replaced
  }

  // Unmaps the least recently kept block; returns its bytes. Caller holds mu_ and lru_ is not empty.
  size_t unmap_oldest_kept() {
    void* ptr = lru_.front();
    lru_.pop_front();
    const size_t size = blocks_.at(ptr).size;
    for (auto [it, end] = by_size_.equal_range(size); it != end; ++it) {
      if (it->second == ptr) {
        by_size_.erase(it);
        break;
      }
    }
    blocks_.erase(ptr);
    munmap(ptr, size);
    kept_bytes_ -= size;
    mapped_bytes_ -= size;
    return size;
  }

  c10::Allocator* fallback_;
  c10::DeleterFnPtr fallback_deleter_;
  const size_t min_bytes_;
  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;  // every mapped block, live or kept
  std::multimap<size_t, void*> by_size_;     // kept blocks by size
  std::list<void*> lru_;                     // kept blocks, least recently kept first
  size_t mapped_bytes_ = 0, kept_bytes_ = 0, peak_live_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

HostCachingAllocator* HostCachingAllocator::instance = nullptr;

// Makes HostCachingAllocator torch's CPU allocator for blocks of `min_bytes` or more, once a process (a later
// call keeps the first one's threshold). Returns whether torch's CPU allocations now go through it: false where
// an allocator registered at a higher priority than torch's default holds the place, or where the allocator in
// place has no raw deleter. Never freed: tensors outlive any caller.
bool host_memory_install(int64_t min_bytes) {
  TORCH_CHECK(min_bytes >= static_cast<int64_t>(kPage), "host_memory_install: min_bytes must be at least ", kPage,
              ", got ", min_bytes);
  static std::mutex install_mu;
  std::lock_guard<std::mutex> lock(install_mu);
  if (HostCachingAllocator::instance == nullptr) {
    // blocks of raw_allocate() that are not ours go back through the replaced allocator's raw deleter
    if (c10::GetCPUAllocator()->raw_deleter() == nullptr) return false;
    HostCachingAllocator::instance = new HostCachingAllocator(c10::GetCPUAllocator(), static_cast<size_t>(min_bytes));
    pthread_atfork([] { HostCachingAllocator::instance->lock_for_fork(); },
                   [] { HostCachingAllocator::instance->unlock_after_fork(); },
                   [] { HostCachingAllocator::instance->unlock_after_fork(); });
    c10::SetCPUAllocator(HostCachingAllocator::instance, /*priority=*/1);
  }
  return c10::GetCPUAllocator() == HostCachingAllocator::instance;
}

// [mapped bytes, kept bytes, hits, misses, peak live bytes, min_bytes] of the installed allocator; all 0 before one is.
std::vector<int64_t> host_memory_stats() {
  auto* a = HostCachingAllocator::instance;
  if (a == nullptr) return {0, 0, 0, 0, 0, 0};
  std::vector<int64_t> s = a->stats();
  s.push_back(static_cast<int64_t>(a->min_bytes()));
  return s;
}

int64_t host_memory_release() {
  return HostCachingAllocator::instance == nullptr ? 0 : HostCachingAllocator::instance->release_kept();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(accel, m) {
  m.def("host_memory_install(int min_bytes) -> bool", &host_memory_install);
  m.def("host_memory_stats() -> int[]", &host_memory_stats);
  m.def("host_memory_release() -> int", &host_memory_release);
}

}  // namespace accel
