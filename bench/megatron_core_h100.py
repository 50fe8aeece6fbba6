"""Megatron-Core's H100 weak-scaling table against simtrain: TFLOP/s per GPU for GPT 1.7B to 462B.

Megatron-LM's README ("Performance Benchmarking", images/model_table.png) trains GPT models of 1.7B to 462B
parameters on 48 to 6,144 H100s (s = 4096, V = 131,072, dp 48 throughout) and reports each one's TFLOP/s per
GPU and MFU. Megatron-LM counts a step's model FLOPs (no recomputation) as 72 B s l h² (1 + s/(6h) +
V/(12 l h)) (megatron/training/training.py, num_floating_point_operations, for a GPT of 4h MLP). This runs
scenarios/megatron-core-h100/*.yaml (numerics off), divides those FLOPs by the simulated step time and the
GPU count, and prints each row beside the README's, with the simulation's own wall time.

    python bench/megatron_core_h100.py                    # every row
    python bench/megatron_core_h100.py --rows gpt-1.7b gpt-177b
    python bench/megatron_core_h100.py --calibrate gpt-1.7b    # the H100 efficiency that matches that row
"""
from pathlib import Path

from published_rows import Table

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios" / "megatron-core-h100"
# The README's table: TFLOP/s per GPU, by scenario name
README_TFLOPS = {"gpt-1.7b": 408.8, "gpt-7.1b": 465.9, "gpt-16b": 489.1, "gpt-32b": 459.6, "gpt-70b": 419.7,
                 "gpt-119b": 420.5, "gpt-177b": 432.8, "gpt-314b": 474.4, "gpt-462b": 459.9}
FITTED_ROW = "gpt-1.7b"


def model_flops(scenario) -> float:
    """Megatron-LM's FLOPs of one step: 72 B s l h² (1 + s/(6h) + V/(12 l h)), B the global batch."""
    layout = scenario.parallel
    batch = scenario.data.batch_size * scenario.cluster.devices // (layout.pp * layout.tp)
    s, layers, hidden, vocab = scenario.data.seq_len, scenario.model.layers, scenario.model.width, scenario.data.vocab
    return 72 * batch * s * layers * hidden**2 * (1 + s / (6 * hidden) + vocab / (12 * layers * hidden))


TABLE = Table(SCENARIOS, README_TFLOPS, model_flops)


def main() -> None:
    TABLE.main(__doc__, "README", ("model", "tp x pp x dp", "GPUs"), lambda name, scenario: (
        name, f"{scenario.parallel.tp} x {scenario.parallel.pp} x "
              f"{scenario.cluster.devices // (scenario.parallel.tp * scenario.parallel.pp)}",
        f"{scenario.cluster.devices:,}"))


if __name__ == "__main__":
    main()
