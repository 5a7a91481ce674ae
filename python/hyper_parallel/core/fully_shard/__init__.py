"""fully_shard: sharded data parallelism (PyTorch FSDP2's and HyperParallel's HSDP semantics) for
torch.nn modules, composed with tensor parallelism; the C++ core gathers, reduces and shards."""

from hyper_parallel.core.fully_shard.api import (
    CPUOffloadPolicy,
    FSDPModule,
    HSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    hsdp_sync_stream,
)
from hyper_parallel.core.fully_shard.model_state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "HSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "StateDictOptions",
    "fully_shard",
    "get_model_state_dict",
    "hsdp_sync_stream",
    "set_model_state_dict",
]
