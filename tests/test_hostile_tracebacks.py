"""The two tracebacks issue 55 found still left on valid-looking input: a topology file whose link class is a list
or a mapping (a TypeError, through every command that reads a topology file), and `simtrain memory` on a large ring
(std::bad_alloc: each rank's replayed ring all-reduce cut its buffer into one view per rank, N x N views held at
once, where the run times the ring for its group at once).

The contract is simtrain/errors.py's, as in test_hostile_input.py: one line naming the file and field, exit code
2; a valid job runs.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from simtrain import memory_plan
from simtrain.hw import ring_timing
from test_hostile_input import cli, one_line_error

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ("gpus: [a, b]\nlink_classes: {fast: {bandwidth: 100 GB/s, latency: 1 us}}\n"
            "links: [{between: [a, b], class: %s}]\n")


@pytest.mark.parametrize("link_class,shown", [("[fast]", "list ['fast']"), ("{fast: 1}", "dict {'fast': 1}"),
                                              ("{a: 1}", "dict {'a': 1}")])
@pytest.mark.parametrize("command", ["run", "validate", "topo", "collective"])
def test_a_link_class_that_is_no_name_is_one_line_through_every_command(tmp_path, capsys, command, link_class, shown):
    topology = tmp_path / "t.yaml"
    topology.write_text(TOPOLOGY % link_class)
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"cluster: {{topology: {topology}}}\nmodel: {{hidden: [8]}}\ntrain: {{steps: 1}}\n"
                        "report: {trace: false}\n")
    args = {"run": ["run", scenario, "-q", "--out", tmp_path / "out"], "validate": ["validate", scenario],
            "topo": ["topo", "--topology", topology],
            "collective": ["collective", "--topology", topology, "--sizes", "1K:1K"]}[command]
    named = f"{scenario}: " if command in ("run", "validate") else ""
    assert one_line_error(capsys, *args) == (f"error: {named}topology file {topology}: links[0].class: expected the "
                                             f"name of a link class, got {shown}")
    assert not (tmp_path / "out").exists()


# 1,000 ring devices: the memory replay held 1,000 x 1,000 chunk views, ~650 MiB more than the ~150 MiB it needs
# now (measured 2026-12-07: peak RSS 957 MiB before, 385 MiB after, of which ~230 MiB torch and simtrain loaded);
# under a 320 MiB bound on the process's data it ended in "RuntimeError: std::bad_alloc" before.
RING_DEVICES, DATA_BOUND_MIB = 1000, 320
REPLAY_UNDER_A_BOUND = textwrap.dedent("""
    import resource, sys
    import torch._dynamo  # loaded by the first replay anyway: before the bound, which is for the replay's own data
    from simtrain.memory_plan import plan_memory
    from simtrain.scenario import validate_scenario

    devices, bound_mib = int(sys.argv[1]), int(sys.argv[2])
    scenario = validate_scenario({"cluster": {"devices": devices, "topology": "ring"}, "model": {"hidden": [8]},
                                  "numerics": False})
    data_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmData"))
    limit = (data_kib + bound_mib * 1024) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    plans = plan_memory(scenario)
    print(len(plans), plans[0].peak_bytes, plans[-1].peak_bytes)
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmData from Linux's /proc")
def test_the_memory_plan_of_a_large_ring_holds_no_view_per_pair_of_ranks():
    result = subprocess.run([sys.executable, "-c", REPLAY_UNDER_A_BOUND, str(RING_DEVICES), str(DATA_BOUND_MIB)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    devices, first_peak, last_peak = map(int, result.stdout.split())
    # every device holds the mlp's weights and gradients (610 parameters, fp32), its activations and nothing else:
    # the same on each, as a run's report says (test_memory_techniques.py checks the categories)
    assert devices == RING_DEVICES and first_peak == last_peak > 2 * 610 * 4


def test_a_ring_past_its_position_steps_is_one_line_and_replayed_once(tmp_path, capsys, monkeypatch):
    """A ring whose positions differ (a buffer that does not split evenly) is timed position by position, N x 2(N - 1)
    steps (hw/ring_timing.py): past limits.MAX_RING_POSITION_STEPS (here lowered to one less than a 20-rank ring's
    760) `simtrain memory` refuses it in one line, after one replay: the memory plan does not go on to replay every
    rank, which would meet the same bound after minutes (100,000 ring devices: 13 s to the line, 3.5 min before).
    At the bound it plans."""
    replays = []
    replay_step = memory_plan.replay_step
    monkeypatch.setattr(memory_plan, "replay_step", lambda *args: replays.append(args) or replay_step(*args))
    monkeypatch.setattr(ring_timing, "MAX_RING_POSITION_STEPS", 20 * 2 * 19 - 1)
    scenario = tmp_path / "ring.yaml"
    scenario.write_text("cluster: {devices: 20, topology: ring}\nmodel: {hidden: [8]}\nnumerics: false\n")
    assert one_line_error(capsys, "memory", scenario, "--no-search") == (
        f"error: {scenario}: a ring of 20 ranks whose positions differ (its buffer splits into chunks of 120 and 124 "
        "bytes) is timed position by position: 760 position-steps, past the 759 simtrain times (limits.py): run "
        "fewer ranks in one ring")
    assert len(replays) == 1
    monkeypatch.setattr(ring_timing, "MAX_RING_POSITION_STEPS", 20 * 2 * 19)
    assert cli("memory", scenario, "--no-search") == 0
