// NVSHMEM bootstrap through a unique id that Python passes over JAX's key-value store.
#pragma once

#include <string>

namespace jmc {

struct Version {
  int major, minor, patch;
};

Version built_nvshmem_version();    // the headers this module was compiled against
Version runtime_nvshmem_version();  // the libnvshmem_host.so.3 that was loaded
int cuda_device_count();            // 0 when no driver or no device
std::string cuda_driver_error();    // why cuda_device_count() is 0, or ""

// 128 opaque bytes; made on rank 0 and handed to every rank.
std::string make_unique_id();
// Selects `device`, then nvshmemx_init_attr(WITH_UNIQUEID) from this module (which also
// sets up this module's device-side NVSHMEM state). Returns "" or what went wrong.
std::string init(const std::string& unique_id, int rank, int nranks, int device);
std::string finalize();
bool initialized();
int my_pe();
int n_pes();
int init_status();  // nvshmemx_init_status(): 2 initialized, 3 limited MPG, 4 full MPG

}  // namespace jmc
