#pragma once
// core/comm: process groups, point-to-point transfers, the schedule engine, collectives,
// counters.
#include <hyper_parallel/core/comm/chunks.h>
#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/comm/lifecycle.h>
#include <hyper_parallel/core/comm/link_probe.h>
#include <hyper_parallel/core/comm/op.h>
#include <hyper_parallel/core/comm/p2p.h>
#include <hyper_parallel/core/comm/pending_all_gather.h>
#include <hyper_parallel/core/comm/pending_all_reduce.h>
#include <hyper_parallel/core/comm/pending_reduce_scatter.h>
#include <hyper_parallel/core/comm/row_sparse_all_reduce.h>
#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/comm/schedule.h>
#include <hyper_parallel/core/comm/trace.h>
#include <hyper_parallel/core/comm/work.h>
