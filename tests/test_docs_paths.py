"""Every file the documentation names exists (issue 51, item 8: docs that name modules long gone mislead).

A path is a backquoted name ending in .py, .yaml, .md, .json or .csv in docs/**/*.md or README.md: looked up
from the repository's root, then under simtrain/ (the docs write `schemes/sync.py` for simtrain/schemes/sync.py).
Paths under runs/ or a user's folder (an example of output) and files of the projects the docs cite (torch,
torchtitan, Megatron-Core, Transformer Engine) are not the repository's.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMED = re.compile(r"`((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]+\.(?:py|yaml|md|json|csv))`")
OUTSIDE = ("runs/", "out/", "~/", "./", "/", "site/",  # a user's folders
           "torch/", "megatron/", "transformer_engine/", "benchmarks/", "doc/")  # other projects' files


def named_paths() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for page in sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md"]):
        for path in NAMED.findall(page.read_text()):
            if not path.startswith(OUTSIDE):
                found.setdefault(path, []).append(str(page.relative_to(ROOT)))
    return found


def test_every_path_the_docs_name_exists():
    missing = {path: pages for path, pages in named_paths().items()
               if not (ROOT / path).exists() and not (ROOT / "simtrain" / path).exists()}
    assert not missing, f"the docs name files that do not exist: {missing}"
