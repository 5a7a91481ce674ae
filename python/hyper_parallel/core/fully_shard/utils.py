"""The original's other import path of fully_shard's policies (``hyper_parallel.core.fully_shard.utils``)."""

from hyper_parallel.core.fully_shard.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]
