"""torchtitan's own Llama 3 and its own parallelize function on simulated H100s, numerics off: the tokens per second
per GPU simtrain predicts beside the figure torchtitan published for the same configuration.

The published figure: pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (last changed in commit
820504e20d1149fbf0b98c567af24c4b0433b22d; read at b5bcd76c66d0acb1a08b176d9639425bc55e0b2a), Table 1: Llama 3.1 8B,
8 H100s of a Grand Teton host (NVLink, 96 GB HBM2e, 500 W), FSDP 8, local batch 2 of 8,192 tokens, selective
activation checkpointing, bf16 parameters and fp32 reductions, no torch.compile, no Float8: 5,762 tokens/s/GPU
and 82.4 GiB of memory.

What runs is torchtitan 0.3.0's code (`pip install -e ".[titan]"`): its `ParallelDims` builds the device mesh,
its Llama 3 8B config (`model_registry("8B")`) is built on the meta device, its `parallelize_llama` applies
its activation checkpointing (`SelectiveAC`) and FSDP2 (`apply_fsdp_to_decoder`, which sets FSDP's gradient divide
factor to 1: reduce-scatters with `ReduceOp.PREMUL_SUM`), its tensor-parallel sharding when `--tp` is above 1,
and its `CrossEntropyLoss` (summed, divided by the global token count, as its trainer does). Then AdamW with its
default settings, two steps; the second step's simulated time is the step time. The ranks of the FSDP dimension run
alike, so one runs per tensor-parallel rank, plus the witness (`Representatives`). What differs from the trainer:

- attention is its `ScaledDotProductAttention` (causal), the published run's; 0.3.0's language models take only
  FlexAttention (torch.compile'd, which does not run on fake tensors) or varlen attention;
- `spmd_backend="partial_dtensor"` (DTensor for the model-parallel dimensions, as in the published run); 0.3.0's
  default `spmd_types` refuses FSDP2 of a parameter it left a plain tensor (see docs/guides/torchtitan.md);
- weights are not initialised (`init_weights` draws a truncated normal until no value falls outside its bounds, a
  loop on values that fake tensors do not have), and the sharding configs are set by
  `set_llama3_sharding_config`, which `update_from_config` calls (it imports the trainer and its data loaders);
- torchtitan picks "cuda" without a GPU; here its device type is set to "cpu".

    PYTHONPATH=. .venv/bin/python bench/torchtitan_llama3.py                 # Table 1: 8 ranks, FSDP 8
    PYTHONPATH=. .venv/bin/python bench/torchtitan_llama3.py --layers 2      # a quick look (not the published model)
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

import simtrain.dist

PUBLISHED = {"tokens_per_s_per_gpu": 5762, "memory_GiB": 82.4}
# Grand Teton's H100: the H100 SXM's FLOP/s (the published page: its peak is between SXM and NVL), 96 GiB of HBM2e at
# 2.4 TB/s; 8 of them on one NVLink switch.
GRAND_TETON_H100 = {"base": "h100-80gb", "name": "h100-96gb-hbm2e", "memory": "96 GiB", "memory_bandwidth": "2.4 TB/s"}
TOPOLOGY = os.path.join(os.path.dirname(__file__), "..", "topologies", "dgx-h100-1node.yaml")


def titan_on_cpu():
    """torchtitan's modules, with its device type "cpu" (it falls back to "cuda" without a GPU)."""
    import torchtitan.distributed.parallel_dims
    import torchtitan.tools.utils
    torchtitan.tools.utils.device_type = torchtitan.distributed.parallel_dims.device_type = "cpu"


def llama3_config(flavor: str, layers: int | None):
    """torchtitan's Llama 3 config of `flavor` with causal scaled-dot-product attention (and the first `layers`)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    config = model_registry(flavor).model
    if layers is not None:
        config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def train_step(args, step_s: dict):
    """The rank function: torchtitan's mesh, model and parallelize, two AdamW steps; the second's simulated time."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    def train(rank, world):
        dist.init_process_group("simtrain")
        parallelism = ParallelismConfig(tensor_parallel_degree=args.tp, spmd_backend="partial_dtensor")
        set_spmd_backend(parallelism.spmd_backend)
        dims = ParallelDims.from_config(parallelism, world)
        dims.build_mesh()
        config = llama3_config(args.flavor, args.layers)
        set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
        with torch.device("meta"):
            model = config.build()
        training = TrainingConfig(local_batch_size=args.batch, seq_len=args.seq)
        model = parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                  compile_config=CompileConfig(), ac_config=SelectiveAC.Config(),
                                  dump_folder="outputs")
        model.to_empty(device="cpu")
        model.train()
        loss_fn = CrossEntropyLoss.Config().build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        generator = torch.Generator().manual_seed(dims.get_mesh("batch").get_local_rank())
        global_tokens = torch.tensor(float(args.batch * args.seq * dims.dp_replicate * dims.dp_shard))
        ends = []
        for _ in range(2):
            tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=generator)
            loss, _ = loss_fn(model(tokens[:, :-1]), tokens[:, 1:], global_tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ends.append(simtrain.dist.now_s())
        step_s[rank] = ends[1] - ends[0]

    return train


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="8B", help="torchtitan's Llama 3 flavor")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (the rest is FSDP)")
    parser.add_argument("--batch", type=int, default=2, help="local batch (sequences per rank)")
    parser.add_argument("--seq", type=int, default=8192, help="sequence length (tokens)")
    parser.add_argument("--layers", type=int, default=None, help="the first N blocks only (a quick look)")
    args = parser.parse_args()
    titan_on_cpu()
    step_s = {}
    representatives = simtrain.dist.Representatives((args.world // args.tp, args.tp), alike_dims=(0,))
    load_before = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    result = simtrain.dist.spawn(train_step(args, step_s), world=args.world, topology=TOPOLOGY,
                                 device=GRAND_TETON_H100, numerics=False, timeout_s=None,
                                 representatives=representatives)
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    with torch.device("meta"):
        parameters = sum(p.numel() for p in llama3_config(args.flavor, args.layers).build().parameters())
    tokens_per_s = args.batch * args.seq / step_s[0]
    device = result.report.data["devices"][0]
    print(f"torchtitan Llama 3 {args.flavor} ({parameters / 1e9:.2f}e9 parameters"
          f"{f', first {args.layers} blocks' if args.layers else ''}), {args.world} simulated H100s, "
          f"FSDP {args.world // args.tp} x TP {args.tp}, local batch {args.batch} x {args.seq} tokens, selective "
          f"activation checkpointing, numerics off, representatives")
    print(f"simtrain: step {step_s[0] * 1e3:.1f} ms, {tokens_per_s:,.0f} tokens/s/GPU, rank 0 peak memory "
          f"{device['peak_memory_bytes'] / 2 ** 30:.1f} GiB (each category at its own peak: "
          + ", ".join(f"{k} {v / 2 ** 30:.1f}" for k, v in device["peak_memory_bytes_per_category"].items() if v)
          + ")")
    print(f"published (torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1, FSDP): "
          f"{PUBLISHED['tokens_per_s_per_gpu']:,} tokens/s/GPU, {PUBLISHED['memory_GiB']} GiB")
    print(f"{wall_s:.1f} s of wall time, {cpu_s:.1f} s of CPU time on {os.cpu_count()} CPUs (load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
