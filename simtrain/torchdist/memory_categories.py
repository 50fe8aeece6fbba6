"""Memory by category for users' code: weights, gradients, optimizer state and activations, told from hooks.

While `categorized(run)` is entered, torch's global module and optimizer hooks
tell each rank's `OpMeter` (op_meter.py) what its tensors are, not their sizes:

- **weights**: a parameter as a module registers it
  (`register_module_parameter_registration_hook`; a DTensor's local shard);
- **gradients**: a parameter's `.grad` once autograd has accumulated it
  (`register_post_accumulate_grad_hook`), and every parameter's `.grad` as an
  optimizer steps (FSDP2 sets sharded gradients itself, not through autograd);
- **optimizer_state**: every tensor in `optimizer.state` after a step;
- **activations**: the rest made while a module's forward runs (global forward
  pre- and post-hooks keep the depth); what is made outside one stays `tensors`.

The hooks are process-global; they act only in a rank's thread of the run.

    with categorized(run):
        run.finish()
    device.memory.peak["optimizer_state"]    # Adam: 2 states of 4 bytes per fp32 parameter, and its step counts
"""
from contextlib import ExitStack, contextmanager

import torch
from torch.nn.modules.module import (register_module_forward_hook, register_module_forward_pre_hook,
                                     register_module_parameter_registration_hook)
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .scheduler import current_rank


@contextmanager
def categorized(run):
    """The run's ranks' tensors held under their categories until the block ends."""

    def meter():
        rank = current_rank()
        return None if rank is None else run.meters[rank]

    def parameter_registered(module, name, parameter):
        if (rank_meter := meter()) is not None and parameter is not None:
            rank_meter.categorize(parameter, "weights")
            if parameter.requires_grad and parameter.is_leaf and not hasattr(parameter, "_local_tensor"):
                parameter.register_post_accumulate_grad_hook(
                    lambda parameter: rank_meter.categorize(parameter.grad, "gradients"))

    def forward_begins(module, args):
        if (rank_meter := meter()) is not None:
            rank_meter.forward_depth += 1

    def forward_ends(module, args, output):
        if (rank_meter := meter()) is not None:
            rank_meter.forward_depth -= 1

    def step_begins(optimizer, args, kwargs):
        if (rank_meter := meter()) is not None:
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    if parameter.grad is not None:
                        rank_meter.categorize(parameter.grad, "gradients")

    def step_ends(optimizer, args, kwargs):
        if (rank_meter := meter()) is not None:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        rank_meter.categorize(value, "optimizer_state")

    with ExitStack() as hooks:
        for handle in (register_module_parameter_registration_hook(parameter_registered),
                       register_module_forward_pre_hook(forward_begins),
                       register_module_forward_hook(forward_ends, always_call=True),
                       register_optimizer_step_pre_hook(step_begins),
                       register_optimizer_step_post_hook(step_ends)):
            hooks.callback(handle.remove)
        yield
