// C ABI over at::accelerator's caching-allocator statistics. tch exposes none of this.
// Every entry point catches all C++ exceptions: an exception crossing into Rust is UB.
#include <ATen/DeviceAccelerator.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <exception>
#include <string>

extern "C" {

// Mirrors `AllocStatsRaw` in trainer/src/alloc_stats.rs; keep the two in step.
struct hr_alloc_stats {
  int64_t allocated_current, allocated_peak;
  int64_t reserved_current, reserved_peak;
  int64_t active_current, active_peak;
  int64_t inactive_split_current, inactive_split_peak;
  int64_t requested_current, requested_peak;
  int64_t num_alloc_retries;
  int64_t num_ooms;
  int64_t segment_count;
};

static void copy_err(const char* what, char* err, size_t err_len) {
  if (err == nullptr || err_len == 0) return;
  std::strncpy(err, what, err_len - 1);
  err[err_len - 1] = '\0';
}

// 1 when an accelerator (CUDA, ...) is present and initialised, 0 otherwise.
int hr_has_accelerator() {
  try {
    auto t = at::accelerator::getAccelerator(false);
    return t.has_value() && at::accelerator::deviceCount() > 0 ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

// 0 on success; -1 with a message in err otherwise.
int hr_device_stats(int device, hr_alloc_stats* out, char* err, size_t err_len) {
  try {
    const auto s = at::accelerator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out->allocated_current = s.allocated_bytes[agg].current;
    out->allocated_peak = s.allocated_bytes[agg].peak;
    out->reserved_current = s.reserved_bytes[agg].current;
    out->reserved_peak = s.reserved_bytes[agg].peak;
    out->active_current = s.active_bytes[agg].current;
    out->active_peak = s.active_bytes[agg].peak;
    out->inactive_split_current = s.inactive_split_bytes[agg].current;
    out->inactive_split_peak = s.inactive_split_bytes[agg].peak;
    out->requested_current = s.requested_bytes[agg].current;
    out->requested_peak = s.requested_bytes[agg].peak;
    out->num_alloc_retries = s.num_alloc_retries;
    out->num_ooms = s.num_ooms;
    out->segment_count = s.segment[agg].current;
    return 0;
  } catch (const std::exception& e) {
    copy_err(e.what(), err, err_len);
  } catch (...) {
    copy_err("unknown C++ exception", err, err_len);
  }
  return -1;
}

int hr_reset_peak_stats(int device, char* err, size_t err_len) {
  try {
    at::accelerator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
    return 0;
  } catch (const std::exception& e) {
    copy_err(e.what(), err, err_len);
  } catch (...) {
    copy_err("unknown C++ exception", err, err_len);
  }
  return -1;
}

int hr_empty_cache(char* err, size_t err_len) {
  try {
    at::accelerator::emptyCache();
    return 0;
  } catch (const std::exception& e) {
    copy_err(e.what(), err, err_len);
  } catch (...) {
    copy_err("unknown C++ exception", err, err_len);
  }
  return -1;
}

// Free and total device memory as the driver sees it.
int hr_memory_info(int device, int64_t* free_bytes, int64_t* total_bytes, char* err,
                   size_t err_len) {
  try {
    auto info = at::accelerator::getMemoryInfo(static_cast<c10::DeviceIndex>(device));
    *free_bytes = static_cast<int64_t>(info.first);
    *total_bytes = static_cast<int64_t>(info.second);
    return 0;
  } catch (const std::exception& e) {
    copy_err(e.what(), err, err_len);
  } catch (...) {
    copy_err("unknown C++ exception", err, err_len);
  }
  return -1;
}

// The pickled allocator snapshot (segments, blocks, traces), as memory_viz reads it.
// Resolved with dlsym: the symbol lives in libtorch_cuda, which CPU builds lack.
int hr_memory_snapshot(char** out, size_t* len, char* err, size_t err_len) {
  using snapshot_fn = std::string (*)();
  try {
    void* sym = dlsym(RTLD_DEFAULT, "_ZN5torch4cuda24_memory_snapshot_pickledB5cxx11Ev");
    if (sym == nullptr) {
      copy_err("torch::cuda::_memory_snapshot_pickled not found (libtorch without CUDA)", err,
               err_len);
      return -1;
    }
    std::string bytes = reinterpret_cast<snapshot_fn>(sym)();
    char* buf = static_cast<char*>(std::malloc(bytes.size() > 0 ? bytes.size() : 1));
    if (buf == nullptr) {
      copy_err("out of host memory copying the allocator snapshot", err, err_len);
      return -1;
    }
    std::memcpy(buf, bytes.data(), bytes.size());
    *out = buf;
    *len = bytes.size();
    return 0;
  } catch (const std::exception& e) {
    copy_err(e.what(), err, err_len);
  } catch (...) {
    copy_err("unknown C++ exception", err, err_len);
  }
  return -1;
}

void hr_free(char* p) { std::free(p); }

}  // extern "C"
