"""The documentation cannot drift: the site builds without a warning, and every code block of its pages runs.

Each page of docs/**/*.md, and README.md, is one test. Its fenced blocks run in order, in a scratch folder that holds the
repository's scenarios/ and topologies/ (so `runs/` lands there), as SimPy runs its examples. What a block does
depends on its fence's language:

- `python`: run in one namespace per page. A `text` block right after it is its expected standard output.
- `console`: every `$ simtrain ...` line runs (as `python -m simtrain` does, in the test's process, its output
  piped); the lines up to the next `$` are its expected output (standard output, then standard error). A command
  whose expected output has a line starting with `error:` must exit with 2, any other with 0. Keep them short:
  `train.steps`, `--no-numerics`.
- `bash`: commands shown, not run (a benchmark of minutes, a study, a real launch). Each is checked instead:
  a `simtrain` command (also after `torchrun ... -m`) must parse against the click commands, and every
  scenario it would run (each `--variant`, each `--grid` point) must pass `simtrain validate`; a
  `python bench/X.py` script must exist and define the options given; `make T` must be a Makefile target.
- `yaml`: parsed with simtrain's own loader and validated as a scenario (a fragment: the rest takes defaults).
- `text`: output or formulas; not code.

Any other fence fails, so that no code block escapes. Outputs are compared line by line after trailing spaces
are stripped; a line `...` stands for any number of lines. SIMTRAIN_DOCS_UPDATE=1 rewrites the expected
outputs in the pages from what the blocks printed (then read the diff).
"""
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from simtrain.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(path for path in DOCS.rglob("*.md") if "hooks" not in path.parts)]
FENCE = re.compile(r"^```(\S*)\s*$")
UPDATE = os.environ.get("SIMTRAIN_DOCS_UPDATE") == "1"
ENV = {**os.environ, "COLUMNS": "100", "TERM": "dumb", "NO_COLOR": "1", "PYTHONHASHSEED": "0"}

pytestmark = pytest.mark.docs


class Block:
    def __init__(self, language: str, lines: list[str], first_line: int):
        self.language, self.lines, self.first_line = language, lines, first_line  # first_line: 0-based, fence's

    @property
    def text(self) -> str:
        return "".join(line + "\n" for line in self.lines)


def fenced_blocks(text: str) -> list[Block]:
    blocks, current = [], None
    for number, line in enumerate(text.split("\n")):
        match = FENCE.match(line)
        if current is None and match:
            current = Block(match.group(1), [], number)
        elif current is not None and line.rstrip() == "```":
            blocks.append(current)
            current = None
        elif current is not None:
            current.lines.append(line)
    assert current is None, f"a fence opened on line {current.first_line + 1} is never closed"
    return blocks


def test_site_builds_without_warnings(tmp_path):
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=ROOT, capture_output=True, text=True, env={**ENV, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stderr
    assert "WARNING" not in build.stderr, build.stderr
    for page in ("reference/scenario", "reference/cli", "reference/report", "reference/support"):
        assert (tmp_path / "site" / page / "index.html").exists()


def test_the_readme_links_every_page():
    """README.md's list of the documentation names every page of docs/ (the generated reference aside)."""
    readme = (ROOT / "README.md").read_text()
    pages = [path.relative_to(ROOT).as_posix() for path in PAGES[1:]]
    assert [page for page in pages if f"]({page})" not in readme] == []


def test_reference_pages_are_generated_not_committed():
    assert not (DOCS / "reference").exists() or not list((DOCS / "reference").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_page_code_blocks(page, tmp_path, monkeypatch):
    for folder in ("scenarios", "topologies"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    monkeypatch.chdir(tmp_path)
    text = page.read_text()
    blocks = fenced_blocks(text)
    namespace, outputs = {"__name__": "__docs__"}, {}  # outputs: block index -> what it printed
    for index, block in enumerate(blocks):
        where = f"{page.relative_to(ROOT)}:{block.first_line + 1}"
        if block.language == "python":
            printed = run_python(block, namespace, where)
            following = blocks[index + 1] if index + 1 < len(blocks) else None
            if following is not None and following.language == "text" and _adjacent(text, block, following):
                outputs[index + 1] = printed
                if not UPDATE:
                    assert_output_matches(printed, following.lines, where)
        elif block.language == "console":
            outputs[index] = run_console(block, where)
        elif block.language == "bash":
            for command in shell_commands(block):
                check_shown_command(command, where)
        elif block.language == "yaml":
            check_yaml(block, where)
        else:
            assert block.language == "text", f"{where}: a ```{block.language} block is not run by tests/test_docs.py"
    if UPDATE and outputs:
        page.write_text(with_outputs(text, blocks, outputs))


def _adjacent(text: str, first: Block, second: Block) -> bool:
    between = text.split("\n")[first.first_line + len(first.lines) + 2:second.first_line]
    return all(not line.strip() for line in between)


# -- python ---------------------------------------------------------------------------------------------------------

def run_python(block: Block, namespace: dict, where: str) -> list[str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block.text, where, "exec"), namespace)  # noqa: S102 (the page's own example)
    return printed.getvalue().rstrip("\n").split("\n") if printed.getvalue() else []


# -- console --------------------------------------------------------------------------------------------------------

def run_console(block: Block, where: str) -> list[tuple[str, list[str]]]:
    """Run each `$ ` command; compare its output with the lines after it. Returns (command, printed) pairs."""
    results = []
    for command, expected in console_commands(block, where):
        arguments = shlex.split(command)
        assert arguments[0] == "simtrain", f"{where}: a console block runs simtrain commands only: {command}"
        code, stdout, stderr = run_simtrain(arguments[1:])
        printed = (stdout + stderr).rstrip("\n").split("\n") if stdout + stderr else []
        expected_code = 2 if any(line.startswith("error:") for line in expected) else 0
        assert code == expected_code, f"{where}: `{command}` exited {code}:\n{stderr}"
        if expected and not UPDATE:
            assert_output_matches(printed, expected, where)
        results.append((command, printed if expected else []))  # a command shown without output stays so
    return results


def run_simtrain(arguments: list[str]) -> tuple[int, str, str]:
    """`python -m simtrain ARGUMENTS` in this process, its standard output and error captured (piped, as in a
    subprocess: simtrain's tables take their piped width); torch and simtrain are imported once a worker, not once
    a command. (exit code, standard output, standard error)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main(arguments)
        except SystemExit as done:
            return done.code or 0, stdout.getvalue(), stderr.getvalue()
    raise AssertionError(f"simtrain {shlex.join(arguments)} returned instead of exiting")


def console_commands(block: Block, where: str) -> list[tuple[str, list[str]]]:
    commands = []
    for line in block.lines:
        if line.startswith("$ "):
            commands.append((line[2:], []))
        else:
            assert commands, f"{where}: a console block starts with a `$ ` command"
            commands[-1][1].append(line)
    return commands


# -- bash: shown, checked, not run ----------------------------------------------------------------------------------

def shell_commands(block: Block) -> list[list[str]]:
    joined = re.sub(r"\\\n\s*", " ", block.text)
    return [words for line in joined.split("\n") if (words := shlex.split(line, comments=True))]


def bench_text(script: Path) -> str:
    """A bench script's text and that of the bench modules it imports (bench/published_rows.py's command line)."""
    text = script.read_text()
    imported = re.findall(r"^(?:from (\w+) import|import (\w+))", text, flags=re.M)
    modules = [script.parent / f"{name}.py" for pair in imported for name in pair if name]
    return "\n".join([text] + [module.read_text() for module in modules if module.is_file()])


def check_shown_command(words: list[str], where: str) -> None:
    if words[0] == "torchrun":
        assert "-m" in words, f"{where}: torchrun without -m simtrain"
        words = words[words.index("-m") + 1:]
    if words[0] == "simtrain":
        check_simtrain_command(words[1:], where)
    elif words[0] == "python" and words[1].startswith("bench/"):
        script = ROOT / words[1]
        assert script.is_file(), f"{where}: no {words[1]}"
        text = bench_text(script)
        for option in (word.split("=")[0] for word in words[2:] if word.startswith("--")):
            assert f'"{option}"' in text, f"{where}: {words[1]} has no option {option}"
    elif words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        assert words[1] in targets, f"{where}: no make target {words[1]}"
    else:
        raise AssertionError(f"{where}: a bash block shows simtrain, python bench/, make or torchrun commands: "
                             f"{' '.join(words)}")


def check_simtrain_command(arguments: list[str], where: str) -> None:
    """The command parses against the click commands; every scenario it would run passes `simtrain validate`."""
    import click

    from simtrain import cli

    command, name = next(o for o in (getattr(cli, "main", None), cli.cli) if isinstance(o, click.Group)), "simtrain"
    while isinstance(command, click.Group):
        name, arguments = arguments[0], arguments[1:]
        assert name in command.commands, f"{where}: simtrain has no command {name}"
        command = command.commands[name]
    try:
        params = command.make_context(name, list(arguments)).params
    except click.ClickException as error:
        raise AssertionError(f"{where}: simtrain {name}: {error.format_message()}") from None
    files = params.get("scenario_files") or ([params["scenario_file"]] if params.get("scenario_file") else [])
    files = [file for file in files if file.endswith((".yaml", ".yml"))]  # compare also takes run folders
    replay = ["numerics=false"] if name == "memory" else []  # simtrain memory replays a step on meta tensors
    for file in files:
        for overrides in scenario_variants(params):
            overrides = [*overrides, *replay]
            check_scenario(file, overrides, where)


def scenario_variants(params: dict) -> list[list[str]]:
    """The --set overrides of every run a command makes: one per --variant, or per point of the --grid product."""
    common = list(params.get("overrides") or [])
    if params.get("grids"):
        from simtrain.studies.sweep import parse_grid, plan_points

        grids = [parse_grid(text) for text in params["grids"]]
        return [[*common, *(f"{grid.path}={grid.texts[i]}" for grid, i in zip(grids, point))]
                for point in plan_points(grids)]
    if params.get("variants"):
        from simtrain.compare import parse_variant

        return [[*common, *parse_variant(variant)] for variant in params["variants"]]
    return [common]


def check_scenario(file: str, overrides: list[str], where: str) -> None:
    from click.testing import CliRunner

    from simtrain import cli

    group = next(o for o in (getattr(cli, "main", None), cli.cli) if hasattr(o, "commands"))
    arguments = ["validate", file, *(word for override in overrides for word in ("--set", override))]
    result = CliRunner().invoke(group, arguments)
    assert result.exit_code == 0, f"{where}: simtrain {' '.join(arguments)}: {result.output}{result.exception}"


# -- yaml -----------------------------------------------------------------------------------------------------------

def check_yaml(block: Block, where: str) -> None:
    from simtrain.errors import ScenarioError
    from simtrain.scenario import Scenario
    from simtrain.user_files import parse_yaml_text

    data = parse_yaml_text(block.text, where, ScenarioError)
    assert isinstance(data, dict), f"{where}: a yaml block is a scenario or a part of one"
    Scenario.model_validate(data)


# -- outputs --------------------------------------------------------------------------------------------------------

def assert_output_matches(printed: list[str], expected: list[str], where: str) -> None:
    printed, expected = _trimmed(printed), _trimmed(expected)
    pattern = "".join(r"(?:.*\n)*?" if line.strip() == "..." else re.escape(line.rstrip()) + r"\n"
                      for line in expected)
    actual = "".join(line.rstrip() + "\n" for line in printed)
    assert re.fullmatch(pattern, actual), f"{where}: printed\n{actual}\nexpected\n" + "\n".join(expected)


def _trimmed(lines: list[str]) -> list[str]:
    """Without the blank lines at either end."""
    text = "\n".join(lines).strip("\n")
    return text.split("\n") if text else []


def with_outputs(text: str, blocks: list[Block], outputs: dict) -> str:
    """The page with each block's expected output replaced by what it printed (SIMTRAIN_DOCS_UPDATE=1)."""
    lines = text.split("\n")
    for index in sorted(outputs, reverse=True):
        block = blocks[index]
        if block.language == "text":
            body = outputs[index]
        else:
            body = [line for command, printed in outputs[index] for line in (f"$ {command}", *printed)]
        lines[block.first_line + 1:block.first_line + 1 + len(block.lines)] = body
    return "\n".join(lines)


# -- the generated reference ----------------------------------------------------------------------------------------

def _reference_hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scenario_reference_lists_every_key_with_its_default_and_unit():
    page = _reference_hook().scenario_page()
    cells = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
             for line in page.splitlines() if line.startswith("| `")]
    rows = {row[0].strip("`"): row[1:] for row in cells}
    assert rows["cluster.link.bandwidth"][1:3] == ["`50000000000.0`", "B/s"]  # a section's default, SI unit
    assert rows["cluster.fault_detection"][1:3] == ["`0.1`", "s"]
    assert rows["parallel.async.consistency"][0] == '`"hogwild"` \\| `"locked"`'  # the alias, not async_
    assert rows["train.steps"][1] == "`200`"
    for key in ("parallel.pp", "parallel.tp", "train.precision", "data.vocab", "cluster.spares", "pbt.population"):
        assert key in rows


def test_reference_pages_keep_angle_brackets_as_text():
    """Outside code spans a cell writes `<name>` as &lt;name&gt; (markdown would drop it as an HTML tag): the
    command line's `--out` default runs/<name>/ survives; inside code spans it stays as written."""
    hook = _reference_hook()
    for builder in hook.PAGES.values():
        for line in getattr(hook, builder)().splitlines():
            if line.startswith("|"):
                outside = line.split("`")[::2]
                assert not any(re.search(r"<[a-zA-Z/]", part) for part in outside), line
    cli_page = hook.cli_page()
    assert "Output folder (default runs/&lt;name&gt;/)." in cli_page
    assert "`<name>`" in hook._cell("`<name>`") and hook._cell("a < b & c") == "a &lt; b &amp; c"


def test_report_reference_walks_the_shipped_schema():
    """Every top-level key of the shipped report.json schema is a row, nested keys as `a.b` and `a[].b`, each
    with its description."""
    from simtrain.report.schema import report_schema

    page = _reference_hook().report_page()
    rows = {line.split(" | ")[0][3:-1]: line for line in page.splitlines() if line.startswith("| `")}
    assert set(report_schema()["properties"]) <= set(rows)
    assert rows["flops.mfu"].endswith("| model FLOPs utilization: model FLOPs / (time x the devices' peak) |")
    assert rows["devices[].rank"] == "| `devices[].rank` | int | the device's global rank on the cluster |"
    assert rows["parallel.bubble_fraction"].startswith("| `parallel.bubble_fraction` | number |")
