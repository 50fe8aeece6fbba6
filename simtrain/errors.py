"""User-facing errors.

A user's mistake raises a `SimtrainError` subclass whose one-line message names
the file and field at fault; the CLI prints that line and exits with code 2.
A bug may raise anything else.
"""


class SimtrainError(Exception):
    """A mistake in what the user asked for: printed as one line, exit code 2."""


class ScenarioError(SimtrainError):
    """A scenario file or override that does not validate."""


class TopologyError(SimtrainError):
    """A topology that cannot be built: disconnected, unknown node, wrong size."""


class OutOfMemory(SimtrainError):
    """A device's memory ledger went past its capacity."""

    def __init__(self, device: str, capacity_bytes: int, by_category: dict[str, int]):
        self.device = device
        self.capacity_bytes = capacity_bytes
        self.by_category = dict(by_category)
        total = sum(by_category.values())
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in by_category.items() if v)
        super().__init__(
            f"out of memory on {device}: needs {_gib(total)} of {_gib(capacity_bytes)} ({parts})"
        )


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f} GiB"
