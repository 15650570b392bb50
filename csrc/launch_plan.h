// How a handle launches its kernels: every kernel's grid, whether the fused ops run as one
// block, dependent launches, and the acknowledgement store; from the layer shape, the tuning
// and the JMC_* settings read at creation (agreed across ranks first: api.py PROTOCOL_ENV).
#pragma once

#include <string>

#include "core/layout.h"
#include "kernels/kernels.h"

namespace jmc {

struct LaunchPlan {
  Launch launch[kNumKernels]{};         // the split ops' kernels
  Launch fused_launch[kNumFusedOps]{};  // dispatch, combine; 0 blocks: split kernels instead
  bool dependent_launch = false;        // programmatic dependent launches (core/launch.cuh)
  bool release_acks = false;            // JMC_ACKS=release: CommonParams::release_acks
};

// "" and *plan filled, or why a setting is refused (naming the values it accepts).
std::string plan_launch(const Shape& shape, Launch tuning, LaunchPlan* plan);

}  // namespace jmc
