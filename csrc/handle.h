// Persistent all-to-all handles: symmetric buffers, scratch, error record and protocol stage,
// owned outside XLA and looked up by the stable integer id baked into the HLO.
#pragma once

#include <cstdint>
#include <string>

#include "core/error_record.h"
#include "core/layout.h"
#include "kernels/kernels.h"

namespace jmc {

// Where a handle is in the dispatch -> combine cycle; checked by every handler, so a recv
// without its send, or two sends in flight, is an error instead of silent corruption.
enum class Stage { kIdle, kDispatchSent, kDispatchReceived, kCombineSent };

struct Handle {
  int64_t id = 0;
  Shape shape{};
  int rank = 0;
  Launch launch{};
  uint64_t timeout_ns = 0;
  void* symmetric = nullptr;  // one nvshmem_malloc
  size_t symmetric_bytes = 0;
  SymmetricLayout sym{};
  void* scratch_memory = nullptr;  // cudaMalloc, zero between calls
  LocalScratch scratch{};
  ErrorRecord* error_host = nullptr;    // pinned, mapped
  ErrorRecord* error_device = nullptr;  // device view of the same memory
  Stage stage = Stage::kIdle;
  uint64_t barrier_epoch = 0;
  // Benchmarks only: when on, each handler brackets its kernel with %globaltimer stamps into
  // timings[2 * phase] (start) and timings[2 * phase + 1] (end), phases 0..3 in cycle order.
  bool timing = false;
  uint64_t* timings = nullptr;  // device, kTimingSlots

  CommonParams common() const {
    return CommonParams{shape, sym, scratch, error_device, rank, timeout_ns};
  }
};

constexpr int kTimingSlots = 8;

// Dense all-to-all baseline: two symmetric buffers of world * chunk bytes.
struct DenseHandle {
  int64_t id = 0;
  size_t chunk_bytes = 0;
  int world_size = 0;
  void* src = nullptr;
  void* dst = nullptr;
  uint64_t* timings = nullptr;  // device, [start, end] of the last call
};

// All of these run on the host, outside any FFI execute (nvshmem_malloc is collective).
// They return an empty string on success, else what went wrong.
std::string create_handle(const Shape& shape, Launch launch, uint64_t timeout_ns,
                          int64_t* id_out);
std::string destroy_handle(int64_t id);
std::string create_dense_handle(int world_size, size_t chunk_bytes, int64_t* id_out);
std::string destroy_dense_handle(int64_t id);

Handle* find_handle(int64_t id);
DenseHandle* find_dense_handle(int64_t id);

// "" if the handle's kernels recorded no error, else a message naming the error kind first.
std::string describe_error(const ErrorRecord& rec);
// Checks a shape the same way the Python config does.
std::string validate_shape(const Shape& s);

}  // namespace jmc
