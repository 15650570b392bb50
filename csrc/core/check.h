// Error plumbing: CUDA status -> xla::ffi::Error with file, line and the failing expression.
// Handlers never throw and never exit(); they return these errors to XLA.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jmc {

inline xla::ffi::Error CudaError(cudaError_t err, const char* expr, const char* file, int line) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kInternal,
                         std::string(file) + ":" + std::to_string(line) + ": " + expr +
                             " failed: " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
}

}  // namespace jmc

// Evaluate a cudaError_t expression; on failure return an ffi::Error from the handler.
#define JMC_RETURN_IF_CUDA_ERROR(expr)                                   \
  do {                                                                   \
    cudaError_t jmc_err_ = (expr);                                       \
    if (jmc_err_ != cudaSuccess) {                                       \
      return ::jmc::CudaError(jmc_err_, #expr, __FILE__, __LINE__);      \
    }                                                                    \
  } while (0)

// Propagate an ffi::Error returned by a helper.
#define JMC_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::xla::ffi::Error jmc_status_ = (expr);    \
    if (jmc_status_.failure()) {               \
      return jmc_status_;                      \
    }                                          \
  } while (0)
