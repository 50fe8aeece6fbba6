"""Llama 3 405B on 8,192 and 16,384 H100s against Table 4 of the Llama 3 paper: TFLOP/s per GPU and MFU.

Grattafiori et al. 2024 ("The Llama 3 Herd of Models", table 4) report, for
the 405B model at sequence 8,192 with tp 8, pp 16 and 16M tokens a step,
430 TFLOP/s per GPU (43% BF16 MFU) on 8,192 GPUs (dp 64) and 400 (41%) on
16,384 (dp 128). This runs scenarios/llama3-405b-8k.yaml and -16k.yaml
(numerics off, representatives), each in a fresh process so that its wall time
and peak resident memory are its own (its CPU time too: on a loaded machine the
wall time is the CPU time stretched by the load), and prints the simulated step time
(the last step's: the second, with the parameters' all-gathers the first leaves to it),
TFLOP/s per GPU and MFU beside the paper's, with the simulation's wall time.

Model FLOPs of a step are PaLM's (Chowdhery et al. 2022, appendix B), as
nanoGPT's estimate_mfu counts them: 6 N + 12 L h s per token, N the
parameters without the input embedding (a lookup, no matmul), L layers, h the
width, s the sequence; MFU divides TFLOP/s per GPU by the H100's dense BF16
peak, 989.5 TFLOP/s (the catalog's h100-80gb).

    .venv/bin/python bench/llama3_405b.py                 # both
    .venv/bin/python bench/llama3_405b.py --gpus 8192
"""
import argparse
import json
import resource
import time
from pathlib import Path

from fresh_process import print_measured_table

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = {8192: ROOT / "scenarios" / "llama3-405b-8k.yaml", 16384: ROOT / "scenarios" / "llama3-405b-16k.yaml"}
PAPER = {8192: (430, 0.43), 16384: (400, 0.41)}  # Table 4: TFLOP/s per GPU, BF16 MFU


def model_flops(scenario) -> float:
    """PaLM's model FLOPs of one step: (6 N + 12 L h s) per token, N without the input embedding."""
    from simtrain.train.llama import parameter_count

    model, data, layout = scenario.model, scenario.data, scenario.parallel
    parameters = parameter_count(data.vocab, model.width, model.layers, model.heads, model.key_value_heads,
                                 model.ffn_width) - data.vocab * model.width
    replicas = scenario.cluster.devices // (layout.pp * layout.tp)
    tokens = data.batch_size * replicas * data.seq_len
    return tokens * (6 * parameters + 12 * model.layers * model.width * data.seq_len)


def one(gpus: int) -> dict:
    """Simulate one scenario in this process: step time, TFLOP/s per GPU, MFU, wall and CPU seconds, peak RSS."""
    import simtrain
    from simtrain.hw.catalog import CATALOG
    from simtrain.scenario import load_scenario

    started, cpu_started = time.perf_counter(), time.process_time()
    scenario = load_scenario(SCENARIOS[gpus])
    report = simtrain.run(scenario)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    row = {"status": report.data["status"], "wall_s": wall, "cpu_s": cpu,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if row["status"] == "ok":
        ends = [end for end, _ in report.data["loss_curve"]]
        row["step_time_s"] = ends[-1] - ends[-2] if len(ends) > 1 else ends[-1]
        row["tflops"] = model_flops(scenario) / row["step_time_s"] / gpus / 1e12
        row["mfu"] = row["tflops"] / (CATALOG["h100-80gb"].peak_flops["bf16"] / 1e12)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="*", choices=sorted(SCENARIOS), default=sorted(SCENARIOS))
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    print_measured_table(__file__, args.gpus,
                         ["GPUs", "dp", "step (s)", "simtrain TFLOP/s per GPU", "MFU", "paper TFLOP/s per GPU",
                          "paper MFU", "simulated in (wall)", "CPU time", "peak RSS"], _cells)


def _cells(gpus: int, row: dict) -> list[str]:
    """A row of the table: the run's figures beside Table 4's."""
    paper_tflops, paper_mfu = PAPER[gpus]
    figures = ([f"{row['step_time_s']:.2f}", f"{row['tflops']:.0f}", f"{100 * row['mfu']:.0f}%"]
               if row["status"] == "ok" else [row["status"], "", ""])
    return [f"{gpus:,}", str(gpus // 128), *figures, str(paper_tflops), f"{100 * paper_mfu:.0f}%",
            f"{row['wall_s']:.1f} s", f"{row['cpu_s']:.1f} s", f"{row['peak_rss_bytes'] / 2**30:.1f} GiB"]

if __name__ == "__main__":
    main()
