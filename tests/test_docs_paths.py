"""Every file the documentation names exists, and the code map names every module (issue 51, item 8: docs that
name modules long gone mislead).

Where a path is looked for: the pages (docs/**/*.md, README.md, bench/README.md), pyproject.toml and the Makefile
whole; in Python files (simtrain/, bench/, tests/, docs/hooks/, cli.py) the docstrings, the scenario fields'
`description=` texts and the comments, not the code's own strings (a test may name a file that must be missing).

What a path is: a word of the form `first/.../last` whose first folder is one of this repository's
(`REPOSITORY_FOLDERS`) or a package of simtrain (`comm`, `schemes`, `train`, ...: the docs write
`backend/interpreter.py` for simtrain/backend/interpreter.py), not glued to what comes before it (a letter, `/`, `.`,
`:`, `~`, `-` or `@`). So a URL, another project's file (`megatron/core/...`, `torchtitan/...`: written from its
own project's root), a relative link (`../guides/faults.md`) and an output folder (`runs/...`) are not paths of
this repository. Not checked: a placeholder (a folder or file named in capitals, `bench/X.py`) and a path cited
at a commit (`schemes/pipeline_schedule.py at a6eb7f2`: history).

It exists when it is found from the repository's root or from simtrain/ (a file or a folder); `module.name`
(`comm/ring_schedule.reduce_as_ring`) when the module defines that name; `docs/reference/X.md` when the docs'
hook generates that page (docs/hooks/reference.py: the reference pages exist only in the built site).

The pages' relative links (`[faults](../guides/faults.md)`) must reach a page too (the site's build checks them
as well, in tests/test_docs.py, which is slow and marked `docs`; this file is not: it reads text and runs in
`make test-fast`).
"""
import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY_FOLDERS = ("bench", "docs", "scenarios", "simtrain", "tests", "topologies")  # as git holds them
PACKAGES = tuple(sorted(path.parent.name for path in (ROOT / "simtrain").glob("*/__init__.py")))
PATH = re.compile(r"(?<![\w/.:~@-])((?:%s)/(?:[\w.-]+/)*(?:[\w.-]*\w)?/?)(`?\s+at\s+[0-9a-f]{7,40}\b)?"
                  % "|".join(REPOSITORY_FOLDERS + PACKAGES))
LINK = re.compile(r"\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.\w+)?$")


def generated_pages() -> set[str]:
    """The reference pages docs/hooks/reference.py writes at every build (its PAGES), read without mkdocs."""
    tree = ast.parse((ROOT / "docs/hooks/reference.py").read_text())
    pages = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(target, ast.Name) and target.id == "PAGES" for target in node.targets))
    return {"docs/" + page for page in ast.literal_eval(pages)}


GENERATED = generated_pages()


def pages() -> list[Path]:
    return sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md", ROOT / "bench/README.md"])


def python_files() -> list[Path]:
    return sorted([*ROOT.glob("simtrain/**/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("tests/*.py"),
                   *ROOT.glob("docs/hooks/*.py"), ROOT / "cli.py"])


def prose(source: str) -> list[str]:
    """A Python file's docstrings, `description=` texts and comments: what it says to a reader."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append(ast.get_docstring(node, clean=False) or "")
        elif isinstance(node, ast.keyword) and node.arg == "description":
            found += [part.value for part in ast.walk(node.value)
                      if isinstance(part, ast.Constant) and isinstance(part.value, str)]
    found += [token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
              if token.type == tokenize.COMMENT]
    return found


def defines(module: Path, name: str) -> bool:
    tree = ast.parse(module.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return True
    return False


def exists(path: str) -> bool:
    if path in GENERATED:
        return True
    for base in (ROOT, ROOT / "simtrain"):
        if (base / path).exists():
            return True
        folder, _, last = path.rstrip("/").rpartition("/")
        module, dot, name = last.partition(".")
        if dot and name.isidentifier() and (base / folder / f"{module}.py").is_file():
            return defines(base / folder / f"{module}.py", name)
    return False


def missing_paths(text: str) -> list[str]:
    """The paths of this repository that `text` names and that do not exist, in the order it names them."""
    missing = []
    for match in PATH.finditer(text):
        path, at_commit = match.group(1), match.group(2)
        if at_commit or any(PLACEHOLDER.match(part) for part in path.rstrip("/").split("/")):
            continue
        if not exists(path):
            missing.append(path)
    return missing


def missing_links(page: Path) -> list[str]:
    missing = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:|#", target):  # a URL, a mail address, an anchor of the page itself
            continue
        linked = (page.parent / target.split("#")[0]).resolve()
        relative = linked.relative_to(ROOT).as_posix() if linked.is_relative_to(ROOT) else str(linked)
        if not linked.exists() and relative not in GENERATED:
            missing.append(target)
    return missing


def test_every_path_the_docs_name_exists():
    missing: dict[str, list[str]] = {}
    texts = [(page, [page.read_text()]) for page in [*pages(), ROOT / "pyproject.toml", ROOT / "Makefile"]]
    texts += [(module, prose(module.read_text())) for module in python_files()]
    for where, parts in texts:
        for path in (path for part in parts for path in missing_paths(part)):
            missing.setdefault(path, []).append(where.relative_to(ROOT).as_posix())
    assert not missing, f"the docs name files that do not exist: {missing}"


def test_every_link_of_the_pages_reaches_a_page():
    missing = {page.relative_to(ROOT).as_posix(): links for page in pages() if (links := missing_links(page))}
    assert not missing, f"the pages link to files that do not exist: {missing}"


def test_the_code_map_names_every_module():
    """docs/concepts/code-map.md lists each module of simtrain by its path (a package by its folder)."""
    code_map = (ROOT / "docs/concepts/code-map.md").read_text()
    modules = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "simtrain").rglob("*.py"))
    named = [f"`{module.removesuffix('__init__.py')}`" for module in modules]
    unnamed = [name for name in named if name not in code_map]
    assert not unnamed, f"docs/concepts/code-map.md does not name: {unnamed}"


def test_a_stale_path_is_caught_and_other_projects_paths_are_not():
    """The check fails where it should: against the repository as it is, on text written for the purpose."""
    text = ("Buckets live in `schemes/grad_buckets.py` (simtrain/schemes/sync.py before); the interpreter is "
            "backend/interpreter.py, the groups simtrain/parallel/layout.py and simtrain/parallel/, the ring "
            "comm/ring_schedule.reduce_as_ring, not comm/ring_schedule.reduce_as_tree; what combines is "
            "docs/reference/support.md; run `python bench/X.py`; once schemes/pipeline_schedule.py at a6eb7f2 and `schemes/sync.py` at 52bc6af. "
            "Megatron-Core's megatron/core/distributed/param_and_grad_buffer.py, torchtitan's "
            "torchtitan/distributed/parallel_dims.py, https://github.com/NVIDIA/nccl-tests/blob/master/doc/x.md, "
            "../guides/faults.md and runs/quickstart/report.json are not this repository's.")
    assert missing_paths(text) == ["schemes/grad_buckets.py", "simtrain/schemes/sync.py",
                                   "comm/ring_schedule.reduce_as_tree"]
