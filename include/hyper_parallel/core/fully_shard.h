#pragma once
// core/fully_shard: sharded data parallelism (FSDP2 / HSDP) over a mesh's data-parallel dim.
#include <hyper_parallel/core/fully_shard/fully_shard.h>
#include <hyper_parallel/core/fully_shard/options.h>
#include <hyper_parallel/core/fully_shard/param_group.h>
