"""Gradient checkpointing of a sequential model with torch.utils.checkpoint.

`apply_checkpointing(model, "sqrt" | "full" | CheckpointSegments(segments=k) | "none")` (the
scenario's `train.checkpointing`: none | sqrt | full | selective | {segments: k}) returns a
`CheckpointedSequential` holding the same layers (same parameters, same
state_dict keys) whose forward, when gradients are on, cuts the model into
segments and runs every segment but the last under
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`: only a segment's
input is kept through the forward pass, and the segment's forward runs again
during backward, just before its gradients are needed (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost"). The last segment is not
checkpointed, as in `torch.utils.checkpoint.checkpoint_sequential`: its
activations are needed as soon as backward starts.

Blocks. Segments never split a block. A block starts at each layer with a
weight matrix or kernel (a parameter of two or more dimensions: Linear,
Conv2d, Embedding) and takes the layers after it up to the next such layer
(BatchNorm, ReLU, MaxPool2d, Flatten...); layers before the first one join the
first block. The built-in MLP with 16 hidden layers has 17 blocks
(Linear+ReLU, or Linear+BatchNorm+ReLU, x 16, and the head). `sqrt` uses
round(sqrt(n)) segments for n blocks; `{segments: k}` uses k (at most n);
`full` makes every block its own segment (Megatron-LM's full activation
recomputation, layer by layer; under pipeline and tensor parallelism a stage
recomputes its chunks unit by unit, schemes/layer_recompute.py). Under tensor
or context parallelism, or with MoE layers, a chunk runs region by region
between its collectives, out of reach of torch's checkpoint: there
schemes/layer_recompute.py recomputes sqrt's and {segments: k}'s segments
too, the same segments of the chunk's units, the last one kept
(train/architecture.py recompute_segments).

Selective activation recomputation (Korthikanti et al. 2022), `selective`,
cuts no segments: the model is returned as it is, each attention layer marked
to recompute only its attention core (QKᵀ, scale, causal mask, softmax,
attention over V) in backward (train/gpt.py `RecomputedAttention`, which
train/llama.py's blocks use too). A model
without attention (mlp, cnn) is refused.
Blocks are dealt out as evenly as possible, earlier segments taking the
extra block.

BatchNorm and other layers that update buffers in forward: recomputation runs
the segment's forward a second time, which would update BatchNorm's running
mean and variance (and num_batches_tracked) twice per step. Every buffer of a
checkpointed segment is snapshotted before its recomputation and copied back
after it, so running statistics see each batch exactly once, as without
checkpointing. (The recomputed batch statistics themselves are the same as in
the first forward, so the gradients are unchanged.)

Measurement. torch's checkpoint keeps recomputed tensors in its own storage,
out of sight of the saved-tensor hooks that `simtrain.cost` uses to measure
activation memory (only the innermost saved_tensors_hooks run). So that the
measurement sees them with their real lifetime, the recomputation passes each
tensor it keeps through the hooks that were active around the checkpointed
forward (if any) as well, and keeps what those hooks packed alive exactly as
long as torch keeps the recomputed tensor.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ScenarioError
from .architecture import checkpoint_blocks, checkpoint_segments, deal_blocks
from ..scenario import CheckpointSegments

_FIELD = "train.checkpointing"


def apply_checkpointing(model: nn.Module, spec: str | CheckpointSegments) -> nn.Module:
    """`model` itself for "none", and for "selective" with its attention cores marked for recomputation;
    otherwise a CheckpointedSequential over its layers."""
    if spec == "none":
        return model
    if spec == "selective":
        require_attention(model)
        recompute_attention_cores_(model)
        return model
    if not isinstance(model, nn.Sequential):
        raise ScenarioError(f"{_FIELD}: needs a model that is an nn.Sequential, got {type(model).__name__}")
    blocks = split_blocks(list(model))
    return CheckpointedSequential(model, deal_blocks(blocks, checkpoint_segments(spec, len(blocks))))


def require_attention(model: nn.Module) -> None:
    """Selective recomputation needs an attention layer (a module with `recompute_core`: train/gpt.py Block,
    train/llama.py LlamaBlock)."""
    if not any(hasattr(module, "recompute_core") for module in model.modules()):
        raise ScenarioError(f"{_FIELD}: selective recomputes the attention core of gpt and llama blocks; "
                            "this model has none (use full, sqrt or segments)")


def recompute_attention_cores_(model: nn.Module) -> None:
    """Mark every attention layer of `model` to recompute its attention core in backward."""
    for module in model.modules():
        if hasattr(module, "recompute_core"):
            module.recompute_core = True


def split_blocks(layers: list[nn.Module]) -> list[list[int]]:
    """Layer indices grouped into blocks, each starting at a layer with a weight matrix or kernel."""
    return checkpoint_blocks([any(p.dim() >= 2 for p in layer.parameters()) for layer in layers])


class CheckpointedSequential(nn.Sequential):
    """nn.Sequential whose segments but the last are recomputed during backward."""

    def __init__(self, model: nn.Sequential, segments: list[tuple[int, int]]):
        super().__init__(*model)
        self.segments = segments

    def extra_repr(self) -> str:
        return f"checkpointed segments={self.segments}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return super().forward(x)
        for number, (start, end) in enumerate(self.segments):
            layers = list(self)[start:end]
            if number == len(self.segments) - 1:
                for layer in layers:
                    x = layer(x)
            else:
                outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
                x = checkpoint(_run_layers, layers, x, use_reentrant=False,
                               context_fn=lambda layers=layers, outer=outer: (
                                   contextlib.nullcontext(), _Recomputation(layers, outer)))
        return x


def _run_layers(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


class _Recomputation:
    """Context around one segment's recomputation: restores its buffers, shows its saves to the outer hooks."""

    def __init__(self, layers: list[nn.Module], outer_hooks):
        self.layers = layers
        self.outer_hooks = outer_hooks
        self.snapshot: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pushed = False

    def __enter__(self):
        self.snapshot = [(buffer, buffer.clone()) for layer in self.layers for buffer in layer.buffers()]
        inner = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if self.outer_hooks is not None and inner is not None:
            outer_pack, _ = self.outer_hooks
            inner_pack, inner_unpack = inner

            def pack(tensor):
                # torch keeps (a detached alias of) `tensor` until backward unpacks it; hand it our
                # own alias, which carries what the outer hook packed, so both live exactly as long.
                # The outer hook gets a second alias: packing `tensor` itself would tie the
                # recomputation's graph to the alias, a cycle that would keep it all alive.
                alias = tensor.detach()
                alias._outer_saved = outer_pack(tensor.detach())
                return inner_pack(alias)

            torch._C._autograd._push_saved_tensors_default_hooks(pack, inner_unpack)
            self.pushed = True
        return self

    def __exit__(self, *exc):
        if self.pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.pushed = False
        with torch.no_grad():
            for buffer, saved in self.snapshot:
                buffer.copy_(saved)
        self.snapshot = []
        return False
