"""Run a function in N real gloo processes: the reference simulated results are compared with.

`run_on_gloo(fn, world)` is simtrain.real.processes.spawn: `world` CPU processes that
rendezvous through a file in a temporary directory (no network ports), each calls
`fn(rank, world)`, and every rank's return value comes back in rank order. `fn`
must be a module-level function (it is pickled by name).

    results = run_on_gloo(my_collectives, 4)      # [rank 0's value, ..., rank 3's]
"""
from simtrain.real.processes import spawn


def run_on_gloo(fn, world: int, args: tuple = ()) -> list:
    """Every rank's `fn(rank, world, *args)` over a gloo process group of `world` processes."""
    return spawn(fn, world, args)
