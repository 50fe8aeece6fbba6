"""User-facing errors.

A user's mistake raises a `SimtrainError` subclass whose one-line message names
the file and field at fault; the CLI prints that line and exits with code 2.
A job that a fault stopped (hw/faults.py) is no mistake: `JobFailed` ends the
simulation, the run still reports (status `failed`, and why), and the CLI exits
with code 3. A bug may raise anything else.
"""


class SimtrainError(Exception):
    """A mistake in what the user asked for: printed as one line, exit code 2."""


def one_line(text: str) -> str:
    """`text` with every character that is not printable (a newline in a key, a NUL) escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown_value(value, limit: int = 40) -> str:
    """A value as an error line shows it: its repr, cut to `limit` characters."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return "a number of thousands of digits"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, as a one-line error quotes an exception from a user's code:
    '(no message)' without one, or where its `__str__` itself raises."""
    try:
        lines = str(error).strip().splitlines()
    except Exception:  # a user's exception class whose __str__ fails
        lines = []
    return one_line(lines[0]) if lines else "(no message)"


class ScenarioError(SimtrainError):
    """A scenario file or override that does not validate."""


class PastLimit(ScenarioError):
    """A valid scenario that would take simtrain past one of its limits (limits.py) to simulate: refused where the
    bound is known, whatever way the scenario is run."""


class ConfigImportError(SimtrainError):
    """A torchtitan or Megatron config that `simtrain import` cannot read or map (simtrain/importers/)."""


class TopologyError(SimtrainError):
    """A topology that cannot be built: disconnected, unknown node, wrong size."""


class OutOfMemory(SimtrainError):
    """A device's memory ledger went past its capacity; `message` says by how much (hw/device.py writes it)."""

    def __init__(self, device: str, capacity_bytes: int, by_category: dict[str, int], message: str):
        self.device = device
        self.capacity_bytes = capacity_bytes
        self.by_category = dict(by_category)
        self.message = message
        # The fields are the args, so that the error can be re-raised by type(e)(*e.args), as simpy
        # does when a process fails.
        super().__init__(device, capacity_bytes, self.by_category, message)

    def __str__(self) -> str:
        return self.message


class RankFailed(SimtrainError):
    """A rank of simtrain.dist.spawn raised; the run ended there."""


class Deadlock(SimtrainError):
    """Every rank of simtrain.dist.spawn that has not ended waits on something that can never happen."""


class CollectiveMismatch(SimtrainError):
    """Ranks of a process group called different collectives, or the same with different sizes."""


class JobFailed(Exception):
    """A fault stopped a job (not a user's mistake): the run reports `status: failed` and this reason."""


class NoRoute(JobFailed):
    """Failed links left no route between two nodes that must exchange bytes."""


class NumericsOffUnsupported(SimtrainError):
    """With numerics off (simtrain.dist.spawn numerics=False), a rank ran an op that needs tensor values."""


class RankBlocked(SimtrainError):
    """A rank of simtrain.dist.spawn blocked outside its scheduler (a lock, time.sleep, a queue) past the watchdog."""


class RepresentativesUnsupported(SimtrainError):
    """simtrain.dist.spawn representatives: a group or an operation that ranks standing in for others cannot post."""


class RepresentativesDiverge(SimtrainError):
    """simtrain.dist.spawn representatives: a represented rank (the witness) did not run as its representative."""
