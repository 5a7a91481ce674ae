#pragma once
// Deprecated: include <hyper_parallel/core/tensor_parallel/mc2.h>, or the rooms it lists. This
// header held the contract, the sequence layout and MC2Linear; it forwards to all three.
#include <hyper_parallel/core/tensor_parallel/mc2/contract.h>
#include <hyper_parallel/core/tensor_parallel/mc2/linear.h>
#include <hyper_parallel/core/tensor_parallel/mc2/sequence_layout.h>
