"""Float8 training of Linear layers: torchao's tensorwise recipe with dynamic scaling, simulated on any device.

torchao's float8 training (`torchao.float8.convert_to_float8_training`, its
default recipe `Float8LinearRecipeName.TENSORWISE`) swaps every nn.Linear for
a Float8Linear whose three matrix multiplies take float8 inputs:

    output      = x @ wᵀ            x: e4m3, w: e4m3
    grad_input  = grad_output @ w   grad_output: e5m2, w: e4m3
    grad_weight = grad_outputᵀ @ x  grad_output: e5m2, x: e4m3

Forward operands are cast to e4m3 (3 mantissa bits, largest 448), the
output's gradient to e5m2 (2 mantissa bits, largest 57344: range over
precision). Each cast has one scale for the whole tensor from its current
amax (dynamic scaling): scale = fp8_max / max(amax, 1e-12), computed in
float64 and kept in float32; the tensor, in float32, times its scale, is
clamped to ±fp8_max (saturated) and rounded to the float8 dtype. The GEMM
(torch._scaled_mm on a GPU) multiplies the float8 operands with float32
accumulation and divides by both scales, writing the result in the layer's
own dtype (bf16). Everything else in the model (norms, softmax, attention's
batched matmuls, the residual stream, the optimizer's fp32 master weights)
stays as bf16 mixed precision has it.

Here the casts are real (torch's float8_e4m3fn and float8_e5m2 round to
nearest even, as the hardware does), and the GEMM runs on their values upcast
to float32 (every product of two float8 numbers is exact in float32), scaled,
then rounded to bf16: only the order of the float32 accumulation differs from
a GPU's. Each cast and each GEMM is one torch operator (train/fp8_kernels.py:
`simtrain::float8_cast`, `simtrain::scaled_mm`), so a device is charged the
kernels a GPU runs: per Linear, forward, two casts (x, w) and one GEMM;
backward, three casts (the output's gradient to e5m2, x and w again) and two
GEMMs; each cast reading its bf16 operand and writing float8 bytes, each GEMM
reading float8 operands and writing bf16, its FLOPs at the fp8 rate
(op_cost.py). As torchao does, the forward saves its high-precision input and
the backward casts again (the same amax gives the same cast), and it casts
the weight in every micro-batch's forward (Transformer Engine can keep the
first micro-batch's weight cast for the others of a step, its FP8 weight
caching, `is_first_microbatch`: not modelled). Bias, if any, is added in bf16 after the
GEMM; a Linear whose bias its model adds itself (gpt's output projection and
second MLP Linear, a tensor-parallel row-split Linear: once, after the sum)
runs its weight through `weight_only`, in float8 as well. The swap keeps
every parameter as it is (the module's class changes, not its tensors), so
names, shapes and tensor-parallel slices are those of the model.

    convert_to_float8_(model)          # every nn.Linear's forward in float8 (model in bf16)
    restore_linears_(model)            # back to plain nn.Linear (the trained model, as saved)
    q, scale = to_float8(x, torch.float8_e4m3fn)
    y = weight_only(model.contract, h)  # a Linear's weight alone, in float8 if it was converted
"""
import torch
import torch.nn.functional as F
from torch import nn

from .fp8_kernels import float8_cast, scaled_mm

FORWARD_DTYPE = torch.float8_e4m3fn  # activations and weights
GRADIENT_DTYPE = torch.float8_e5m2  # the output's gradient


def to_float8(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor` cast to float8 `dtype` with one scale from its amax: (float8 values, float32 scale), the
    values being round(clamp(tensor · scale, ±max)) in `dtype` (one simtrain::float8_cast kernel)."""
    return float8_cast(tensor.detach(), dtype)


def scaled_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """(a @ b) of float8 operands, accumulated in float32, divided by both scales, in `out_dtype` (what
    torch._scaled_mm computes; one simtrain::scaled_mm kernel)."""
    return scaled_mm(a, a_scale, b, b_scale, out_dtype)


class Float8Matmul(torch.autograd.Function):
    """x (…, in) @ weightᵀ (in, out) with float8 GEMMs forward and backward (the three casts above)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        x8, x_scale = to_float8(x2, FORWARD_DTYPE)
        w8, w_scale = to_float8(weight, FORWARD_DTYPE)
        out = scaled_matmul(x8, x_scale, w8.t(), w_scale, x.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        x2, g2 = x.reshape(-1, x.shape[-1]), grad_output.reshape(-1, grad_output.shape[-1])
        g8, g_scale = to_float8(g2, GRADIENT_DTYPE)
        x8, x_scale = to_float8(x2, FORWARD_DTYPE)
        w8, w_scale = to_float8(weight, FORWARD_DTYPE)
        grad_input = scaled_matmul(g8, g_scale, w8, w_scale, x.dtype).reshape(x.shape)
        grad_weight = scaled_matmul(g8.t(), g_scale, x8, x_scale, weight.dtype)
        return grad_input, grad_weight


class Float8Linear(nn.Linear):
    """An nn.Linear whose matrix multiplies run in float8 (Float8Matmul); its bias is added after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = Float8Matmul.apply(x, self.weight)
        return out if self.bias is None else out + self.bias


def weight_only(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x through `linear`'s weight alone, its bias left to the caller (a row-parallel Linear adds it once, after
    the tensor-parallel sum): in float8 if `linear` is a Float8Linear, as its forward computes it."""
    if type(linear) is Float8Linear:
        return Float8Matmul.apply(x, linear.weight)
    return F.linear(x, linear.weight)


def convert_to_float8_(model: nn.Module) -> None:
    """Every nn.Linear of `model` computes in float8 from now on (in place; its parameters untouched)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Float8Linear


def restore_linears_(model: nn.Module) -> None:
    """Every Float8Linear of `model` is a plain nn.Linear again (in place)."""
    for module in model.modules():
        if type(module) is Float8Linear:
            module.__class__ = nn.Linear

