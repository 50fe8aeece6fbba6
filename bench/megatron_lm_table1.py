"""Table 1 of Narayanan et al. 2021 against simtrain: achieved TFLOP/s per GPU for GPT 1.7B to 1T.

The paper ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC'21) trains GPT models with s = 2048, V = 51,200,
interleaved 1F1B and full activation recomputation on DGX A100 nodes, and
counts a step's model FLOPs as 96 B s l h^2 (1 + s/(6h) + V/(16 l h)). This
runs scenarios/megatron/*.yaml (numerics off), divides those FLOPs by the
simulated step time and the GPU count, and prints each row beside the
paper's, with the simulation's own wall time.

    python bench/megatron_lm_table1.py                      # every row
    python bench/megatron_lm_table1.py --rows gpt-1.7b gpt-1008b
    python bench/megatron_lm_table1.py --calibrate gpt-145.6b   # the device efficiency that matches that row

`--calibrate` solves for `cluster.device.efficiency` on one row (secant on
the simulated TFLOP/s, which rises with the efficiency); the scenarios carry
the value it gave.
"""
from pathlib import Path

from published_rows import Table

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios" / "megatron"
# Table 1 (Narayanan et al. 2021): achieved TFLOP/s per GPU, by scenario name
PAPER_TFLOPS = {"gpt-1.7b": 137, "gpt-3.6b": 138, "gpt-7.5b": 142, "gpt-18.4b": 135, "gpt-39.1b": 138,
                "gpt-76.1b": 140, "gpt-145.6b": 148, "gpt-310.1b": 155, "gpt-529.6b": 163, "gpt-1008b": 163}


def model_flops(scenario) -> float:
    """The paper's FLOPs of one step (forward, backward and the recomputed forward)."""
    layout = scenario.parallel
    devices = scenario.cluster.devices
    batch = scenario.data.batch_size * devices // (layout.pp * layout.tp)
    s, layers, hidden, vocab = scenario.data.seq_len, scenario.model.layers, scenario.model.width, scenario.data.vocab
    return 96 * batch * s * layers * hidden**2 * (1 + s / (6 * hidden) + vocab / (16 * layers * hidden))


TABLE = Table(SCENARIOS, PAPER_TFLOPS, model_flops)


def main() -> None:
    TABLE.main(__doc__, "paper", ("model", "GPUs"), lambda name, scenario: (name, f"{scenario.cluster.devices:,}"))


if __name__ == "__main__":
    main()
