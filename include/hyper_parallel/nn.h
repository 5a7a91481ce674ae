#pragma once
// nn: the library's modules, with hook points (HookableModule) that parallel styles fill.
// They live in core/nn (layer 3, between dtensor and tensor_parallel).
#include <hyper_parallel/core/nn.h>
