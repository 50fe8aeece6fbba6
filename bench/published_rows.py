"""A published table of TFLOP/s per GPU beside simtrain's: each row a scenario, simulated with numerics off.

bench/megatron_lm_table1.py (Narayanan et al. 2021, Table 1, A100s) and bench/megatron_core_h100.py (Megatron-Core's H100
weak-scaling table) each give their table: the scenarios' folder, the published TFLOP/s per GPU by scenario name,
and the paper's count of a step's model FLOPs. A row's TFLOP/s is those FLOPs over the simulated step time and the
GPU count (a scenario of several steps: its last step's time, the steady state, where the collectives a step
leaves to the next one (Megatron-Core's overlapped all-gather) are part of it); `calibrate` solves for the device efficiency at which one row matches its published figure (secant on
the simulated TFLOP/s, which rises with the efficiency).

    table = Table(ROOT / "scenarios" / "megatron", {"gpt-1.7b": 137, ...}, model_flops)
    tflops, wall_s = table.simulate("gpt-1.7b")
    tflops, wall_s = table.simulate("gpt-1.7b", efficiency=0.7, compute_model="kernels")
    efficiency = table.calibrate("gpt-1008b")
    table.main(__doc__, "paper", ("model", "GPUs"), lambda name, scenario: (name, f"{scenario.cluster.devices:,}"))
"""
import argparse
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import simtrain
from simtrain.scenario import load_scenario


class Table(NamedTuple):
    folder: Path
    published: dict[str, float]  # TFLOP/s per GPU, by scenario name
    model_flops: Callable  # scenario -> the paper's FLOPs of one step

    def scenario(self, name: str, efficiency: float | None = None, compute_model: str | None = None):
        """Row `name`'s scenario, at its own device efficiency and compute model or the ones given."""
        scenario = load_scenario(self.folder / f"{name}.yaml")
        cluster = {}
        if efficiency is not None:
            cluster["device"] = scenario.cluster.device.model_copy(update={"efficiency": efficiency})
        if compute_model is not None:
            cluster["compute_model"] = compute_model
        return scenario.model_copy(update={"cluster": scenario.cluster.model_copy(update=cluster)})

    def simulate(self, name: str, efficiency: float | None = None,
                 compute_model: str | None = None) -> tuple[float, float]:
        """(TFLOP/s per GPU, wall seconds of the simulation) of row `name`."""
        scenario = self.scenario(name, efficiency, compute_model)
        started = time.perf_counter()
        report = simtrain.run(scenario)
        wall = time.perf_counter() - started
        ends = [end for end, _ in report.data["loss_curve"]]
        step_s = ends[-1] - ends[-2] if len(ends) > 1 else ends[-1]
        return self.model_flops(scenario) / step_s / scenario.cluster.devices / 1e12, wall

    def calibrate(self, name: str, compute_model: str | None = None, low: float = 0.5, high: float = 0.7) -> float:
        """The efficiency at which row `name` reaches its published TFLOP/s, to 0.01%."""
        target = self.published[name]
        f_low = self.simulate(name, low, compute_model)[0] - target
        f_high = self.simulate(name, high, compute_model)[0] - target
        for _ in range(10):
            guess = high - f_high * (high - low) / (f_high - f_low)
            f_guess = self.simulate(name, guess, compute_model)[0] - target
            print(f"efficiency {guess:.6f}: {f_guess + target:.2f} TFLOP/s", file=sys.stderr)
            if abs(f_guess) < 1e-4 * target:
                return guess
            low, f_low, high, f_high = high, f_high, guess, f_guess
        return guess

    def main(self, doc: str, source: str, columns: tuple[str, ...], cells: Callable) -> None:
        """A bench's command line: every row (or `--rows`) as a markdown line, `cells(name, scenario)` giving its
        first `columns`, then the TFLOP/s per GPU that `source` (the paper, the README) published, simtrain's, the
        error and the simulation's wall time; or `--calibrate ROW`'s efficiency."""
        parser = argparse.ArgumentParser(description=doc.splitlines()[0])
        parser.add_argument("--rows", nargs="*", default=list(self.published))
        parser.add_argument("--calibrate", metavar="ROW")
        parser.add_argument("--compute-model", choices=["flops", "roofline", "kernels"],
                            help="every row under this compute model (default: each scenario's own)")
        parser.add_argument("--efficiency", type=float, help="every row at this device efficiency (default: its own)")
        args = parser.parse_args()
        if args.calibrate:
            print(f"{args.calibrate}: efficiency {self.calibrate(args.calibrate, args.compute_model):.4f}")
            return
        header = (*columns, f"{source} TFLOP/s per GPU", "simtrain", "error", "simulated in")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for name in args.rows:
            tflops, wall = self.simulate(name, args.efficiency, args.compute_model)
            published = self.published[name]
            row = (*cells(name, self.scenario(name)), f"{published}", f"{tflops:.1f}",
                   f"{100 * (tflops - published) / published:+.1f}%", f"{wall:.1f} s")
            print("| " + " | ".join(row) + " |", flush=True)
