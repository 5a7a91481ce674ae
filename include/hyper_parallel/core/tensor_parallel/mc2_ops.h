#pragma once
// Deprecated: include <hyper_parallel/core/tensor_parallel/mc2/ops.h> (or the umbrella mc2.h).
#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>
