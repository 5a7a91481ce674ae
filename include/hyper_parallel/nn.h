#pragma once
// nn: the library's modules (parallel styles act on these).
#include <hyper_parallel/nn/embedding.h>
#include <hyper_parallel/nn/linear.h>
#include <hyper_parallel/nn/rms_norm.h>
