// Which part of a prefix sum holds item i: the kernels number the rows (records) of all
// experts (groups) through one shared-memory prefix, and each warp finds its item's part.
#pragma once

namespace jmc {

// The largest j in [0, n) with prefix[j] <= i, for a non-decreasing prefix with
// prefix[0] <= i (prefix[j]: the first item of part j); 0 when n <= 1. Binary search: log2(n)
// dependent shared-memory loads.
template <typename T, typename I>
__device__ __forceinline__ int part_of(const T* prefix, int n, I i) {
  int lo = 0;
  for (int hi = n; hi - lo > 1;) {
    const int mid = (lo + hi) / 2;
    (prefix[mid] <= i ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace jmc
