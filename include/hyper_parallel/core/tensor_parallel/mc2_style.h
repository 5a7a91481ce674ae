#pragma once
// Deprecated: include <hyper_parallel/core/tensor_parallel/mc2/style.h> (or the umbrella mc2.h).
#include <hyper_parallel/core/tensor_parallel/mc2/style.h>
