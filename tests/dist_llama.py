"""A small llama-style model and its torch-native parallel training loops, run on simtrain ranks and on gloo.

The model is torchtitan's shape in miniature (token embedding, RMSNorm, attention
with causal heads and no rotary embedding, a SwiGLU feed-forward, an output
projection), and the
loops use only torch's own APIs: `init_device_mesh`, `parallelize_module` with
ColwiseParallel / RowwiseParallel / SequenceParallel / PrepareModuleInput,
FSDP2's `fully_shard`, and `torch.distributed.pipelining`. Every function here is
module-level, so the gloo reference (tests/gloo_processes.py) can pickle it.
Called in a rank whose process group is initialized (simtrain or gloo):

    params = tp_fsdp_training(world, tp=2, sequence_parallel=True, layers=2)  # {name: full tensor} after STEPS
    params = pipeline_training(world, pp=2, tp=2, schedule="1f1b")            # this rank's stages' parameters
    expected = single_process(dp=world // 4, layers=2)                        # the whole model, the global batch
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH, STEPS, LR = 64, 32, 4, 4, 8, 4, 2, 0.1  # the second step: on updated weights
MICROBATCHES = 2
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        batch, seq, _ = x.shape  # under tensor parallelism this rank's heads: -1 below
        q, k, v = (w(x).view(batch, seq, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The whole model, or (torchtitan's way of cutting pipeline stages) a part with the others set to None."""

    def __init__(self, layers: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        x = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x)) if self.output is not None else x


def make_model(layers=LAYERS):
    torch.manual_seed(0)
    return Llama(layers)


def batches(dp_rank):
    """The tokens and targets of data-parallel rank `dp_rank`, one pair per step."""
    generator = torch.Generator().manual_seed(dp_rank)
    tokens = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def single_process(dp, layers=LAYERS):
    """The reference: one process training the whole model (of `layers` blocks) on the `dp` data-parallel ranks'
    batches together."""
    model = make_model(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = [batches(rank) for rank in range(dp)]
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens, targets = (torch.cat([d[step][i] for d in data]) for i in (0, 1))
        loss_fn(model(tokens), targets).backward()
        optimizer.step()
    return {name: value.detach() for name, value in model.state_dict().items()}


def parallelize_tp(model, tp_mesh, sequence_parallel):
    """torchtitan's tensor-parallel plan for llama: attention and feed-forward column- then row-wise; with
    `sequence_parallel`, norms and residuals sharded along the sequence between them."""
    seq, rep = (Shard(1), Replicate()) if sequence_parallel else (Replicate(), Replicate())
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
        if sequence_parallel:
            top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan = {"attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(rep,)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
                "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(rep,)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:
            plan.update(attention_norm=SequenceParallel(), ffn_norm=SequenceParallel())
        parallelize_module(block, tp_mesh, plan)


def shard_fsdp(model, dp_mesh, prefetch=False):
    """FSDP2 per transformer block and on the root, over the mesh's data-parallel dimension; with `prefetch`,
    each block's all-gather is started explicitly by the block before it (after it, in backward)."""
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    if prefetch:
        for before, after in zip(blocks, blocks[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])


def full_parameters(model):
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for name, value in model.state_dict().items()}


def tp_fsdp_training(world, tp, sequence_parallel, prefetch=False, layers=LAYERS):
    """This rank's full parameters after STEPS of FSDP2 (over "dp", `prefetch`: shard_fsdp) x tensor
    parallelism (over "tp") of the model of `layers` blocks."""
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model = make_model(layers)
    parallelize_tp(model, mesh["tp"], sequence_parallel)
    shard_fsdp(model, mesh["dp"], prefetch)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for tokens, targets in batches(mesh["dp"].get_local_rank()):
        optimizer.zero_grad()
        loss_fn(model(tokens), targets).backward()
        optimizer.step()
    return full_parameters(model)


def stage_model(stage, stages):
    """Pipeline stage `stage` of `stages`: its share of the layers, the embedding on the first, the head on the
    last."""
    model = make_model()
    per_stage = LAYERS // stages
    for index in range(LAYERS):
        if not stage * per_stage <= index < (stage + 1) * per_stage:
            del model.layers[str(index)]
    if stage > 0:
        model.tok_embeddings = None
    if stage < stages - 1:
        model.norm = model.output = None
    return model


def pipeline_training(world, pp, tp, schedule, stages_per_rank=1):
    """This rank's stages' full parameters after STEPS of `schedule` over "pp", FSDP2 over "dp" and tensor
    parallelism with sequence parallel styles over "tp" (a 3-D mesh)."""
    mesh = init_device_mesh("cpu", (pp, world // pp // tp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, stages = mesh["pp"].get_local_rank(), pp * stages_per_rank
    models, pipeline = [], []
    for stage in range(pp_rank, stages, pp):  # interleaved: rank r holds stages r, r + pp, ...
        model = stage_model(stage, stages)
        if tp > 1:
            parallelize_tp(model, mesh["tp"], sequence_parallel=True)
        shard_fsdp(model, mesh["dp"])
        models.append(model)
        pipeline.append(PipelineStage(model, stage, stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    schedule = SCHEDULES[schedule](pipeline if stages_per_rank > 1 else pipeline[0], n_microbatches=MICROBATCHES,
                                   loss_fn=loss_fn)
    optimizers = [torch.optim.SGD(model.parameters(), lr=LR) for model in models]
    for tokens, targets in batches(mesh["dp"].get_local_rank()):
        for optimizer in optimizers:
            optimizer.zero_grad()
        schedule.step(tokens if pp_rank == 0 else None, target=targets if pp_rank == pp - 1 else None)
        for optimizer in optimizers:
            optimizer.step()
    return {name: value for model in models for name, value in full_parameters(model).items()}
