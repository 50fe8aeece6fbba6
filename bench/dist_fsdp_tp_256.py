"""Wall time of one training step of a 1B-parameter llama-style model, FSDP2 x tensor parallel, on 256 simulated
ranks with numerics off (`simtrain.dist.spawn(..., numerics=False)`), on this machine's CPUs.

The model is Llama 3.2 1B's shape with a 32,000-token vocabulary and full multi-head attention (dimension 2,048,
16 blocks of 32 heads, SwiGLU feed-forward of 8,192): 1.20e9 parameters. The script is what a user writes with
torch's own APIs, as torchtitan does: `init_device_mesh` over ("dp", "tp"), `parallelize_module` with
ColwiseParallel / RowwiseParallel / SequenceParallel per block, `fully_shard` per block and on the root, AdamW,
one step of a batch of 1 sequence of 2,048 tokens per data-parallel rank. Numerics off: weights, activations,
gradients and optimizer state are fake tensors; the collectives and the operator recorder time them on the
simulated cluster. The data-parallel and the tensor-parallel ranks run alike, so the function runs once
(`representatives=Representatives((dp, tp), alike_dims=(0, 1))`), and once more for the witness that checks it;
the others post their parts of its collectives on the network. Printed: the wall and CPU time of the spawn (model
construction, sharding and the step), the simulated step time and rank 0's memory by category.

    PYTHONPATH=. .venv/bin/python bench/dist_fsdp_tp_256.py                  # 256 ranks: dp 32 x tp 8
    PYTHONPATH=. .venv/bin/python bench/dist_fsdp_tp_256.py --world 16       # a quick look: dp 2 x tp 8
    PYTHONPATH=. .venv/bin/python bench/dist_fsdp_tp_256.py --every-rank     # without representatives
    PYTHONPATH=. .venv/bin/python bench/dist_fsdp_tp_256.py --world 16 --layers 2 --check   # both: reports equal?
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

import simtrain.dist
from simtrain.dist import Representatives

VOCAB, DIM, LAYERS, HEADS, HIDDEN, SEQ, TP = 32_000, 2048, 16, 32, 8192, 2048, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention = Attention()
        self.w1, self.w3, self.w2 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False), \
            nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def parallelize(model, mesh):
    """torchtitan's plan: tensor parallel with sequence parallel norms over "tp", FSDP2 per block over "dp"."""
    parallelize_module(model, mesh["tp"], {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "w1": ColwiseParallel(input_layouts=Shard(1)), "w3": ColwiseParallel(input_layouts=Shard(1)),
            "w2": RowwiseParallel(output_layouts=Shard(1))})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


RANK_CPU_S = {}  # CPU seconds of each rank's thread that ran


def train_step(rank, world):
    start = time.thread_time()
    try:
        one_step(rank, world)
    finally:
        RANK_CPU_S[rank] = time.thread_time() - start


def one_step(rank, world):
    dist.init_process_group("simtrain")
    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    model = Llama()
    parallelize(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(mesh["dp"].get_local_rank()))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def main():
    global LAYERS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=256)
    parser.add_argument("--every-rank", action="store_true", help="run every rank's function (no representatives)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="transformer blocks (a quick look: fewer)")
    parser.add_argument("--check", action="store_true",
                        help="then run every rank's function too, and compare the two reports")
    args = parser.parse_args()
    LAYERS = args.layers
    with torch.device("meta"):
        parameters = sum(p.numel() for p in Llama().parameters())
    representatives = None if args.every_rank else Representatives((args.world // TP, TP), alike_dims=(0, 1))
    load_before = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    result = run(args.world, representatives)
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    data = result.report.data
    per_rank = ", ".join(f"rank {rank} {cpu:.1f} s" for rank, cpu in sorted(RANK_CPU_S.items())[:3])
    print(f"{parameters / 1e9:.2f}e9 parameters, {args.world} ranks (dp {args.world // TP} x tp {TP}), "
          f"numerics off, {'every rank run' if args.every_rank else 'representatives'}: {wall_s:.1f} s of wall time, "
          f"{cpu_s:.1f} s of CPU time on {os.cpu_count()} CPUs (load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} at the end); of the CPU time, {sum(RANK_CPU_S.values()):.1f} s in the "
          f"threads of the {len(RANK_CPU_S)} ranks that ran (their code and its posts; "
          f"{per_rank}), the rest in the clock's "
          f"(the network, the collective programs) and the report")
    print(f"simulated step: {data['sim_time_s'] * 1e3:.1f} ms; rank 0 memory at its peak (GB): " +
          ", ".join(f"{k} {v / 1e9:.2f}" for k, v in data["devices"][0]["peak_memory_bytes_by_category"].items() if v))
    if args.check and representatives is not None:
        start = time.process_time()
        every = run(args.world, None).report.data
        print(f"every rank run: {time.process_time() - start:.1f} s of CPU time; the two reports (time, bytes and "
              f"memory of every rank and link) are {'equal' if every == data else 'DIFFERENT'}")


def run(world, representatives):
    return simtrain.dist.spawn(train_step, world=world, device="h100-80gb", topology="switch", numerics=False,
                               timeout_s=60, representatives=representatives)


if __name__ == "__main__":
    main()
