"""The kernel compute model: what each GPU kernel of a pass takes, by what it runs and its shape.

A pass's operators come recorded as op_cost.py's OpCosts, each group with
its kernel. Under `cluster.compute_model: kernels` a device charges each
kernel the slower of its arithmetic and its HBM traffic (the roofline,
op_cost.py), its arithmetic at the rate its kind of kernel reaches:

- a **GEMM** ("gemm", rows, columns, batch): its FLOPs at peak x efficiency
  x `filled`, the share of the launched tiles' work its result fills. cuBLAS
  and CUTLASS cut a GEMM's result into tiles, one thread block each, and run
  the blocks in waves of one per streaming multiprocessor (NVIDIA, "Matrix
  Multiplication Background User's Guide", DU-09799-001, 2023, sections 2.1
  and 3): a result whose side is not a multiple of the tile's still computes
  its whole edge tiles (tile quantization), and a last wave with fewer tiles
  than SMs takes a whole wave's time (wave quantization). A wave of tiles
  of r x c outputs takes r x c x K x 2 FLOPs at one SM's share of the rate,
  so the GEMM takes its FLOPs / (rate x filled), with

      filled = rows x columns x batch / (waves x SMs x r x c),
      waves  = ceil(ceil(rows / r) x ceil(columns / c) x batch / SMs),

  for `TILE`, the largest tile the guide lists for cuBLAS (section 2.3: 256
  x 128 and 128 x 256, the most efficient, their data reused the most), in
  the orientation that fills more, as cuBLAS's heuristics choose;
- a fused **attention** kernel ("attention",): its FLOPs at peak x the
  fraction of peak its generation's kernel is published to reach
  (`DeviceSpec.attention_efficiency`, each with its source), or at peak x
  efficiency on a device without one;
- every other kernel: its FLOPs at peak x efficiency (the roofline's).

A device's `efficiency` is then the fraction of the datasheet's rates that
a GEMM filling its waves, and a streaming kernel, reach: the one figure
fitted for a GPU generation. On a device without an SM count a GEMM fills
its waves.

Not modelled: split-K (cuBLAS splits a GEMM of few tiles and a long K
along K to fill the SMs, which `filled` then understates), the smaller
tiles cuBLAS picks for small GEMMs, the quantization of K, and attention's
own shape (sequence, head size, the mask): its published fraction is the
forward's best, charged to the backward too.

    filled(4096, 4096, 1, 132)             # 16 x 32 = 512 tiles, four waves of 132: 0.97
    filled(4096, 4224, 1, 132)             # 16 x 33 = 528 = 4 x 132 tiles of 256 x 128: 1.0
    kernel_seconds(ops, rates, bytes_rate, sms=132, attention_scale=1.2)
"""
from __future__ import annotations

import math

# The tile of a GEMM's result one thread block computes: the guide's largest for cuBLAS, in either orientation
TILE = (256, 128)


def filled(rows: int, columns: int, batch: int, sms: int | None) -> float:
    """The share of its tiles' waves a GEMM's rows x columns result (batch of them) fills on `sms` SMs, in the
    tile orientation that fills more (1 where the SM count is unknown)."""
    if sms is None:
        return 1.0
    best = 0.0
    for tile_rows, tile_columns in (TILE, TILE[::-1]):
        tiles = math.ceil(rows / tile_rows) * math.ceil(columns / tile_columns) * batch
        waves = math.ceil(tiles / sms)
        best = max(best, rows * columns * batch / (waves * sms * tile_rows * tile_columns))
    return best


def kernel_seconds(ops, flops_rates: dict[str, float], bytes_rate: float, sms: int | None,
                   attention_scale: float) -> float:
    """Seconds operators `ops` (op_cost.py's OpCosts) take: each group the slower of its FLOPs, at its rate
    dtype's `flops_rates` FLOP/s (peak x efficiency) x its kernel's share (a GEMM's `filled`, an attention
    kernel's `attention_scale`: its published fraction of peak over the efficiency), and its bytes at
    `bytes_rate` B/s."""
    seconds = 0.0
    for flops, nbytes, count, rate, kernel in ops:
        flops_rate = flops_rates[rate]
        if kernel and kernel[0] == "gemm":
            flops_rate *= filled(*kernel[1:], sms)
        elif kernel:
            flops_rate *= attention_scale
        seconds += count * max(flops / flops_rate, nbytes / bytes_rate)
    return seconds
