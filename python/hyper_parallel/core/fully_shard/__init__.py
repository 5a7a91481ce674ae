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

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "HSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "fully_shard",
    "hsdp_sync_stream",
]
