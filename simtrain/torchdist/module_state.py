"""A library's module-level state made each rank's own, as each rank's process of its own has it.

Some frameworks keep a process's training state in module globals: Megatron-Core keeps
its process groups (`parallel_state._TENSOR_MODEL_PARALLEL_GROUP`, ...), its RNG
tracker and its micro-batch calculator there, set once per process. The ranks of
a spawn are threads of one process, so each rank's `initialize_model_parallel`
would overwrite the others'. While `ranks_own_module_state(package)` is entered,
every spawn gives each rank its own copy of the private globals (names that start
with an underscore, not modules, functions or classes) of `package`'s modules
loaded at the spawn's start: each rank starts from the values they had then (a
dict, list or set copied, so no rank sees another's entries), its values are put
back whenever it resumes and saved whenever it hands control back (scheduler.py,
where torch's CPU generator is swapped the same way), and the values the spawn
began with are put back at its end. A module first imported inside a rank is not
covered: import the package's modules before the spawn.

    with ranks_own_module_state("megatron.core"):
        spawn(train, world=4)          # each rank's parallel_state is its own
"""
import contextlib
import copy
import inspect
import sys
import types

_ABSENT = object()
_COPIED = (dict, list, set)
_registered: list[str] = []  # the packages of the blocks entered


class ModuleState:
    """The private globals of the modules of one package, as they are at construction (see above)."""

    def __init__(self, package: str):
        modules = [module for name, module in sorted(sys.modules.items())
                   if module is not None and (name == package or name.startswith(package + "."))]
        self._slots = [(vars(module), name) for module in modules for name, value in list(vars(module).items())
                       if _is_state(name, value)]
        self._initial = self.save()

    def fresh(self) -> list:
        """The values a rank starts from: the initial ones, each container its own copy."""
        return [copy.copy(value) if isinstance(value, _COPIED) else value for value in self._initial]

    def save(self) -> list:
        return [namespace.get(name, _ABSENT) for namespace, name in self._slots]

    def load(self, values: list) -> None:
        for (namespace, name), value in zip(self._slots, values):
            if value is _ABSENT:
                namespace.pop(name, None)
            else:
                namespace[name] = value


def _is_state(name: str, value) -> bool:
    return (name.startswith("_") and not name.startswith("__")
            and not isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type))
            and not inspect.isroutine(value))


def registered() -> list[ModuleState]:
    """The packages whose state each rank of a spawn starting now keeps its own of."""
    return [ModuleState(package) for package in _registered]


@contextlib.contextmanager
def ranks_own_module_state(package: str):
    """Each rank of the spawns run in the block keeps its own `package` globals (see above)."""
    _registered.append(package)
    try:
        yield
    finally:
        _registered.remove(package)
