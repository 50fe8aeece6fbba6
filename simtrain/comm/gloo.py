"""Runs the same per-rank collective programs on a real torch.distributed backend.

Inside a process of an initialized process group (gloo here, any backend that
has isend/irecv), the program's Send and Recv become real point-to-point calls,
their `tag` the calls' tag; a `Concurrently` yield runs each sub-program in its
own thread, so that each advances as its own transfers complete:

    dist.init_process_group("gloo", ...)
    run_program(ring_all_reduce(dist.get_rank(), dist.get_world_size(), buf))

That is the check that a simulated collective is a real algorithm: the tests
run every program both ways and compare the numbers.
"""
import threading

import torch
import torch.distributed as dist

from .ops import Concurrently, Send


def run_program(program):
    """Drive `program` to its end with torch.distributed isend/irecv; return its value."""
    value = None
    while True:
        try:
            ops = program.send(value)
        except StopIteration as stop:
            return stop.value
        if type(ops) is Concurrently:
            value = _run_concurrently(ops.programs)
            continue
        single = not isinstance(ops, list)
        if single:
            ops = [ops]
        requests, landings = [], []
        for index, op in enumerate(ops):
            if type(op) is Send:
                requests.append(dist.isend(op.tensor.contiguous(), op.dst, tag=op.tag))
            else:
                landing = torch.empty_like(op.out)
                requests.append(dist.irecv(landing, op.src, tag=op.tag))
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


def _run_concurrently(programs) -> list:
    """Each program in its own thread; their values in order, or the first error raised again."""
    programs = list(programs)
    results, errors = [None] * len(programs), []

    def run(index, program):
        try:
            results[index] = run_program(program)
        except BaseException as error:  # re-raised in the calling thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, p), daemon=True) for i, p in enumerate(programs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
