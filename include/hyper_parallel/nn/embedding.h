#pragma once
// Deprecated: nn lives in core/nn; include <hyper_parallel/core/nn/embedding.h>.
#include <hyper_parallel/core/nn/embedding.h>
