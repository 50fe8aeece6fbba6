"""Llama 3 70B on 1,024 H100s with FSDP x TP: one step, numerics off, and how long it takes to simulate.

torchtitan trains Llama 3 70B with tensor parallelism inside a host (tp 8)
and FSDP over the hosts (dp 128 sharded, ZeRO stage 3); this is that step in
simtrain: Llama 3 70B (Grattafiori et al. 2024, table 3: 80 layers, width
8192, 64 heads, 8 key/value heads, FFN 28672, vocabulary 128,256) at sequence
8,192, 16 sequences a replica (2,048 a step: 16M tokens, as Llama 3's
pre-training batch), bf16, Adam, full recomputation, gradient accumulation
over 16 microbatches of one sequence with the parameters kept gathered from
the first forward to the last backward (`reshard_after_forward: false`, as
Llama 3 and torchtitan run FSDP beside gradient accumulation). The cluster is
scenarios/llama3-405b-8k.yaml's (Grand Teton hosts of 8 H100 on NVLink, one
400 Gb/s RoCE NIC per GPU, the clos3 builder), cut to 1,024 GPUs. With
`representatives` one rank runs for all (strategies/representatives.py).

It prints the simulated step time, TFLOP/s per GPU and MFU (PaLM's model
FLOPs), each rank's peak memory by
category, and the wall and CPU time of the simulation in this process
(on a loaded machine the wall time is the CPU time stretched by the load).
Target: at most 30 s on 2 cores.

    .venv/bin/python bench/llama70b_fsdp_tp.py
"""
import os
import resource
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPUS, TP = 1024, 8


def scenario():
    """The 70B FSDP x TP step on the 405B scenario's cluster, cut to 1,024 GPUs."""
    from simtrain.scenario import load_scenario, validate_scenario

    base = load_scenario(ROOT / "scenarios" / "llama3-405b-8k.yaml").model_dump(mode="json", exclude_unset=True)
    return validate_scenario({
        **base, "name": "llama3-70b-fsdp-tp",
        "cluster": {**base["cluster"], "devices": GPUS},
        "model": {"name": "llama", "hidden": 8192, "layers": 80, "heads": 64, "kv_heads": 8, "ffn_hidden": 28672,
                  "rope_theta": 500000},
        "data": {"name": "tokens", "batch_size": 16, "seq_len": 8192, "vocab": 128256},
        "train": {**base["train"], "steps": 1},
        "parallel": {"all_reduce": "ring", "tp": TP, "dp": GPUS // TP, "pipeline": {"microbatches": 16},
                     "sharding": {"stage": 3, "reshard_after_forward": False}, "representatives": True},
    })


def model_flops(spec) -> float:
    """PaLM's model FLOPs of one step (Chowdhery et al. 2022, appendix B): (6 N + 12 L h s) per token, N the
    parameters without the input embedding (a lookup, no matmul)."""
    from simtrain.train.llama import parameter_count

    model, data = spec.model, spec.data
    parameters = parameter_count(data.vocab, model.width, model.layers, model.heads, model.key_value_heads,
                                 model.ffn_width) - data.vocab * model.width
    tokens = data.batch_size * (GPUS // TP) * data.seq_len
    return tokens * (6 * parameters + 12 * model.layers * model.width * data.seq_len)


def main() -> None:
    import simtrain
    from simtrain.hw.catalog import CATALOG

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    spec = scenario()
    started, cpu_started = time.perf_counter(), time.process_time()
    report = simtrain.run(spec)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    data = report.data
    print(f"status {data['status']}; simulated in {wall:.1f} s wall, {cpu:.1f} s CPU; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB")
    if data["status"] == "ok":
        tflops = model_flops(spec) / data["step_time_s"] / GPUS / 1e12
        mfu = tflops / (CATALOG["h100-80gb"].peak_flops["bf16"] / 1e12)
        print(f"step {data['step_time_s']:.2f} s, {tflops:.0f} TFLOP/s per GPU, MFU {100 * mfu:.1f}%")
        device = data["devices"][0]
        print("rank 0 peak GiB by category:", {category: round(nbytes / 2**30, 2) for category, nbytes
                                               in device["peak_memory_bytes_by_category"].items()})
        print("sharding:", {key: data["sharding"][key] for key in ("stage", "degree", "units", "bytes_by_kind")})
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
