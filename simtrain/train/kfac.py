"""K-FAC: Kronecker-factored curvature preconditioning of Linear and Conv2d layers.

K-FAC (Martens & Grosse 2015) approximates the Fisher block of a layer with
weight matrix W (bias folded in as an extra input column of ones) by a
Kronecker product A (x) G of two small matrices, so the natural-gradient step
G^-1 dW A^-1 costs two small inversions instead of one huge one.

- Linear: a is the layer's input (B, in[+1]), g the gradient of the loss with
  respect to its output (B, out). With the loss a batch mean, g = dL_i/ds_i / B,
  so B*g is each sample's own gradient, and
  A = a^T a / B,  G = (B g)^T (B g) / B = B g^T g.
- Conv2d, KFC (Grosse & Martens 2016, eqs. for Omega and Gamma): a is the
  unfolded input patch at each of the T output positions (B*T, C*kh*kw[+1]),
  g the output gradient at each position (B*T, out); A = Omega = sum over
  positions, mean over samples, of a a^T; G = Gamma = (1/T) E[sum_t (B g)(B g)^T],
  i.e. A = a^T a / B and G = (B/T) g^T g. For T = 1 this is the Linear case.
- The gradients are those of the real backward pass (the empirical Fisher, as
  kfac-pytorch uses), captured by hooks: a forward hook keeps the layer's input
  and puts a tensor hook on its output. Hooks fire only for the module they
  were registered on (so a deep copy of the model, as the cost measurement
  makes, never writes into this object), in training mode, with autograd on,
  and on steps where `factor_update_steps` divides the step count.
- Running averages: F <- factor_decay * F + (1 - factor_decay) * F_batch; the
  first update takes F_batch as it is.
- Every `inv_update_steps` steps each factor is decomposed:
  - `method: inverse`: factored Tikhonov damping with the damping split evenly
    between the factors (Martens & Grosse 2015 sec. 6.3 with pi = 1):
    update = (G + sqrt(lambda) I)^-1 dW (A + sqrt(lambda) I)^-1, inverses by
    Cholesky (potrf n^3/3 + potri 2n^3/3 FLOPs = n^3, LAPACK Working Note 41).
  - `method: eigen`: A = Q_A diag(d_A) Q_A^T, G = Q_G diag(d_G) Q_G^T, and
    update = Q_G [(Q_G^T dW Q_A) / (d_G d_A^T + lambda)] Q_A^T, which is
    exactly (A (x) G + lambda I)^-1 vec(dW) (George et al. 2018 EKFAC basis;
    kfac-pytorch's eigen method). Charged at 9 n^3 FLOPs per n x n factor:
    symmetric QR with eigenvectors accumulated, Golub & Van Loan, Matrix
    Computations 4th ed., sec. 8.3 (4n^3/3 for the tridiagonal reduction
    plus about 6n^3 to accumulate the rotations, about 9n^3 in all). GPU
    eigensolvers run well below matmul peak, so this is optimistic.
  The two methods agree as lambda -> 0 (both are G^-1 dW A^-1).
- KL clipping (Ba et al. 2017, as kfac-pytorch): the preconditioned updates v
  are scaled by nu = min(1, sqrt(kl_clip / (lr^2 * sum(v * grad)))).
- Then the base optimizer (SGD with momentum and weight decay, built by the
  replica) steps with the preconditioned gradients in p.grad. Parameters of
  other layers (BatchNorm, ...) keep their plain gradient.

The batch factors of all layers live in one flat `factor_buffer` (A then G for
each layer), so a data-parallel scheme can average them across devices with one
all-reduce; factor j of `factors` is decomposed by `decompose(j)` and its result
tensors (`decomposition(j)`) can be broadcast to the other devices.

    kfac = Kfac(model, OptimizerSpec(name="kfac", lr=0.1, damping=1e-3))
    loss.backward()                       # hooks captured a and g
    if kfac.factor_update_due(): kfac.compute_batch_factors(); kfac.update_running_factors()
    if kfac.inverse_update_due(): [kfac.decompose(j) for j in range(len(kfac.factors))]
    kfac.precondition(); base_optimizer.step()
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..scenario import OptimizerSpec

EIGEN_FLOPS_PER_N3 = 9.0  # Golub & Van Loan sec. 8.3, symmetric QR with eigenvectors
INVERSE_FLOPS_PER_N3 = 1.0  # Cholesky n^3/3 + inverse from the factor 2n^3/3


class Factor(NamedTuple):
    """One Kronecker factor: which layer, which side ("A" or "G"), its side length n."""

    layer: int
    side: str
    size: int


class _Layer:
    """A preconditioned layer: its module, captured a and g, running factors, decompositions."""

    def __init__(self, name: str, module: nn.Module):
        self.name = name
        self.module = module
        self.has_bias = module.bias is not None
        weight = module.weight
        self.g_dim = weight.shape[0]
        self.a_dim = weight[0].numel() + int(self.has_bias)
        self.a: torch.Tensor | None = None  # (rows, a_dim), captured this step
        self.g: torch.Tensor | None = None  # (rows, g_dim), captured this step
        self.positions = 1  # T: output positions per sample
        self.running: dict[str, torch.Tensor] = {}  # "A", "G"
        self.decomposed: dict[str, list[torch.Tensor]] = {}  # side -> [Q, d] (eigen) or [inverse]

    def capture_input(self, x: torch.Tensor) -> None:
        module = self.module
        if isinstance(module, nn.Conv2d):
            patches = F.unfold(x, module.kernel_size, module.dilation, module.padding, module.stride)
            self.positions = patches.shape[-1]
            a = patches.transpose(1, 2).reshape(-1, patches.shape[1])
        else:
            a = x.reshape(-1, x.shape[-1])
        if self.has_bias:
            a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
        self.a = a.detach().float()

    def capture_output_grad(self, grad: torch.Tensor) -> None:
        if isinstance(self.module, nn.Conv2d):
            grad = grad.permute(0, 2, 3, 1)
        self.g = grad.reshape(-1, grad.shape[-1]).detach().float()

    def gradient_matrix(self) -> torch.Tensor:
        """dW as (out, in[*kh*kw]) with the bias gradient as the last column."""
        weight = self.module.weight
        grad = weight.grad.reshape(weight.shape[0], -1)
        if self.has_bias:
            grad = torch.cat([grad, self.module.bias.grad.reshape(-1, 1)], dim=1)
        return grad.float()

    def write_gradient(self, matrix: torch.Tensor) -> None:
        weight = self.module.weight
        if self.has_bias:
            self.module.bias.grad.copy_(matrix[:, -1])
            matrix = matrix[:, :-1]
        weight.grad.copy_(matrix.reshape(weight.shape))


def preconditionable(module: nn.Module) -> bool:
    """Linear, and Conv2d with zero padding given as numbers and no groups."""
    if isinstance(module, nn.Linear):
        return True
    return (isinstance(module, nn.Conv2d) and module.groups == 1 and module.padding_mode == "zeros"
            and not isinstance(module.padding, str))


class Kfac:
    """K-FAC state of one replica: hooks on its layers, factors, decompositions, preconditioning."""

    def __init__(self, model: nn.Module, options: OptimizerSpec):
        self.options = options  # train.optimizer with name kfac: its K-FAC fields
        self.device = next(model.parameters()).device
        self.layers = [_Layer(name, m) for name, m in model.named_modules() if preconditionable(m)]
        self.factors = [Factor(i, side, layer.a_dim if side == "A" else layer.g_dim)
                        for i, layer in enumerate(self.layers) for side in ("A", "G")]
        self.factor_buffer = torch.zeros(sum(f.size * f.size for f in self.factors), device=self.device)
        self._batch_factor: dict[tuple[int, str], torch.Tensor] = {}
        offset = 0
        for factor in self.factors:
            n = factor.size
            self._batch_factor[(factor.layer, factor.side)] = self.factor_buffer[offset:offset + n * n].view(n, n)
            offset += n * n
        self.steps = 0  # steps preconditioned so far
        for layer in self.layers:
            layer.module.register_forward_hook(self._forward_hook(layer))

    def _forward_hook(self, layer: _Layer):
        def hook(module, inputs, output):
            if module is not layer.module or not (module.training and torch.is_grad_enabled()):
                return
            if not self.factor_update_due():
                return
            layer.capture_input(inputs[0])
            output.register_hook(layer.capture_output_grad)
        return hook

    def factor_update_due(self) -> bool:
        return self.steps % self.options.factor_update_steps == 0

    def inverse_update_due(self) -> bool:
        return self.steps % self.options.inv_update_steps == 0

    def compute_batch_factors(self) -> float:
        """A and G of the captured batch into factor_buffer; returns the FLOPs (2*rows*n^2 each)."""
        flops = 0.0
        for i, layer in enumerate(self.layers):
            a, g = layer.a, layer.g
            batch = a.shape[0] // layer.positions
            torch.matmul(a.t(), a, out=self._batch_factor[(i, "A")]).div_(batch)
            torch.matmul(g.t(), g, out=self._batch_factor[(i, "G")]).mul_(batch / layer.positions)
            flops += 2.0 * a.shape[0] * layer.a_dim ** 2 + 2.0 * g.shape[0] * layer.g_dim ** 2
            layer.a = layer.g = None
        return flops

    def batch_factor(self, layer: int, side: str) -> torch.Tensor:
        """The factor of the last captured batch (after any averaging of factor_buffer)."""
        return self._batch_factor[(layer, side)]

    def update_running_factors(self) -> None:
        """Fold factor_buffer into the running averages."""
        decay = self.options.factor_decay
        for factor in self.factors:
            layer = self.layers[factor.layer]
            batch = self._batch_factor[(factor.layer, factor.side)]
            if factor.side not in layer.running:
                layer.running[factor.side] = batch.clone()
            else:
                layer.running[factor.side].mul_(decay).add_(batch, alpha=1 - decay)

    def running_factor(self, layer: int, side: str) -> torch.Tensor:
        return self.layers[layer].running[side]

    def decompose(self, index: int) -> float:
        """Decompose factor `index` (eigen, or damped inverse); returns its FLOPs."""
        factor = self.factors[index]
        layer = self.layers[factor.layer]
        matrix = layer.running[factor.side]
        if self.options.method == "eigen":
            eigenvalues, eigenvectors = torch.linalg.eigh(matrix)
            layer.decomposed[factor.side] = [eigenvectors, eigenvalues.clamp(min=0)]
        else:
            damped = matrix + math.sqrt(self.options.damping) * torch.eye(factor.size, dtype=matrix.dtype, device=self.device)
            layer.decomposed[factor.side] = [torch.cholesky_inverse(torch.linalg.cholesky(damped))]
        return self.decompose_flops(index)

    def decompose_flops(self, index: int) -> float:
        """FLOPs of decomposing factor `index`: 9n^3 (eigen) or n^3 (inverse)."""
        per_n3 = EIGEN_FLOPS_PER_N3 if self.options.method == "eigen" else INVERSE_FLOPS_PER_N3
        return per_n3 * float(self.factors[index].size) ** 3

    def decomposition(self, index: int) -> list[torch.Tensor]:
        """The tensors decompose(index) produced, allocated (empty) if it has not run here."""
        factor = self.factors[index]
        layer = self.layers[factor.layer]
        if factor.side not in layer.decomposed:
            n = factor.size
            layer.decomposed[factor.side] = ([torch.empty(n, n, device=self.device), torch.empty(n, device=self.device)] if self.options.method == "eigen"
                                             else [torch.empty(n, n, device=self.device)])
        return layer.decomposed[factor.side]

    def decomposition_numel(self, index: int) -> int:
        n = self.factors[index].size
        return n * n + n if self.options.method == "eigen" else n * n

    def precondition_matrix(self, layer: int, grad: torch.Tensor) -> torch.Tensor:
        """The K-FAC update for gradient matrix `grad` (out, in+1) of `layer`."""
        state = self.layers[layer].decomposed
        if self.options.method == "eigen":
            (q_a, d_a), (q_g, d_g) = state["A"], state["G"]
            rotated = q_g.t() @ grad @ q_a
            rotated = rotated / (torch.outer(d_g, d_a) + self.options.damping)
            return q_g @ rotated @ q_a.t()
        (a_inv,), (g_inv,) = state["A"], state["G"]
        return g_inv @ grad @ a_inv

    def precondition(self) -> float:
        """Replace each layer's gradient by its clipped K-FAC update; returns the FLOPs."""
        updates, vg_sum, flops = [], 0.0, 0.0
        for i, layer in enumerate(self.layers):
            grad = layer.gradient_matrix()
            update = self.precondition_matrix(i, grad)
            if not update.is_meta:  # numerics off: shapes only, no clipping to compute
                vg_sum += float((update * grad).sum())
            updates.append(update)
            flops += self.precondition_flops(i)
        lr = self.options.lr
        nu = 1.0
        if self.options.kl_clip > 0 and vg_sum > 0:
            nu = min(1.0, math.sqrt(self.options.kl_clip / (vg_sum * lr * lr)))
        for layer, update in zip(self.layers, updates):
            layer.write_gradient(update.mul_(nu))
        self.steps += 1
        return flops

    def precondition_flops(self, layer: int) -> float:
        """Matmul FLOPs of one layer's update: two (eigen: four) n x n by n x m products."""
        out_dim, in_dim = self.layers[layer].g_dim, self.layers[layer].a_dim
        products = 2.0 * out_dim * out_dim * in_dim + 2.0 * out_dim * in_dim * in_dim
        return 2 * products if self.options.method == "eigen" else products

    def memory_bytes(self) -> int:
        """Bytes of batch factors, running factors and decompositions (fp32)."""
        factor_numel = sum(f.size * f.size for f in self.factors)
        decomposed_numel = sum(self.decomposition_numel(j) for j in range(len(self.factors)))
        return 4 * (2 * factor_numel + decomposed_numel)
