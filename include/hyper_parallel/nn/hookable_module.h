#pragma once
// Deprecated: nn lives in core/nn; include <hyper_parallel/core/nn/hookable_module.h>.
#include <hyper_parallel/core/nn/hookable_module.h>
