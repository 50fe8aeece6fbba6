"""torchtitan's own Llama 3 and its own parallelize function on simulated H100s, numerics off: the tokens per second
per GPU simtrain predicts beside the figure torchtitan published for the same configuration.

The published figures (pytorch/torchtitan, read at commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a; each page last
changed in 820504e20d1149fbf0b98c567af24c4b0433b22d), both on Grand Teton hosts (8 H100s with 96 GB of HBM2e on
NVLink, 500 W, 400 Gb/s RDMA per GPU), Llama 3.1 8B, sequences of 8,192 tokens, bf16 parameters, fp32 reductions:

- `--run fsdp8`: benchmarks/llama3_h100_202412_torchtitan.md, Table 1: 8 GPUs, FSDP 8, local batch 2, selective
  activation checkpointing, no torch.compile, no Float8: 5,762 tokens/s/GPU and 82.4 GiB;
- `--run fsdp8-tp8`: benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md: 64 GPUs, FSDP 8 x TP 8, local batch
  12, per-op selective checkpointing, torch.compile, vanilla TP, bfloat16: 4,378 tokens/s/GPU.

What runs is torchtitan 0.3.0's code (`pip install -e ".[titan]"`): its `ParallelDims` builds the device mesh,
its Llama 3 8B config (`model_registry("8B")`) is built on the meta device, its `parallelize_llama` applies its
tensor-parallel sharding (`Module.parallelize`, sequence parallel), its activation checkpointing (`SelectiveAC`)
and FSDP2 (`apply_fsdp_to_decoder`, which sets FSDP's gradient divide factor to 1: reduce-scatters with
`ReduceOp.PREMUL_SUM`), and its `CrossEntropyLoss` (summed, divided by the global token count, as its trainer does;
loss-parallel under TP). Then AdamW with its default settings, two steps; the second step's simulated time
(`simtrain.dist.now_s()`) is the step time. The ranks of the data-parallel dimension run alike, so one runs per
tensor-parallel rank, plus the witness (`Representatives`). What differs from torchtitan's trainer:

- attention is its `ScaledDotProductAttention` (causal), the published runs'; 0.3.0's language models take only
  FlexAttention (always torch.compile'd, which does not run on fake tensors) or varlen attention;
- `spmd_backend="partial_dtensor"` (DTensor for the model-parallel dimensions, as the published runs had); 0.3.0's
  default `spmd_types` stops in FSDP2 on a parameter it left a plain tensor (docs/guides/torchtitan.md);
- weights are not initialised (`init_weights` draws a truncated normal until no value falls outside its bounds, a
  loop on values that fake tensors do not have), and the sharding configs are set by
  `set_llama3_sharding_config` directly (`update_from_config` calls it, after importing the trainer and its data
  loaders); AdamW is torch's default implementation (torchtitan asks for the fused one, CUDA's);
- torchtitan picks the device type "cuda" without a GPU; here it is set to "cpu".

    PYTHONPATH=. .venv/bin/python bench/torchtitan_llama3.py                      # fsdp8: 8 ranks
    PYTHONPATH=. .venv/bin/python bench/torchtitan_llama3.py --run fsdp8-tp8      # 64 ranks
    PYTHONPATH=. .venv/bin/python bench/torchtitan_llama3.py --layers 2           # a quick look (not the model)
"""
import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

import simtrain.dist

# The published runs (tokens/s/GPU as torchtitan logs it: a rank's tokens over the step time and the
# non-data-parallel degree), each with what differs from the run here.
PUBLISHED = {
    "fsdp8": dict(flavor="8B", world=8, tp=1, batch=2, seq=8192, tokens_per_s_per_gpu=5762, memory_GiB=82.4,
                  source="benchmarks/llama3_h100_202412_torchtitan.md, Table 1, FSDP (torchtitan 9dec370)",
                  differs="none beyond those of the module docstring"),
    "fsdp8-tp8": dict(flavor="8B", world=64, tp=8, batch=12, seq=8192, tokens_per_s_per_gpu=4378, memory_GiB=None,
                      source="benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, Llama3 8b on 64 H100s, FSDP 8, "
                             "TP 8, vanilla TP, bfloat16 (torchtitan 820504e)",
                      differs="the published run used torch.compile"),
}
# Grand Teton's H100 (both pages): the H100 SXM's FLOP/s (the 2024 page: its peak is between SXM and NVL), 96 GiB of
# HBM2e at 2.4 TB/s; 8 to a host on NVLink (as dgx-h100-1node.yaml), hosts on a 400 Gb/s RDMA NIC per GPU
# (as dgx-h100-2node.yaml's InfiniBand NDR, to one spine).
GRAND_TETON_H100 = {"base": "h100-80gb", "name": "h100-96gb-hbm2e", "memory": "96 GiB", "memory_bandwidth": "2.4 TB/s"}
# Link classes as topologies/dgx-h100-2node.yaml gives them (the NVSwitch modelled as one switch per host).
LINK_CLASSES = {"nvlink4-nvswitch": {"bandwidth": "450 GB/s", "latency": "0.25 us", "efficiency": 0.8},
                "rdma-400g": {"bandwidth": "400 Gb/s", "latency": "1.35 us", "efficiency": 0.96}}


def grand_teton_scenario(world: int, folder: str) -> str:
    """A scenario file of `world` Grand Teton H100s: hosts of 8 on an NVLink switch each, every GPU's 400 Gb/s NIC
    to one spine (a host alone: as topologies/dgx-h100-1node.yaml)."""
    hosts = range(world // 8)
    gpus = [f"n{host}g{gpu}" for host in hosts for gpu in range(8)]
    links = [{"between": [gpu, f"{gpu.partition('g')[0]}-nvswitch"], "class": "nvlink4-nvswitch"} for gpu in gpus]
    if len(hosts) > 1:
        links += [{"between": [gpu, "spine"], "class": "rdma-400g"} for gpu in gpus]
    switches = [f"n{host}-nvswitch" for host in hosts]
    topology = {"name": f"grand-teton-{len(hosts)}host", "gpus": gpus,
                "switches": switches + ["spine"] * (len(hosts) > 1), "reducing_switches": switches,
                "link_classes": LINK_CLASSES, "links": links}
    folder = Path(folder)
    (folder / "topology.yaml").write_text(yaml.safe_dump(topology))
    (folder / "scenario.yaml").write_text(yaml.safe_dump({"cluster": {"device": GRAND_TETON_H100,
                                                                      "topology": "topology.yaml"}}))
    return str(folder / "scenario.yaml")


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
    parser.add_argument("--run", choices=sorted(PUBLISHED), default="fsdp8", help="the published run to predict")
    parser.add_argument("--layers", type=int, default=None, help="the first N blocks only (a quick look)")
    args = parser.parse_args()
    published = PUBLISHED[args.run]
    for key in ("flavor", "world", "tp", "batch", "seq"):
        setattr(args, key, published[key])
    titan_on_cpu()
    step_s = {}
    representatives = simtrain.dist.Representatives((args.world // args.tp, args.tp), alike_dims=(0,))
    load_before = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as folder:
        result = simtrain.dist.spawn(train_step(args, step_s), scenario=grand_teton_scenario(args.world, folder),
                                     numerics=False, timeout_s=None, representatives=representatives)
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    with torch.device("meta"):
        parameters = sum(p.numel() for p in llama3_config(args.flavor, args.layers).build().parameters())
    tokens_per_s = args.batch * args.seq / step_s[0] / args.tp
    device = result.report.data["devices"][0]
    print(f"torchtitan Llama 3 {args.flavor} ({parameters / 1e9:.2f}e9 parameters"
          f"{f', first {args.layers} blocks' if args.layers else ''}), {args.world} simulated H100s, "
          f"FSDP {args.world // args.tp} x TP {args.tp}, local batch {args.batch} x {args.seq} tokens, selective "
          f"activation checkpointing, numerics off, representatives")
    print(f"simtrain: step {step_s[0] * 1e3:.1f} ms, {tokens_per_s:,.0f} tokens/s/GPU, rank 0 peak memory "
          f"{device['peak_memory_bytes'] / 2 ** 30:.1f} GiB (each category at its own peak: "
          + ", ".join(f"{k} {v / 2 ** 30:.1f}" for k, v in device["peak_memory_bytes_per_category"].items() if v)
          + ")")
    print(f"rank 0 over the run (model built and sharded, two steps): {device['compute_s']:.3f} s of compute, "
          f"{device['communication_s']:.3f} s of communication (the part not overlapped is in the step)")
    memory = f", {published['memory_GiB']} GiB" if published["memory_GiB"] else ""
    print(f"published (pytorch/torchtitan {published['source']}): {published['tokens_per_s_per_gpu']:,} "
          f"tokens/s/GPU{memory}; what differs: {published['differs']}")
    print(f"{wall_s:.1f} s of wall time, {cpu_s:.1f} s of CPU time on {os.cpu_count()} CPUs (load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
