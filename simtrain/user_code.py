"""A user's model or data set that raises while a run uses it: one line naming the scenario field.

`model.name` and `data.name` may name a user's function (`package.module:function`,
train/data.py's load_callable). What that function raises while it builds is
named where it is called (call_with_options), and the model is tried once on a
batch of two before the run (train/models.py). What the built model raises
later — at the run's batch size, in its backward, at some step — surfaces
wherever the clock happened to be, as a traceback through simpy.
`user_code_errors(scenario)` is the block around a run that turns it into a
`ScenarioError` naming the field:

    with user_code_errors(scenario):
        run_to_end(cluster.env)
    # model.name: badmodel:build raised RuntimeError during the run: shape mismatch

The error is the user's when its traceback (or that of an exception it was
raised from, as simpy re-raises a process's failure) passes through a file of
the user's code: the module the import path names or, when that module is part
of a package, any file of its top-level package. The original exception stays
chained, for the Python API. Anything else is re-raised untouched.
"""
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

from .errors import ScenarioError, first_line

_IMPORT_PATH_SEPARATOR = ":"


@contextmanager
def user_code_errors(scenario):
    """Within the block, an exception raised by the scenario's user model or data set becomes a ScenarioError."""
    try:
        yield
    except ScenarioError:
        raise
    except (Exception, SystemExit) as error:
        for field, name in (("model.name", scenario.model.name), ("data.name", scenario.data.name)):
            files = _user_files(name)
            if files and _passes_through(error, files):
                raise ScenarioError(f"{field}: {name} raised {type(error).__name__} during the run: "
                                    f"{first_line(error)}") from error
        raise


def _user_files(import_path: str) -> tuple[Path, ...]:
    """The files (a module) or folders (a package) that hold the user's code named by `import_path`;
    empty for a built-in name or a module not imported."""
    if _IMPORT_PATH_SEPARATOR not in import_path:
        return ()
    module_name = import_path.split(_IMPORT_PATH_SEPARATOR)[0]
    top = sys.modules.get(module_name.split(".")[0])
    if top is None:
        return ()
    if hasattr(top, "__path__"):  # a package: every file under its folders
        return tuple(Path(os.path.realpath(folder)) for folder in top.__path__)
    return (Path(os.path.realpath(top.__file__)),) if getattr(top, "__file__", None) else ()


def _passes_through(error: BaseException, files: tuple[Path, ...]) -> bool:
    """Whether the traceback of `error`, or of an exception it was raised from, has a frame in `files`."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for frame, _ in traceback.walk_tb(error.__traceback__):
            source = Path(os.path.realpath(frame.f_code.co_filename))
            if any(source == path or path in source.parents for path in files):
                return True
        error = error.__cause__ or error.__context__
    return False
