#pragma once
// core/tensor_parallel: parallel styles (plain and MC2), parallelize_module, loss parallel, helpers.
#include <hyper_parallel/core/tensor_parallel/grad_utils.h>
#include <hyper_parallel/core/tensor_parallel/loss_parallel.h>
#include <hyper_parallel/core/tensor_parallel/mc2.h>
#include <hyper_parallel/core/tensor_parallel/parallelize.h>
#include <hyper_parallel/core/tensor_parallel/parameter_sharding.h>
#include <hyper_parallel/core/tensor_parallel/plan.h>
#include <hyper_parallel/core/tensor_parallel/style.h>
