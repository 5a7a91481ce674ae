#pragma once
// core/dtensor: DeviceMesh, placements, DTensor.
#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/dtensor/placement.h>
