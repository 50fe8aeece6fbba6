"""A training's state as one flat buffer of bytes: what moves when one job takes over another's training.

The state is every tensor training goes on from: the model's parameters and
buffers (in the compute dtype), the fp32 master weights under mixed precision,
the optimizer's per-parameter state (momentum buffers, Adam's moments and step
counts) and the fp16 loss scale. `capture` packs them, bit for bit, into one
uint8 tensor (and a layout naming each piece); `restore` unpacks a buffer
into another training of the same model: its tensors are overwritten, its
optimizer state becomes the donor's exactly (pieces the recipient lacked are
created, pieces the donor lacked are dropped), and its loss scaler takes the
donor's scale and growth tracker. Hyperparameters are not part of it: they
stay what the recipient's param groups say (train/hyperparameters.py).

One flat buffer is what a collective moves (population-based training's
exploit, simtrain/studies/pbt.py): its `nbytes` are the bytes on the wire.

    state = capture(model, master_params=None, optimizer=optimizer, scaler=None)
    restore(state, state.flat.clone(), other_model, None, other_optimizer, None)
"""
from dataclasses import dataclass

import torch


@dataclass
class TrainingState:
    """A packed training state: `flat` holds the pieces `layout` names, in order."""

    flat: torch.Tensor  # uint8
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]]  # (piece, dtype, shape)
    clean_steps: int | None  # the fp16 loss scaler's growth tracker (None: no scaler)

    @property
    def nbytes(self) -> int:
        return self.flat.numel()


def capture(model: torch.nn.Module, master_params: list | None, optimizer: torch.optim.Optimizer,
            scaler) -> TrainingState:
    """Pack the training's tensors into a new TrainingState (a copy: training on changes nothing in it)."""
    pieces = [(f"model.{key}", tensor) for key, tensor in model.state_dict().items()]
    pieces += [(f"master.{index}", param) for index, param in enumerate(master_params or ())]
    for index, param in enumerate(_optimizer_params(optimizer)):
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            pieces.append((f"optimizer.{index}.{key}", value))
    if scaler is not None:
        pieces.append(("scaler.scale", scaler.scale))
    return TrainingState(packed(pieces), [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in pieces],
                         None if scaler is None else scaler.clean_steps)


def packed(pieces: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The pieces' bytes in order, one flat uint8 tensor on the first piece's device. With numerics off the
    training's tensors are meta, and a piece torch keeps on the host (an optimizer's step count) is packed as
    meta bytes of its size: a state's bytes are what is timed, its values are not."""
    device = pieces[0][1].device
    return torch.cat([tensor.detach().to(device).reshape(-1).view(torch.uint8) for _, tensor in pieces])


def unpacked(value: torch.Tensor, current: torch.Tensor | None) -> torch.Tensor:
    """A restored optimizer-state or loss-scale value, or `current` where the value is meta bytes of a tensor kept
    on the host (numerics off: the count or scale goes on; no figure reads it)."""
    return current if value.is_meta and current is not None and not current.is_meta else value


@torch.no_grad()
def restore(state: TrainingState, flat: torch.Tensor, model: torch.nn.Module, master_params: list | None,
            optimizer: torch.optim.Optimizer, scaler) -> None:
    """Make the training (model, master weights, optimizer, scaler) continue from `flat`, bytes laid out
    as `state.layout` says (`flat` is the recipient's own received copy of `state.flat`)."""
    model_tensors = model.state_dict()
    params = _optimizer_params(optimizer)
    optimizer_state: dict = {}
    offset = 0
    for name, dtype, shape in state.layout:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        value = flat[offset:offset + nbytes].clone().view(dtype).reshape(shape)  # clone: aligned for the view
        offset += nbytes
        kind, rest = name.split(".", 1)
        if kind == "model":
            model_tensors[rest].copy_(value)
        elif kind == "master":
            master_params[int(rest)].copy_(value)
        elif kind == "optimizer":
            index, key = rest.split(".", 1)
            param = params[int(index)]
            optimizer_state.setdefault(param, {})[key] = unpacked(value, optimizer.state.get(param, {}).get(key))
        else:
            scaler.scale = unpacked(value, scaler.scale)
    optimizer.state.clear()
    optimizer.state.update(optimizer_state)
    if scaler is not None:
        scaler.clean_steps = state.clean_steps


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list:
    return [param for group in optimizer.param_groups for param in group["params"]]
