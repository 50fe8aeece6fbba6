"""Configs people already have, as simtrain scenarios: torchtitan's TOML job configs, Megatron-LM's
pretrain_gpt.py arguments and Megatron-Bridge's Llama 3 recipes (`simtrain import`, cli_import.py).

Every field that maps is carried over; every one that does not is named, with the reason, in the Imported's
`not_carried` (printed, and written at the top of the scenario file). A config that cannot be read or mapped is
one ConfigImportError line naming the file and the field.

    from simtrain.importers.torchtitan import import_torchtitan
    imported = import_torchtitan("scenarios/torchtitan/llama3_8b.toml", devices=64)
    scenario = imported.scenario()            # the validated Scenario
    open("llama3_8b.yaml", "w").write(imported.to_yaml())

Modules: imported.py (the result, the cluster, bounds), torchtitan.py, megatron.py (arguments),
megatron_recipes.py (Megatron-Bridge recipes); megatron_flags.txt is Megatron-LM's flag list.
"""
from .imported import DEFAULT_CLUSTER, DEFAULT_DEVICES, Imported, NotCarried, not_carried_lines

__all__ = ["DEFAULT_CLUSTER", "DEFAULT_DEVICES", "Imported", "NotCarried", "not_carried_lines"]
