#pragma once
// checkpoint: sharded, resharding, atomic checkpoints of a model and its optimizer.
#include <hyper_parallel/checkpoint/checkpoint.h>
