// What the nanobind entry points (module.cc, bench_module.cc) share: errors as Python
// exceptions, device reads, handle lookup, FFI handler capsules.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "handle.h"

namespace jmc {

inline void raise_if(const std::string& error) {
  if (!error.empty()) throw std::runtime_error(error);
}

inline void raise_if_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

inline std::vector<uint64_t> read_u64(const uint64_t* device, int n) {
  std::vector<uint64_t> out(n);
  raise_if_cuda(cudaMemcpy(out.data(), device, n * sizeof(uint64_t), cudaMemcpyDeviceToHost),
                "cudaMemcpy(timings)");
  return out;
}

inline void sync_device() { raise_if_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

inline std::shared_ptr<Handle> open_handle(int64_t id) {
  auto h = find_handle(id);
  if (h == nullptr) throw std::runtime_error("no all-to-all handle " + std::to_string(id));
  return h;
}

template <typename Fn>
nanobind::capsule handler_capsule(Fn* fn) {
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

// jax_moe_comm._native.bench (bench_module.cc): the instruments benchmarks and tests use.
void define_bench_module(nanobind::module_ bench);

}  // namespace jmc
