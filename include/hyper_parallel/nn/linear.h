#pragma once
// Deprecated: nn lives in core/nn; include <hyper_parallel/core/nn/linear.h>.
#include <hyper_parallel/core/nn/linear.h>
