"""The tensor-parallel plan for the Python Llama 3 (torchtitan's TP + SP plan), the twin of
parallelize.cpp: the only place that knows how the model is sharded. The style factories are
chosen once; the plan is one table over them."""

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


def _check(args, tp: int, seq_len: int, sp: bool, enable_mc2: bool, mc2_scope: str) -> None:
    """The plan's validation, once, up front, naming the numbers."""
    if args.n_heads % tp:
        raise ValueError(f"parallelize_llama3: expected n_heads ({args.n_heads}) divisible by the TP size ({tp})")
    if args.n_kv_heads % tp:
        raise ValueError(f"parallelize_llama3: expected n_kv_heads ({args.n_kv_heads}) divisible by the TP size ({tp})")
    if sp and seq_len % tp:
        raise ValueError(f"parallelize_llama3: expected seq_len ({seq_len}) divisible by the TP size ({tp}) with "
                         "sequence parallelism")
    if mc2_scope not in ("ffn", "all"):
        raise ValueError(f"parallelize_llama3: expected mc2_scope 'ffn' or 'all', got {mc2_scope!r}")
    if enable_mc2 and not sp:
        raise ValueError("parallelize_llama3: enable_mc2 requires sequence parallelism (MC2 fuses the sequence "
                         "all-gather / reduce-scatter into the matmuls)")
    if mc2_scope != "ffn" and not enable_mc2:
        raise ValueError(f"parallelize_llama3: mc2_scope '{mc2_scope}' needs enable_mc2")


def parallelize_llama3(model, tp_mesh, *, enable_sequence_parallel: bool = True, enable_loss_parallel: bool = False,
                       enable_mc2: bool = False, mc2_scope: str = "ffn", mc2_contract: Optional[MC2Contract] = None,
                       seq_len: Optional[int] = None):
    """Applies the plan on a 1-d TP mesh. With enable_mc2 (which needs sequence parallelism) the
    layers of ``mc2_scope`` are fused: "ffn" (w1, w3 column, w2 row: the original's scope) or
    "all" (also wq, wk, wv, wo and, with loss parallel, the output projection). With loss
    parallel the logits stay sharded over the vocabulary, tagged for ``loss_parallel()``."""
    args, tp, sp = model.args, tp_mesh.size(0), enable_sequence_parallel
    _check(args, tp, seq_len or args.max_seq_len, sp, enable_mc2, mc2_scope)
    mc2_ffn, mc2_attention = enable_mc2, enable_mc2 and mc2_scope == "all"
    residual = Shard(1) if sp else Replicate()
    contract = mc2_contract or MC2Contract.strict()

    def column(fused):
        return MC2ColwiseParallel(input_layouts=Shard(1), contract=contract) if fused else ColwiseParallel()

    def row(fused):
        if fused:
            return MC2RowwiseParallel(input_layouts=Shard(-1), output_layouts=Shard(1), contract=contract)
        return RowwiseParallel(output_layouts=residual)

    if mc2_attention and enable_loss_parallel:
        # The final norm's output stays sequence-sharded: the fused op gathers it.
        output = MC2ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False,
                                    contract=contract)
    else:
        output = ColwiseParallel(input_layouts=residual,
                                 output_layouts=Shard(-1) if enable_loss_parallel else Replicate(),
                                 use_local_output=not enable_loss_parallel)
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": output,
        "layers.*.attention.wq": column(mc2_attention),
        "layers.*.attention.wk": column(mc2_attention),
        "layers.*.attention.wv": column(mc2_attention),
        "layers.*.attention.wo": row(mc2_attention),
        "layers.*.feed_forward.w1": column(mc2_ffn),
        "layers.*.feed_forward.w3": column(mc2_ffn),
        "layers.*.feed_forward.w2": row(mc2_ffn),
    }
    if sp:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"norm": SequenceParallel(), "layers.*.attention_norm": SequenceParallel(),
                     "layers.*.ffn_norm": SequenceParallel()})
        if not mc2_attention:
            plan["layers.*.attention"] = gather
        if not mc2_ffn:
            plan["layers.*.feed_forward"] = gather
    return parallelize_module(model, tp_mesh, plan)


def hand_written_plain_plan():
    """The TP + SP plan, key by key (what parallelize_llama3 builds without MC2), for a test that
    the table gives the same model."""
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
