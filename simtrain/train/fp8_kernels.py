"""The two kernels of float8 training, as a GPU runs them: a tensorwise cast and a scaled GEMM, one operator each.

train/fp8.py's Float8Linear computes with two torch custom operators, so
that the operator recorder (op_cost.py) sees the kernels a Hopper GPU runs
for an fp8 Linear, each with its real inputs and outputs, and not the host
arithmetic that emulates them (the float32 upcasts, the reductions, the
float32 GEMM):

- `simtrain::float8_cast(x, dtype) -> (values, scale)`: the amax of x, the
  scale fp8_max / amax and the cast of x times the scale to float8, one
  kernel. It reads x (2 bytes an element in bf16) and writes the float8
  values (1 byte an element) and the float32 scale (4 bytes), as Transformer
  Engine's cast kernel does in one pass, recording the amax as it casts
  (`cast_to_fp8`; "Using FP8 with Transformer Engine": its delayed scaling
  takes the scale from the amaxes of earlier steps). No FLOPs. The dynamic
  scaling computed here (torchao's tensorwise recipe,
  `torchao/float8/float8_scaling_utils.py` `hp_tensor_to_float8_dynamic`)
  takes the amax over x before the cast, which on a GPU reads x once more:
  2 bytes an element, not charged.
- `simtrain::scaled_mm(a, a_scale, b, b_scale, out_dtype) -> out`: a @ b of
  float8 operands, accumulated in float32 and divided by both scales,
  written in `out_dtype` (bf16): `torch._scaled_mm`, one cuBLASLt GEMM. It
  reads both operands (1 byte an element) and both scales and writes the
  output; 2·m·k·n FLOPs (torch's formula for `_scaled_mm`,
  torch.utils.flop_counter), run at the device's fp8 rate: its operands are
  float8 (op_cost.py's rate dtype).

Each has a fake kernel, so that with numerics off (meta tensors) they give
the shapes and dtypes alone, and the recorder the same bytes and FLOPs. The
host implementations are the emulation of train/fp8.py bit for bit.

    values, scale = torch.ops.simtrain.float8_cast(x, torch.float8_e4m3fn)
    out = torch.ops.simtrain.scaled_mm(x8, x_scale, w8.t(), w_scale, torch.bfloat16)
"""
import torch
from torch.utils.flop_counter import register_flop_formula

_EPS = 1e-12  # torchao's floor on the amax, so that a zero tensor gets a finite scale


@torch.library.custom_op("simtrain::float8_cast", mutates_args=())
def float8_cast(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor` cast to float8 `dtype` with one scale from its amax: (round(clamp(tensor · scale, ±max)) in `dtype`,
    the float32 scale max / max(amax, 1e-12), computed in float64)."""
    fp8_max = torch.finfo(dtype).max
    # an empty tensor (an expert no token was routed to) has amax 0, as Transformer Engine's amax kernel leaves it
    amax = (tensor.abs().amax() if tensor.numel() else tensor.new_zeros(())).to(torch.float64)
    scale = (fp8_max / amax.clamp(min=_EPS)).to(torch.float32)
    scaled = tensor.to(torch.float32) * scale
    return scaled.clamp(-fp8_max, fp8_max).to(dtype), scale


@float8_cast.register_fake
def _(tensor, dtype):
    return torch.empty_like(tensor, dtype=dtype), tensor.new_empty((), dtype=torch.float32)


@torch.library.custom_op("simtrain::scaled_mm", mutates_args=())
def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a @ b) of float8 (m, k) and (k, n) operands, accumulated in float32, divided by both scales, in
    `out_dtype`: on the host, the float8 values upcast to float32 (every product of two is exact there)."""
    product = a.to(torch.float32) @ b.to(torch.float32)
    return (product * (a_scale * b_scale).reciprocal()).to(out_dtype)


@scaled_mm.register_fake
def _(a, a_scale, b, b_scale, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@register_flop_formula(torch.ops.simtrain.scaled_mm)
def _scaled_mm_flops(a_shape, a_scale_shape, b_shape, b_scale_shape, out_dtype, *args, **kwargs) -> int:
    """2·m·k·n: one multiply and one add per product, as torch counts `_scaled_mm` and `mm`."""
    (m, k), (_, n) = a_shape, b_shape
    return 2 * m * k * n
