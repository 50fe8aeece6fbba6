"""torchtitan's own Trainer (`simtrain torchtitan`) on simulated Grand Teton H100s, numerics off: step time, tokens
per second per GPU, MFU by torchtitan's count, memory, and the CPU time the run took.

- `--run fsdp8`: torchtitan's `llama3_8b` config, FSDP 8 on 8 GPUs, local batch 2 of 8,192 tokens, selective
  activation checkpointing: the configuration of benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (5,762
  tokens/s/GPU, 82.4 GiB), there measured with causal SDPA attention (0.3.0 has FlexAttention with document
  masking: see docs/guides/torchtitan.md);
- `--run 405b-512`: Llama 3.1 405B in bf16 on 512 GPUs, TP 8 x FSDP 64, local batch 2 of 8,192 tokens, full
  activation checkpointing: torchtitan's `llama3_405b` config less its float8 converter (torchao) and torch.compile,
  which do not run here (`llama3_405b_bf16` below, a config module as a user would write one). Target (issue 53):
  within 5 minutes.

The data is the tests' seeded synthetic tokenizer and dataset (tests/titan_ranks.py; no download); the cluster is
bench/torchtitan_llama3.py's Grand Teton hosts.

    PYTHONPATH=. .venv/bin/python bench/torchtitan_trainer.py --run fsdp8
    PYTHONPATH=. .venv/bin/python bench/torchtitan_trainer.py --run 405b-512
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]  # the Grand Teton cluster; the synthetic assets

RUNS = {
    "fsdp8": dict(world=8, arguments=["--module", "llama3", "--config", "llama3_8b",
                                      "--training.local_batch_size", "2"]),
    "405b-512": dict(world=512, arguments=["--module", "torchtitan_trainer", "--config", "llama3_405b_bf16"]),
}


def llama3_405b_bf16():
    """torchtitan's llama3_405b config (0.3.0) without its float8 converter and torch.compile."""
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_70b
    config = llama3_70b()
    config.model_spec = model_registry("405B")
    config.hf_assets_path = "./assets/hf/Llama-3.1-405B"
    config.training.local_batch_size = 2
    return config


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", choices=sorted(RUNS), default="fsdp8")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    from simtrain.frameworks.torchtitan import run_torchtitan
    from simtrain.scenario import load_cluster
    from titan_ranks import titan_assets
    from torchtitan_llama3 import grand_teton_scenario
    run = RUNS[args.run]
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        assets = titan_assets(folder / "assets")
        arguments = [*run["arguments"], "--hf_assets_path", str(assets / "tokenizer"), "--dataloader.dataset",
                     "c4_test", "--dataloader.dataset_path", str(assets / "data"), "--training.steps",
                     str(args.steps), "--validator.no-enable", "--parallelism.spmd_backend", "partial_dtensor",
                     "--dump_folder", str(folder / "outputs"), "--metrics.no-enable-tensorboard",
                     "--profiler.no-enable-profiling"]
        scenario = load_cluster(grand_teton_scenario(run["world"], str(folder)), [], None)
        load, start, cpu = os.getloadavg()[0], time.perf_counter(), time.process_time()
        result = run_torchtitan(arguments, scenario)
        wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    device = result.result.report.data["devices"][0]
    print(f"{args.run}: {run['world']} ranks, steps {', '.join(f'{s * 1e3:.1f}' for s in result.step_s)} ms; "
          f"{result.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {100 * result.mfu:.1f}% "
          f"(torchtitan's count); rank 0 peak {device['peak_memory_bytes'] / 2 ** 30:.1f} GiB ("
          + ", ".join(f"{k} {v / 2 ** 30:.1f}" for k, v in device["peak_memory_bytes_by_category"].items() if v)
          + ")")
    print(f"{wall_s:.1f} s of wall time, {cpu_s:.1f} s of CPU (load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after)")


if __name__ == "__main__":
    main()
