#pragma once
// core/nn: the library's modules, with hook points (HookableModule) that parallel styles fill.
#include <hyper_parallel/core/nn/embedding.h>
#include <hyper_parallel/core/nn/hookable_module.h>
#include <hyper_parallel/core/nn/linear.h>
#include <hyper_parallel/core/nn/main_grad.h>
#include <hyper_parallel/core/nn/matmul.h>
#include <hyper_parallel/core/nn/parameter_layout.h>
#include <hyper_parallel/core/nn/rms_norm.h>
