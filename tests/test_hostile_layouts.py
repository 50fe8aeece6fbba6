"""Hostile input for the keys added since tests/test_hostile_surfaces.py's pass (issue 31): context and expert
parallelism (parallel.cp, parallel.ep), the fleet section (fleet.*), the topology builders' keys
(cluster.leaves_per_pod, nodes_per_leaf, oversubscription; a topology file's reducing_switches), lost devices
and checkpoints where no rank holds its own state (representatives), and `simtrain collective`'s --op/--algo/--protocol.

Each is validation only, no run: one line naming its key or option, exit code 2, nothing written (the contract
of simtrain/errors.py, as in test_hostile_input.py).
"""
import pytest

from test_hostile_input import one_line_error

MLP = "cluster: {devices: 4}\nmodel: {hidden: [8]}\ntrain: {steps: 1}\nreport: {trace: false}\n"
GPT = ("cluster: {devices: 4}\ndata: {name: tokens, seq_len: 16}\ntrain: {steps: 1}\nreport: {trace: false}\n"
       "model: {name: gpt, hidden: 32, layers: 2, heads: 4}\n")
MOE = ("cluster: {devices: 4}\ndata: {name: tokens, seq_len: 16}\ntrain: {steps: 1}\nreport: {trace: false}\n"
       "model: {name: gpt, hidden: 32, layers: 2, heads: 4, moe: {experts: 4}}\n")
HUGE = "1000000000000000000000000000000"
LOST = "cluster: {devices: 5, spares: 1, faults: [{at: 1 ms, device: 1, fail: true}]}\n"


def fleet(fields: str) -> str:
    return MLP + f"fleet: {{{fields}}}\n"


def clos3(fields: str) -> str:
    return (f"cluster: {{devices: 32, topology: clos3, gpus_per_node: 8, {fields}}}\nmodel: {{hidden: [8]}}\n"
            "train: {steps: 1}\nreport: {trace: false}\n")


HOSTILE_SCENARIOS = [
    # parallel.cp
    *[(GPT + f"parallel: {{cp: {v}}}\n", "parallel.cp") for v in ("0", "-1", "1.5", "x", "true", ".inf", HUGE)],
    (GPT + "parallel: {cp: 3}\n", "parallel"),  # 3 does not divide the 4 devices
    (MLP + "parallel: {cp: 2}\n", "parallel.cp"),  # an mlp has no sequence
    (GPT + "data: {name: tokens, seq_len: 15}\nparallel: {cp: 2}\n", "parallel.cp"),  # 15 tokens, 4 chunks
    # parallel.ep
    *[(MOE + f"parallel: {{ep: {v}}}\n", "parallel.ep") for v in ("0", "-1", "1.5", "x", "true", ".inf", HUGE)],
    (MOE + "parallel: {ep: 3}\n", "parallel.ep"),
    (GPT + "parallel: {ep: 2}\n", "parallel.ep"),  # no experts to shard
    # fleet
    *[(fleet(f"horizon: {v}"), "fleet.horizon") for v in ("0", "-1", ".inf", ".nan", "x", HUGE)],
    *[(fleet(f"target_steps: {v}"), "fleet.target_steps") for v in ("0", "-1", "1.5", "x", HUGE)],
    *[(fleet(f"seed: {v}"), "fleet.seed") for v in ("-1", "1.5", "x", HUGE)],
    *[(fleet(f"gpus_per_host: {v}"), "fleet.gpus_per_host") for v in ("0", "-1", "x", HUGE)],
    *[(fleet(f"spares: {v}"), "fleet.spares") for v in ("-1", "1.5", "x", HUGE)],
    *[(fleet(f"components: {{gpu: {{mtbf: {v}}}}}"), "fleet.components.gpu.mtbf") for v in ("0", "-1", ".nan", "x")],
    *[(fleet(f"components: {{host: {{repair: {v}}}}}"), "fleet.components.host.repair") for v in ("-1", ".inf", "x")],
    (fleet("components: {toaster: {mtbf: 1 h}}"), "fleet.components.toaster"),
    (fleet("failures: [{at: 1 h, component: toaster}]"), "fleet.failures.0.component"),
    (fleet("failures: [{at: -1, component: gpu}]"), "fleet.failures.0.at"),
    (fleet("failures: [{at: 1 h, component: gpu, unit: -1}]"), "fleet.failures.0.unit"),
    (fleet("failures: [{at: 2 h, component: gpu}, {at: 1 h, component: gpu}]"),
     "fleet.failures.1.at: failures must be in time order"),
    (fleet("failures: 3"), "fleet.failures"),
    *[(fleet(f"stragglers: {{mtbf: 1 h, slowdown: {v}, duration: 1 min}}"), "fleet.stragglers.slowdown")
      for v in ("1", "0.5", ".nan", "x", HUGE)],
    (fleet("stragglers: {mtbf: 1 h, slowdown: 2}"), "fleet.stragglers.duration"),
    *[(fleet(f"checkpoint: {{interval: {v}}}"), "fleet.checkpoint.interval") for v in ("0", "-1", ".inf", "x")],
    (fleet("checkpoint: {mode: sometimes}"), "fleet.checkpoint.mode"),
    *[(fleet(f"checkpoint: {{storage_bandwidth: {v}}}"), "fleet.checkpoint.storage_bandwidth")
      for v in ("0", "-1", "x")],
    *[(fleet(f"checkpoint: {{replicas: {v}}}"), "fleet.checkpoint.replicas") for v in ("-1", "9", "x")],
    *[(fleet(f"recovery: {{detection: {v}}}"), "fleet.recovery.detection") for v in ("-1", ".inf", "x")],
    (fleet("") + "parallel: {mode: async}\n", "fleet"),
    (fleet("") + "train: {steps: 1, checkpoint: {every: 1}}\n", "train.checkpoint: not with fleet"),
    # the topology builders' keys
    *[(clos3(f"leaves_per_pod: {v}"), "cluster.leaves_per_pod") for v in ("0", "-1", "1.5", "x", HUGE)],
    *[(clos3(f"nodes_per_leaf: {v}"), "cluster.nodes_per_leaf") for v in ("0", "-1", "x", HUGE)],
    *[(clos3(f"oversubscription: {v}"), "cluster.oversubscription") for v in ("0", "0.5", ".nan", "x", HUGE)],
    # lost devices and checkpoints where a rank's own state is not simulated
    (LOST + "model: {hidden: [8, 8]}\ntrain: {steps: 1}\nnumerics: false\nparallel: {pp: 2, representatives: true}\n",
     "parallel.representatives: does not run with faults"),
    ("cluster: {devices: 4}\nmodel: {hidden: [8, 8]}\ntrain: {steps: 1, checkpoint: {every: 1}}\nnumerics: false\n"
     "parallel: {pp: 2, representatives: true}\n", "parallel.representatives: does not run with train.checkpoint"),
]


@pytest.mark.parametrize("text,expected", HOSTILE_SCENARIOS, ids=range(len(HOSTILE_SCENARIOS)))
def test_hostile_values_of_newer_keys_are_one_line(tmp_path, capsys, text, expected):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    assert expected in one_line_error(capsys, "validate", path)


TOPOLOGY = "name: t\ngpus: 2\nswitches: [sw]\nlinks: [[gpu0, sw, nvlink], [gpu1, sw, nvlink]]\n" \
           "link_classes: {nvlink: {bandwidth: 100 GB/s, latency: 1 us}}\n"


@pytest.mark.parametrize("extra,expected", [
    ("reducing_switches: [gpu0]", "reducing_switches"),
    ("reducing_switches: [nowhere]", "reducing_switches"),
    ("reducing_switches: sw", "reducing_switches"),
    ("reducing_switches: [[sw]]", "reducing_switches"),
])
def test_hostile_reducing_switches_are_one_line(tmp_path, capsys, extra, expected):
    topology = tmp_path / "t.yaml"
    topology.write_text(TOPOLOGY + extra + "\n")
    path = tmp_path / "s.yaml"
    path.write_text(f"cluster: {{topology: {topology}, devices: 2}}\nmodel: {{hidden: [8]}}\ntrain: {{steps: 1}}\n")
    assert expected in one_line_error(capsys, "run", path, "-q", "--out", tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args,expected", [
    (["--op", "all_shuffle"], "--op"),
    (["--op", ""], "--op"),
    (["--algo", "spiral"], "--algo"),
    (["--protocol", "LL256"], "--protocol"),
    (["--protocol", "ll"], "--protocol"),
    (["--op", "broadcast", "--algo", "ring", "--protocol", "LL", "--channels", "-1"], "--channels"),
])
def test_hostile_collective_options_are_one_line(capsys, args, expected):
    command = ["collective", "--devices", "4", "--sizes", "1K:1K", *args]
    assert expected in one_line_error(capsys, *command)
