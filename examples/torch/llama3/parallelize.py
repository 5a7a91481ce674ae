"""The tensor-parallel plan for the Python Llama 3 (torchtitan's TP + SP plan), the twin of
parallelize.cpp: the only place that knows how the model is sharded."""

from typing import Optional

from hyper_parallel import (
    ColwiseParallel,
    MC2ColwiseParallel,
    MC2RowwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.core.tensor_parallel.mc2 import MC2Contract


def hand_written_plain_plan():
    """The TP + SP plan, key by key (what parallelize_llama3 builds without MC2)."""
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    row_out = RowwiseParallel(output_layouts=Shard(1))
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": gather,
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": row_out,
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": gather,
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": row_out,
    }


def parallelize_llama3(model, tp_mesh, *, enable_sequence_parallel: bool = True, enable_mc2: bool = False,
                       mc2_contract: Optional[MC2Contract] = None):
    """Applies the plan on a 1-d TP mesh. With enable_mc2 (which needs sequence parallelism) the
    feed-forward keeps its Shard(1) input: w1, w3 are MC2ColwiseParallel, w2 MC2RowwiseParallel."""
    tp = tp_mesh.size(0)
    block = model.layers[0]
    if block.attention.wq.out_features % tp or block.attention.wk.out_features % tp:
        raise ValueError(f"parallelize_llama3: expected the attention heads divisible by the TP size ({tp})")
    if enable_mc2 and not enable_sequence_parallel:
        raise ValueError("parallelize_llama3: enable_mc2 requires sequence parallelism (MC2 fuses the sequence "
                         "all-gather / reduce-scatter into the matmuls)")
    residual = Shard(1) if enable_sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Replicate()),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=residual),
    }
    if enable_sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"norm": SequenceParallel(), "layers.*.attention_norm": SequenceParallel(),
                     "layers.*.ffn_norm": SequenceParallel(), "layers.*.attention": gather})
        if not enable_mc2:
            plan["layers.*.feed_forward"] = gather
    if enable_mc2:
        contract = mc2_contract or MC2Contract.strict()
        plan.update({"layers.*.feed_forward.w1": MC2ColwiseParallel(contract=contract),
                     "layers.*.feed_forward.w3": MC2ColwiseParallel(contract=contract),
                     "layers.*.feed_forward.w2": MC2RowwiseParallel(contract=contract)})
    else:
        plan.update({"layers.*.feed_forward.w1": ColwiseParallel(), "layers.*.feed_forward.w3": ColwiseParallel(),
                     "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=residual)})
    return parallelize_module(model, tp_mesh, plan)
