"""`simtrain import`: a torchtitan TOML, Megatron-LM's arguments or a Megatron-Bridge recipe as a scenario file.
cli.py adds the group to the command line; the importers are simtrain/importers/.

    simtrain import torchtitan scenarios/torchtitan/llama3_8b.toml --devices 64 --out llama3_8b.yaml
    simtrain import megatron --devices 8 --out gpt.yaml -- --num-layers 32 --hidden-size 4096 ...
    simtrain import megatron --args-file pretrain_args.txt --devices 16 --out gpt.yaml
    simtrain import megatron --recipe llama3_8b_pretrain_config --steps 2 train.global_batch_size=64 --out llama3.yaml

The scenario is validated before it is written; every field of the source that is not carried over is printed
(on standard error) and written as a comment at the top of the file. Without --out the YAML goes to standard
output.
"""
import shlex

import click

from .errors import ConfigImportError, SimtrainError, one_line
from .importers import DEFAULT_DEVICES, Imported, not_carried_lines
from .limits import MAX_DEVICES, MAX_STEPS
from .user_files import read_text_file, user_path
from .views import console

_devices = click.option("--devices", type=click.IntRange(1, MAX_DEVICES), default=DEFAULT_DEVICES,
                        show_default=True, help="The world size (torchrun's; the config does not hold it).")
_cluster = click.option("--cluster", "cluster_file", default=None, metavar="SCENARIO",
                        help="Take the cluster section of this scenario file [default: DGX H100 hosts, as "
                             "scenarios/megatron-core-h100].")
_steps = click.option("--steps", type=click.IntRange(1, MAX_STEPS), default=None,
                      help="train.steps, in place of the config's (a few steps time the step) [default: the config's].")
_out = click.option("--out", "out_file", default=None, help="The scenario file to write [default: standard output].")


@click.group(name="import")
def import_group():
    """Write a scenario from a torchtitan or Megatron config."""


@import_group.command()
@click.argument("toml_file")
@_devices
@_steps
@_cluster
@_out
def torchtitan(toml_file, devices, steps, cluster_file, out_file):
    """A torchtitan job config (TOML, as torchtitan up to 0.2 reads with --job.config_file)."""
    from .importers.torchtitan import import_torchtitan

    _write(import_torchtitan(toml_file, devices, cluster_file, steps), out_file)


@import_group.command(context_settings={"ignore_unknown_options": True})
@click.argument("arguments", nargs=-1, type=click.UNPROCESSED)
@click.option("--recipe", default=None, help="A Megatron-Bridge recipe (llama3_8b_pretrain_config, "
                                             "llama3_70b_pretrain_config); ARGUMENTS are its overrides, "
                                             "section.field=value.")
@click.option("--args-file", default=None, help="A file of pretrain_gpt.py's arguments (shell quoting; a launcher "
                                                "and its script before them are skipped); ARGUMENTS follow them.")
@_devices
@_steps
@_cluster
@_out
def megatron(arguments, recipe, args_file, devices, steps, cluster_file, out_file):
    """Megatron-LM's pretrain_gpt.py arguments (after --, or --args-file) or a Megatron-Bridge recipe."""
    from .importers.megatron import import_megatron_args
    from .importers.megatron_recipes import import_megatron_recipe

    arguments = list(arguments)
    if recipe is not None:
        if args_file is not None:
            raise SimtrainError("--args-file: a recipe takes overrides (section.field=value), not arguments")
        imported = import_megatron_recipe(recipe, arguments, devices, cluster_file, steps)
    else:
        source = "arguments"
        if args_file is not None:
            path = user_path(args_file, "--args-file", ConfigImportError)
            source = str(path)
            try:
                text = read_text_file(path, source, ConfigImportError).replace("\\\n", " ")  # continued lines
                arguments = shlex.split(text, comments=True) + arguments
            except ValueError as error:  # an unclosed quote
                raise ConfigImportError(f"{source}: cannot split into arguments ({error})") from None
        if not arguments:
            raise SimtrainError("simtrain import megatron: give pretrain_gpt.py's arguments after --, --args-file, "
                                "or --recipe")
        imported = import_megatron_args(arguments, devices, cluster_file, source, steps)
    _write(imported, out_file)


def _write(imported: Imported, out_file: str | None) -> None:
    """Validate the scenario, name what was not carried over (standard error), write the YAML."""
    imported.scenario()
    for line in not_carried_lines(imported.not_carried):
        click.echo(line, err=True)
    text = imported.to_yaml()
    if out_file is None:
        click.echo(text, nl=False)
        return
    path = user_path(out_file, "--out")
    try:
        path.write_text(text)
    except OSError as error:
        raise SimtrainError(f"--out: cannot write {path} ({one_line(error.strerror or str(error))})") from None
    console.print(f"wrote {path}: simtrain run {path}", soft_wrap=True, markup=False, highlight=False)
