// CUDA events recorded on XLA's stream by a custom call: the clock of the loop benchmark
// (benchmarks/bench_loop.py), the same clock pplx-kernels' loop is timed by.
#pragma once

#include <string>

namespace jmc {

constexpr int kNumEvents = 16;  // slots a jitted step may record into (a start and an end each)

// Milliseconds between the last records of slots `from` and `to` (waits for `to`); sets
// *error and returns 0 if either slot was never recorded or CUDA fails.
float event_elapsed_ms(int from, int to, std::string* error);

}  // namespace jmc
