#pragma once
// Data parallelism: gradients averaged over a mesh dimension during the backward.
#include <hyper_parallel/core/data_parallel/data_parallel.h>
#include <hyper_parallel/core/data_parallel/gradient_reducer.h>
#include <hyper_parallel/core/data_parallel/replica_sync.h>
