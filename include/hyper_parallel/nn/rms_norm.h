#pragma once
// Deprecated: nn lives in core/nn; include <hyper_parallel/core/nn/rms_norm.h>.
#include <hyper_parallel/core/nn/rms_norm.h>
