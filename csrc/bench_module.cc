// jax_moe_comm._native.bench: the instruments of benchmarks and tests, apart from the product's
// entry points (module.cc). The kernels' %globaltimer stamps, the staged-message counter, CUDA
// events on XLA's stream, the floor kernels and a dense NVSHMEM all-to-all baseline. Their FFI
// targets are in this submodule's ffi_targets, registered by jax_moe_comm._bench only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <mutex>
#include <vector>

#include <cuda_runtime.h>

#include "ffi/event.h"
#include "ffi/handlers.h"
#include "handle.h"
#include "module_util.h"

namespace nb = nanobind;

namespace jmc {

void define_bench_module(nb::module_ m) {
  // Timing on: the stamps start over (device counters: waits for queued work first). Takes
  // effect for calls whose handler runs after it (a call replayed from a CUDA graph keeps
  // what it was recorded with: turn timing on before a compiled function first runs).
  m.def("set_timing", [](int64_t id, bool on) {
    auto h = open_handle(id);
    std::lock_guard<std::mutex> lock(h->mutex);
    if (on) raise_if(ensure_timing_rows(h.get()));
    h->timing = on;
    if (!on) return;
    sync_device();
    raise_if_cuda(cudaMemset(&h->scratch.state->timing_opened, 0, sizeof(uint32_t)),
                  "cudaMemset(timing)");
  });
  // The stamps of the samples since set_timing(true), oldest first, kTimingSlots each (ns of
  // %globaltimer): the ring's rows, then the current row (the last sample, not yet filed).
  // Waits for the device first: samples may still be queued.
  m.def("read_timings", [](int64_t id) {
    auto h = open_handle(id);
    sync_device();
    std::lock_guard<std::mutex> lock(h->mutex);
    uint32_t opened = 0;
    raise_if_cuda(cudaMemcpy(&opened, &h->scratch.state->timing_opened, sizeof(opened),
                             cudaMemcpyDeviceToHost),
                  "cudaMemcpy(timing)");
    if (opened > kTimingSamples)
      throw std::runtime_error(std::to_string(opened) + " samples since set_timing(true), but "
                               "the handle keeps the stamps of " +
                               std::to_string(kTimingSamples));
    std::vector<std::vector<uint64_t>> samples;
    if (opened == 0) return samples;
    const std::vector<uint64_t> ring =
        read_u64(h->timings, static_cast<int>((opened - 1) * kTimingSlots));
    for (size_t i = 0; i < ring.size(); i += kTimingSlots)
      samples.emplace_back(ring.begin() + i, ring.begin() + i + kTimingSlots);
    samples.push_back(read_u64(h->current_timings(), kTimingSlots));
    return samples;
  });
  // Counting on: each staged message (a put or flag put to a peer outside load/store reach)
  // adds one to its kernel's count in DeviceState (one global atomic per message). As timing,
  // read when a handler runs: a call replayed from a CUDA graph keeps its recording's setting.
  m.def("set_message_counting", [](int64_t id, bool on) {
    auto h = open_handle(id);
    std::lock_guard<std::mutex> lock(h->mutex);
    h->count_staged = on;
  });
  // Messages each kernel sent to staged peers while counting was on, since creation or
  // recover() (DeviceState); waits for the device.
  m.def("staged_messages", [](int64_t id) {
    auto h = open_handle(id);
    sync_device();
    DeviceState state{};
    raise_if_cuda(cudaMemcpy(&state, h->scratch.state, sizeof(state), cudaMemcpyDeviceToHost),
                  "cudaMemcpy(state)");
    return std::vector<uint64_t>(state.staged_messages, state.staged_messages + kNumKernels);
  });
  // Microseconds between the last records of two event slots (jmc_record_event); waits.
  m.def("event_elapsed_us", [](int from, int to) {
    std::string error;
    const float ms = event_elapsed_ms(from, to, &error);
    raise_if(error);
    return 1e3 * static_cast<double>(ms);
  });
  m.def("create_dense_handle", [](int world, size_t chunk_bytes) {
    int64_t id = 0;
    raise_if(create_dense_handle(world, chunk_bytes, &id));
    return id;
  });
  m.def("read_dense_timings", [](int64_t id) {
    auto h = find_dense_handle(id);
    if (h == nullptr) throw std::runtime_error("no dense handle " + std::to_string(id));
    return read_u64(h->timings, 2);
  });
  m.def("destroy_dense_handle", [](int64_t id) { raise_if(destroy_dense_handle(id)); });

  nb::dict targets;
  targets["jmc_floor_kernels"] = handler_capsule(kFloorKernels);
  targets["jmc_dense_all_to_all"] = handler_capsule(kDenseAllToAll);
  targets["jmc_record_event"] = handler_capsule(kRecordEvent);
  m.attr("ffi_targets") = targets;
}

}  // namespace jmc
