"""Runs the same per-rank collective programs on a real torch.distributed backend.

Inside a process of an initialized process group (gloo here, any backend that
has isend/irecv), the program's Send and Recv become real point-to-point calls:

    dist.init_process_group("gloo", ...)
    run_program(ring_all_reduce(dist.get_rank(), dist.get_world_size(), buf))

That is the check that a simulated collective is a real algorithm: the tests
run every program both ways and compare the numbers.
"""
import torch
import torch.distributed as dist

from .ops import Send


def run_program(program):
    """Drive `program` to its end with torch.distributed isend/irecv; return its value."""
    value = None
    while True:
        try:
            ops = program.send(value)
        except StopIteration as stop:
            return stop.value
        single = not isinstance(ops, list)
        if single:
            ops = [ops]
        requests, landings = [], []
        for index, op in enumerate(ops):
            if type(op) is Send:
                requests.append(dist.isend(op.tensor.contiguous(), op.dst))
            else:
                landing = torch.empty_like(op.out)
                requests.append(dist.irecv(landing, op.src))
                landings.append((index, op, landing))
        for request in requests:
            request.wait()
        results = [None] * len(ops)
        for index, op, landing in landings:
            if op.reduce:
                op.out.add_(landing)
            else:
                op.out.copy_(landing)
            results[index] = op.out
        value = results[0] if single else results
