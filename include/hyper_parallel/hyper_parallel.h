#pragma once
// Everything public in hyper_parallel.
#include <hyper_parallel/checkpoint.h>
#include <hyper_parallel/core/autograd/gradient_layout.h>
#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/data_parallel.h>
#include <hyper_parallel/core/dtensor.h>
#include <hyper_parallel/core/fully_shard.h>
#include <hyper_parallel/core/tensor_parallel.h>
#include <hyper_parallel/core/nn.h>
