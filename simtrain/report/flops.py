"""report.json's `flops`: model TFLOP/s per device and MFU, beside the FLOPs the devices ran.

- `tflops_per_device`: the model FLOPs of the steps run (train/model_flops.py:
  recomputation left out) over the simulated (or measured) time and the job's
  devices, in TFLOP/s, as Megatron-LM reports "TFLOP/s per GPU".
- `mfu`, model FLOPs utilization (PaLM, Chowdhery et al. 2022, appendix B):
  model FLOPs / (time x the devices' peak FLOP/s), the peak at the run's
  precision (`train.precision`) from each device's catalog entry, before its
  `efficiency`.
- `device_tflops_per_device`: the FLOPs the devices' compute spans carried
  (the event log), recomputed forwards included, over the same time and
  devices; over the peak, `device_flops_utilization` (PaLM's "hardware FLOPs
  utilization").
- `recomputation`: what the devices recomputed (train.checkpointing), so a
  reader knows whether the device FLOPs hold recomputed forwards.

    section = flops_section(model_flops_per_step=4.2e15, steps=1, sim_time_s=3.0, peaks=[312e12] * 8,
                            device_flops=[5.6e14] * 8, formula="PaLM: 6N + 12LHQT per token",
                            recomputation="selective")
"""
from pydantic import Field

from .sections import ReportSection


class FlopsSection(ReportSection):
    model_flops_per_step: float | None = Field(
        description="FLOPs of one forward and one backward of the model on a step's samples, every replica's "
                    "together, recomputation left out (train/model_flops.py)")
    model_flops_formula: str | None = Field(
        description="where model_flops_per_step comes from: PaLM's 6N + 12LHQT per token (gpt), or measured")
    tflops_per_device: float | None = Field(
        description="model FLOPs per second per device, in TFLOP/s (Megatron-LM's 'TFLOP/s per GPU', "
                    "recomputation left out)")
    mfu: float | None = Field(description="model FLOPs utilization: model FLOPs / (time x the devices' peak)")
    peak_tflops_per_device: float | None = Field(
        description="the devices' mean peak at the run's precision, TFLOP/s, before their efficiency")
    device_tflops_per_device: float | None = Field(
        description="FLOPs the devices ran (compute spans, recomputation included) per second per device, "
                    "TFLOP/s")
    device_flops_utilization: float | None = Field(
        description="FLOPs the devices ran over their peak (PaLM's hardware FLOPs utilization)")
    recomputation: str = Field(
        description="what the devices recomputed in backward, which their FLOPs include (train.checkpointing): none, "
                    "sqrt, full, selective or 'k segments'")


def flops_section(model_flops_per_step: float | None, steps: int, sim_time_s: float, peaks: list[float],
                  device_flops: list[float], formula: str | None, recomputation: str) -> dict:
    """The section for a job of len(peaks) devices of those peak FLOP/s that ran `device_flops` each, recomputing
    `recomputation` (train.checkpointing in words)."""
    devices = len(peaks)
    timed = sim_time_s > 0 and devices > 0
    model = model_flops_per_step * steps if model_flops_per_step is not None else None
    executed = sum(device_flops)
    return {
        "model_flops_per_step": model_flops_per_step,
        "model_flops_formula": formula,
        "tflops_per_device": model / sim_time_s / devices / 1e12 if timed and model is not None else None,
        "mfu": model / (sim_time_s * sum(peaks)) if timed and model is not None else None,
        "peak_tflops_per_device": sum(peaks) / devices / 1e12 if devices else None,
        "device_tflops_per_device": executed / sim_time_s / devices / 1e12 if timed else None,
        "device_flops_utilization": executed / (sim_time_s * sum(peaks)) if timed else None,
        "recomputation": recomputation,
    }
