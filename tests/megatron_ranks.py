"""A Megatron-Core training job, written as a Megatron-Core user writes one, and its reference on real gloo processes.

`train(rank, world, layout)` is the job of one rank: the model-parallel groups from
`parallel_state.initialize_model_parallel`, the seeds from `model_parallel_cuda_manual_seed`, a tiny GPT
(`GPTModel` on the local, Transformer-Engine-free layer spec; fp32), wrapped in Megatron's
`DistributedDataParallel` with the distributed optimizer, Megatron's Adam (`get_megatron_optimizer`), and the
pipeline schedule `get_forward_backward_func()` picks, over the layout's steps of seeded synthetic tokens. It gives the
rank's per-step losses (on a last pipeline stage: the mean over its micro-batches; elsewhere none) and a flat copy
of its parameters (every model chunk's, in order).

`gloo_rank` runs it in a process of a real gloo group (tests/gloo_processes.py), with the same stand-ins for the
GPU (simtrain.frameworks.megatron's `cpu_machine`) that the simulated ranks use.

    losses, parameters = run_on_gloo(gloo_rank, 4, (Layout(tp=2),))[rank]
"""
import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

SEED = 1234
VOCAB = 128
SEQ = 32
MICRO_BATCH = 2


@dataclass(frozen=True)
class Layout:
    """The parallel degrees of a job (the data-parallel degree is what the world leaves), its micro-batches per
    step per data-parallel rank, and its model's shape."""

    tp: int = 1  # tensor-parallel ranks (with experts and more than one: sequence parallel, as Megatron's MoE asks)
    pp: int = 1  # pipeline stages
    vpp: int | None = None  # model chunks per pipeline stage (interleaved 1F1B), None for one
    ep: int = 1  # expert-parallel ranks (MoE only)
    etp: int = 1  # expert tensor-parallel ranks (MoE only; more than one gathers uneven blocks, which gloo cannot)
    experts: int | None = None  # MoE: experts per layer (alltoall token dispatcher), None for a dense MLP
    layers: int = 4
    hidden: int = 64
    micro_batches: int = 4
    overlap_grad_reduce: bool = False  # gradients reduce-scattered as their buckets fill, during the backward pass
    overlap_param_gather: bool = False  # updated parameters all-gathered during the next forward pass (its hooks)
    steps: int = 3
    clip_grad: float = 1.0  # Megatron's gradient clipping by the global norm (0: none; it reads the norm's value)


def initialize(rank: int, world: int, layout: Layout) -> None:
    """Megatron-Core's parallel state and seeds for `layout` (the default process group already joined)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    if not torch.distributed.is_initialized():  # the launcher's group (gloo's) is already there
        torch.distributed.init_process_group(rank=rank, world_size=world)  # the device's default backend
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp, create_gloo_process_groups=False)
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)


def sequence_parallel(layout: Layout) -> bool:
    """Megatron's MoE layer refuses to train with tensor parallelism but without sequence parallelism."""
    return layout.experts is not None and layout.tp > 1


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm as a layer spec's norm that allows sequence parallelism (Megatron's own torch norm refuses
    it; apex's and Transformer Engine's, not installed here, allow it): its parameters marked `sequence_parallel`,
    so Megatron all-reduces their gradients over the tensor-parallel group, as it does those norms'."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        for parameter in self.parameters():
            parameter.sequence_parallel = config.sequence_parallel


def layer_spec(layout: Layout, config, vp_stage):
    """Megatron's local (Transformer-Engine-free) layer spec, as a block of the stage's layers whose norms are
    `SequenceParallelLayerNorm` where the job is sequence parallel."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    spec = get_gpt_layer_local_spec(num_experts=layout.experts)
    if not sequence_parallel(layout):
        return spec
    layer = dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=SequenceParallelLayerNorm, pre_mlp_layernorm=SequenceParallelLayerNorm))
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=SequenceParallelLayerNorm)


def transformer_config(layout: Layout):
    from megatron.core.transformer.transformer_config import TransformerConfig
    moe = {} if layout.experts is None else {
        "num_moe_experts": layout.experts, "moe_router_topk": 2, "moe_token_dispatcher_type": "alltoall",
        "moe_aux_loss_coeff": 0.0, "moe_ffn_hidden_size": 2 * layout.hidden, "moe_grouped_gemm": False,
        "expert_tensor_parallel_size": layout.etp,
        "add_bias_linear": layout.etp == 1}  # Megatron's experts take a bias only without expert tensor parallelism
    return TransformerConfig(
        num_layers=layout.layers, hidden_size=layout.hidden, num_attention_heads=4, ffn_hidden_size=2 * layout.hidden,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, expert_model_parallel_size=layout.ep,
        sequence_parallel=sequence_parallel(layout), pipeline_dtype=torch.float32, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, perform_initialization=True,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False, deterministic_mode=True,
        **moe)


def build_model(layout: Layout, config) -> list:
    """The rank's model chunks (one per virtual stage), each in Megatron's DistributedDataParallel."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, use_distributed_optimizer=True,
                                               overlap_grad_reduce=layout.overlap_grad_reduce,
                                               overlap_param_gather=layout.overlap_param_gather, bucket_size=None)
    chunks = []
    for stage in range(layout.vpp or 1):
        vp_stage = stage if layout.vpp else None
        model = GPTModel(config=config, transformer_layer_spec=layer_spec(layout, config, vp_stage),
                         vocab_size=VOCAB, max_sequence_length=SEQ,
                         pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                         post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                         vp_stage=vp_stage)
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                              disable_bucketing=stage > 0))
    return chunks


def batches(step: int, layout: Layout):
    """The micro-batches of `step` for this rank's data-parallel replica: seeded by step, replica and micro-batch
    (the model-parallel ranks of a replica read the same tokens)."""
    from megatron.core import parallel_state
    replica = parallel_state.get_data_parallel_rank()
    for micro in range(layout.micro_batches):
        generator = torch.Generator().manual_seed(SEED + 1000 * step + 100 * replica + micro)
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
               "loss_mask": torch.ones(MICRO_BATCH, SEQ),
               "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ).contiguous()}


def forward_step(data_iterator, model):
    """Megatron's forward-step function: the model's per-token losses, and how to reduce them."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss_mask = batch["loss_mask"]

    def loss_func(output_tensor):
        loss = torch.sum(output_tensor.float().view(-1) * loss_mask.view(-1)) / loss_mask.sum()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides the loss in place

    return output, partial(loss_func)


def train(rank: int, world: int, layout: Layout, after_step=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's training (see above): its losses (one per step, none off the last stage) and flat
    parameters; `after_step()`, if given, called after each step's optimizer step (a timer's reading)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    initialize(rank, world, layout)
    config = transformer_config(layout)
    chunks = build_model(layout, config)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                        clip_grad=layout.clip_grad, bf16=False, fp16=False, use_distributed_optimizer=True),
        chunks, use_gloo_process_groups=False)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in chunks] if len(chunks) > 1 else chunks[0].no_sync
    if layout.overlap_grad_reduce:
        config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
        if len(chunks) == 1:
            config.grad_sync_func = config.grad_sync_func[0]
    forward_backward = get_forward_backward_func()
    losses = []
    for step in range(layout.steps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        data = [batches(step, layout) for _ in chunks]
        reduced = forward_backward(forward_step_func=forward_step, data_iterator=data if len(chunks) > 1 else data[0],
                                   model=chunks if len(chunks) > 1 else chunks[0],
                                   num_microbatches=layout.micro_batches, seq_length=SEQ,
                                   micro_batch_size=MICRO_BATCH, decoder_seq_length=SEQ, forward_only=False)
        updated, _, _ = optimizer.step()
        assert updated
        if after_step is not None:
            after_step()
        if reduced:
            losses.append(torch.stack([entry["lm loss"] for entry in reduced]).mean())
    if layout.overlap_param_gather:  # the last step's parameters, gathered as Megatron does before it saves them
        for chunk in chunks:
            chunk.disable_forward_pre_hook()
    parameters = torch.cat([p.detach().reshape(-1) for chunk in chunks for p in chunk.parameters()])
    return (torch.stack(losses) if losses else torch.zeros(0)), parameters.clone()


def gloo_rank(rank: int, world: int, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """In a process of a gloo group: the job on the CPU, through `cpu_machine`'s stand-ins."""
    from simtrain.frameworks.megatron import cpu_machine
    with cpu_machine():
        return train(rank, world, layout)
