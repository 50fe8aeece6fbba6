"""Stand-ins set for the time of a block: what a framework reaches the machine through, answered for simulated ranks
(frameworks/torchtitan.py, frameworks/megatron.py)."""
import contextlib
from collections.abc import MutableMapping


@contextlib.contextmanager
def attributes_set(changes: list):
    """Each (object, name, value) of `changes` set (an item where the object is a mapping) until the block ends,
    then put back, or taken away where it was not there."""
    absent = object()
    before = []
    for target, name, value in changes:
        mapping = isinstance(target, MutableMapping)
        before.append((target, name, target.get(name, absent) if mapping else getattr(target, name, absent)))
        if mapping:
            target[name] = value
        else:
            setattr(target, name, value)
    try:
        yield
    finally:
        for target, name, value in reversed(before):
            if isinstance(target, MutableMapping):
                if value is absent:
                    target.pop(name, None)
                else:
                    target[name] = value
            elif value is absent:
                delattr(target, name)
            else:
                setattr(target, name, value)
