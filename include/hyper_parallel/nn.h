#pragma once
// nn: the library's modules, with hook points (HookableModule) that parallel styles fill.
#include <hyper_parallel/nn/embedding.h>
#include <hyper_parallel/nn/hookable_module.h>
#include <hyper_parallel/nn/linear.h>
#include <hyper_parallel/nn/rms_norm.h>
