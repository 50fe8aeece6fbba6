"""Fleet mode (simtrain/fleet/), against closed forms and against the full simulation.

- Young's (sqrt(2 delta M)) and Daly's optimum checkpoint intervals: the interval that maximizes the effective
  training time the fleet mode measures, on a model with one failure class, is within 5% of them (and Young's is
  off by more where delta / M is large, as Daly showed).
- The full simulation (every step simulated, device losses through hw/faults.py and recovery.py) and the fleet
  mode, replaying the same failures around the measured step, finish at the same time within 1%.
- Closed forms: every second is training or lost to one phase; sync and async checkpoints' overhead; a straggler's
  share of the time (the slow GPUs are an M/G/infinity queue); the spare pool's wait; replicas in peers' memory.
- The blast radius on a DGX SuperPOD scalable unit: a leaf takes its 20 hosts, a GPU its host.
- Hostile input for every new key: one line naming the field, exit 2; random mutations of the section validate
  or are one line.
"""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq

from simtrain import load_scenario, run
from simtrain.cli import main
from simtrain.errors import ScenarioError
from simtrain.fleet.costs import Costs
from simtrain.fleet.inventory import Inventory
from simtrain.fleet.simulation import PHASES, FleetRun
from simtrain.hw.topology_builders import build_topology, load_topology_file, parse_link
from simtrain.scenario import validate_scenario
from simtrain.scenario.fleet import FleetSpec
from simtrain.user_files import parse_yaml_text

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "scenarios" / "quickstart.yaml")
GPUS = 8
OTHERS_NEVER_FAIL = {name: {"mtbf": None} for name in ("hbm", "nic", "host", "cable", "software", "sdc",
                                                       "maintenance")}


def switch_inventory(gpus_per_host: int = 1) -> Inventory:
    return Inventory(build_topology("switch", GPUS, parse_link({"bandwidth": 1e9, "latency": 0}, "link")),
                     gpus_per_host)


def fleet_run(spec: dict, bytes_per_gpu: float, step_time_s: float = 1.0, gpus_per_host: int = 1) -> FleetRun:
    fleet = FleetSpec.model_validate(spec)
    inventory = switch_inventory(gpus_per_host)
    run_ = FleetRun(fleet, inventory, Costs.of(fleet, inventory.gpus, bytes_per_gpu), step_time_s, seed=0)
    run_.run()
    return run_


def single_class(job_mtbf_s: float, delta_s: float, interval_s: float, horizon_s: float) -> dict:
    """One failure class (GPUs), a sync checkpoint of delta_s (8 GPUs sharing 1 GB/s), a restart of 100 s + delta."""
    return {"horizon": horizon_s, "components": {"gpu": {"mtbf": GPUS * job_mtbf_s}, **OTHERS_NEVER_FAIL},
            "checkpoint": {"interval": interval_s, "mode": "sync", "storage_bandwidth": 1e9, "latency": 0},
            "recovery": {"detection": 0, "relaunch": 100, "init_per_gpu": 0}}


def fleet_optimum(job_mtbf_s: float, delta_s: float, failures: int) -> float:
    """The interval of the highest effective training time, from a parabola through seven intervals (log scale)
    around Young's; the same failures for each (one seed)."""
    young = math.sqrt(2 * delta_s * job_mtbf_s)
    intervals = young * np.exp(np.linspace(-0.6, 0.6, 7))
    efficiency = []
    for interval in intervals:
        run_ = fleet_run(single_class(job_mtbf_s, delta_s, interval, failures * job_mtbf_s), delta_s * 1e9 / GPUS)
        efficiency.append(run_.progress / run_.end_s)
    a, b, _ = np.polyfit(np.log(intervals), efficiency, 2)
    assert a < 0
    return math.exp(-b / (2 * a))


def young(delta: float, mtbf: float) -> float:
    return math.sqrt(2 * delta * mtbf)


def daly(delta: float, mtbf: float) -> float:
    return young(delta, mtbf) * (1 + math.sqrt(delta / (2 * mtbf)) / 3 + delta / (18 * mtbf)) - delta


def test_the_optimum_interval_is_youngs_where_a_checkpoint_is_short():
    mtbf, delta = 1e4, 20.0  # delta / M = 0.002
    measured = fleet_optimum(mtbf, delta, failures=1500)
    assert measured == pytest.approx(young(delta, mtbf), rel=0.05)
    assert measured == pytest.approx(daly(delta, mtbf), rel=0.05)


def test_the_optimum_interval_is_dalys_where_a_checkpoint_is_long():
    mtbf, delta = 1e4, 1000.0  # delta / M = 0.1: Young's first-order interval is 17% too long
    measured = fleet_optimum(mtbf, delta, failures=3000)
    assert measured == pytest.approx(daly(delta, mtbf), rel=0.05)
    assert abs(measured / young(delta, mtbf) - 1) > 0.05
    # Daly's is the exact optimum of his model (exponential failures, also during restarts) within 0.1%
    exact = brentq(lambda t: math.exp((t + delta) / mtbf) * (1 - t / mtbf) - 1, 1e-9, mtbf)
    assert daly(delta, mtbf) == pytest.approx(exact, rel=1e-3)


@pytest.mark.parametrize("first,second", [(0.0021, 0.0047), (0.0021, 0.1025), (0.0013, 0.10215)],
                         ids=["second-during-detection", "second-after-restart", "second-just-after-restart"])
def test_fleet_mode_equals_the_full_simulation(first, second):
    """Two lost GPUs, sync checkpoints every 10 steps to host memory, 40 steps: the full simulation restarts on
    spares and redoes the steps for real; the fleet mode replays the same failures around the measured step."""
    common = ["cluster.topology=switch", "train.steps=40", "report.trace=false", "model.hidden=[64]"]
    full = run(load_scenario(QUICKSTART, common + [
        "cluster.devices=6", "cluster.spares=2", "train.checkpoint={every: 10}",
        f"cluster.faults=[{{at: {first}, device: 0, fail: true}}, {{at: {second}, device: 2, fail: true}}]"])).data
    step_time_s = full["faults"]["fault_free_time_s"] / 40
    fleet = (f"fleet={{horizon: 10, target_steps: 40, gpus_per_host: 1, failures: [{{at: {first}, component: gpu}}, "
             f"{{at: {second}, component: gpu, unit: 2}}], checkpoint: {{interval: {10 * step_time_s!r}, mode: sync, "
             f"bytes_per_gpu: {full['faults']['checkpoint_bytes_per_rank']}, storage_bandwidth: {4 * 31.5e9!r}}}, "
             "recovery: {detection: 0.1, relaunch: 0, init_per_gpu: 0}}")
    report = run(load_scenario(QUICKSTART, common + ["cluster.devices=4", fleet])).data["fleet"]
    assert full["faults"]["restarts"] >= 1
    assert report["step_time_s"] == pytest.approx(step_time_s, rel=1e-9)
    assert report["interruptions"] == 2
    assert report["completion_time_s"] == pytest.approx(full["sim_time_s"], rel=0.01)


def test_every_second_is_training_or_lost_to_one_phase():
    """The default (Llama 3) rates on 8 GPUs for a year, async checkpoints, a spare pool of one host, slow GPUs."""
    spec = {"horizon": "365 d", "spares": 1, "components": {"gpu": {"mtbf": "2000 h", "repair": "3 d"}},
            "stragglers": {"mtbf": "500 h", "slowdown": 1.5, "duration": "2 h"}}
    run_ = fleet_run(spec, 1e9, step_time_s=3.0, gpus_per_host=4)
    assert sum(run_.interruptions.values()) > 10 and run_.lost_by_phase["waiting_for_spares"] > 0
    assert run_.lost_by_phase["stragglers"] > 0
    assert run_.progress * 3.0 + sum(run_.lost_by_phase.values()) == pytest.approx(run_.end_s, rel=1e-9)
    restarts_and_redone = sum(run_.lost_by_phase[phase] for phase in PHASES[:6])
    assert sum(run_.lost_by_cause.values()) == pytest.approx(restarts_and_redone, rel=1e-9)
    again = fleet_run(spec, 1e9, step_time_s=3.0, gpus_per_host=4)  # seeded: the same run
    assert (again.progress, again.interruptions) == (run_.progress, run_.interruptions)


NEVER = {name: {"mtbf": None} for name in ("gpu", *OTHERS_NEVER_FAIL)}


@pytest.mark.parametrize("mode,background_s,expected", [
    ("sync", None, 100 / (100 + 8.0)),  # every GPU writes 1 GB at once to 1 GB/s storage
    ("async", 50.0, 100 / (100 + 0.5)),  # only the snapshot (1 GB at 2 GB/s) blocks
    ("async", 400.0, 100 / (0.5 + 400)),  # the next checkpoint waits for the write in flight
])
def test_checkpoint_overhead_without_failures(mode, background_s, expected):
    bandwidth = 8e9 / background_s if background_s else 1e9
    spec = {"horizon": "30 d", "components": NEVER, "checkpoint": {
        "interval": 100, "mode": mode, "storage_bandwidth": bandwidth, "host_bandwidth": 2e9, "latency": 0}}
    run_ = fleet_run(spec, 1e9)
    assert run_.progress / run_.end_s == pytest.approx(expected, rel=1e-3)


def test_stragglers_take_the_time_an_m_g_infinity_queue_says():
    """Slowdowns start at rate GPUS / mtbf and last d: the chance that some GPU is slow is 1 - exp(-GPUS d / mtbf);
    the step runs at half speed then."""
    spec = {"horizon": "2000 d", "components": NEVER, "checkpoint": {"interval": "1 d"},
            "stragglers": {"mtbf": "100 h", "slowdown": 2, "duration": "5 h"}}
    run_ = fleet_run(spec, 1.0, step_time_s=10.0)
    slow = 1 - math.exp(-GPUS * 5 / 100)
    assert run_.progress * 10.0 / run_.end_s == pytest.approx(1 - slow / 2, rel=0.01)


def test_a_host_waits_for_a_repair_when_the_pool_is_empty():
    spec = {"horizon": "10 d", "spares": 0, "components": NEVER, "failures": [{"at": 3601, "component": "host"}],
            "checkpoint": {"interval": 600, "mode": "sync", "latency": 0},
            "recovery": {"detection": 60, "relaunch": 30, "init_per_gpu": 0.5}}
    spec["components"] = {**NEVER, "host": {"repair": "1 d"}}
    run_ = fleet_run(spec, 1e9, gpus_per_host=4)
    assert run_.lost_by_phase["detection"] == 60
    assert run_.lost_by_phase["waiting_for_spares"] == pytest.approx(86400 - 60)
    assert run_.lost_by_phase["communicator_init"] == pytest.approx(0.5 * GPUS)
    # six sync writes of 8 GB at 2 TB/s (0.004 s each) before it, the last one at step 3600: 0.976 steps lost
    assert run_.lost_by_phase["work_redone"] == pytest.approx(3601 - (3600 + 6 * 0.004))
    assert run_.hosts_replaced == 1


@pytest.mark.parametrize("component,unit,from_memory", [("gpu", 5, True), ("leaf", 0, False)])
def test_a_restart_reads_a_peers_copy_unless_the_failure_took_more_hosts_than_copies(component, unit, from_memory):
    spec = {"horizon": "1 d", "components": NEVER, "failures": [{"at": 1000, "component": component, "unit": unit}],
            "checkpoint": {"interval": 300, "mode": "async", "replicas": 1, "storage_bandwidth": 1e9,
                           "peer_bandwidth": 1e10, "latency": 0}}
    run_ = fleet_run(spec, 1e9, gpus_per_host=2)
    expected = 1e9 / 1e10 if from_memory else 8 * 1e9 / 1e9
    assert run_.lost_by_phase["checkpoint_load"] == pytest.approx(expected)


def test_blast_radius_on_a_superpod_scalable_unit():
    topology = load_topology_file(ROOT / "topologies" / "dgx-a100-superpod-su.yaml")
    inventory = Inventory(topology, 8)
    assert inventory.counts() == {"gpu": 160, "hbm": 160, "nic": 160, "nvswitch": 20, "host": 20, "cable": 168,
                                  "leaf": 8, "spine": 1, "storage": 1, "software": 20, "sdc": 160,
                                  "maintenance": 1}
    assert inventory.hosts_lost("leaf", 3) == tuple(range(20))  # a rail's leaf: one NIC of every host
    assert inventory.hosts_lost("gpu", 17) == (2,)
    lost = sorted({inventory.hosts_lost("cable", unit) for unit in range(168)})
    assert lost == [(), *((host,) for host in range(20))]  # a leaf's uplink takes no host
    assert inventory.hosts_lost("spine", 0) == () and inventory.hosts_lost("software", 4) == ()


def test_run_and_sweep_report_the_fleet(tmp_path, capsys):
    """`simtrain run` draws the fleet's figure; `simtrain sweep` (in this process: `--workers 1`, two spawned
    workers would import torch again) gives each checkpoint mode's effective training time."""
    fleet = "fleet={horizon: 20 d, components: {gpu: {mtbf: 300 h}}}"
    with pytest.raises(SystemExit) as exit_code:
        main(["run", QUICKSTART, "--set", "train.steps=3", "--set", "report.trace=false", "--set", fleet, "--out", str(tmp_path / "run"), "-q"])
    assert exit_code.value.code == 0
    assert (tmp_path / "run" / "fleet.png").stat().st_size > 0
    with pytest.raises(SystemExit) as exit_code:
        main(["sweep", QUICKSTART, "--set", "train.steps=3", "--set", "report.trace=false", "--set", fleet, "--grid",
              "fleet.checkpoint.mode=sync,async", "--metric", "effective_training_time", "--workers", "1",
              "--out", str(tmp_path / "s")])
    assert exit_code.value.code == 0
    rows = (tmp_path / "s" / "sweep.csv").read_text().splitlines()
    assert len(rows) == 3 and all(row.split(",")[-2] for row in rows[1:])


HOSTILE = [
    ("fleet.horizon=-1", "fleet.horizon: must not be negative"),
    ("fleet.horizon=0", "fleet.horizon: Input should be greater than 0"),
    ("fleet.horizon=true", "fleet.horizon: expected a time quantity, got True"),
    ("fleet.horizon=.inf", "fleet.horizon: must be a finite number"),
    ("fleet.horizon=1e12", "fleet.horizon: '1e12' is outside the range simtrain takes"),
    ("fleet={horizon: 3 weeks}", "fleet.horizon: unit 'weeks'"),
    ("fleet.target_steps=0", "fleet.target_steps: Input should be greater than or equal to 1"),
    ("fleet.seed=-3", "fleet.seed: Input should be greater than or equal to 0"),
    ("fleet.gpus_per_host=3", "fleet.gpus_per_host: 4 GPUs do not split into hosts of 3"),
    ("fleet.spares=-1", "fleet.spares: Input should be greater than or equal to 0"),
    ("fleet={components: {gpus: {mtbf: 1}}}", "unknown field; did you mean `fleet.components.gpu`?"),
    ("fleet={components: {gpu: {mtbf: 0}}}", "fleet.components.gpu.mtbf: Input should be greater than 0"),
    ("fleet={components: {leaf: {repair: x}}}", "fleet.components.leaf.repair: cannot read 'x'"),
    ("fleet={components: {gpu: 3}}", "fleet.components.gpu: Input should be a valid dictionary"),
    ("fleet={failures: [{at: 5, component: tpu}]}", "fleet.failures.0.component: Input should be"),
    ("fleet={failures: [{at: 5, component: gpu, unit: 4}]}", "fleet.failures.0.unit: no gpu 4 (the job has 4, 0 to 3)"),
    ("fleet={failures: [{at: 5, component: spine}]}", "fleet.failures.0.unit: no spine 0 (the job has 0)"),
    ("fleet={failures: [{at: 5, component: gpu}, {at: 4, component: gpu}]}", "fleet.failures.1.at: failures must"),
    ("fleet={stragglers: {mtbf: 1 h, slowdown: 1, duration: 1 h}}", "fleet.stragglers.slowdown: Input should be "
                                                                    "greater than 1"),
    ("fleet={stragglers: {mtbf: 1 h}}", "fleet.stragglers.slowdown: Field required"),
    ("fleet={checkpoint: {mode: never}}", "fleet.checkpoint.mode: Input should be 'sync' or 'async'"),
    ("fleet={checkpoint: {replicas: 9}}", "fleet.checkpoint.replicas: Input should be less than or equal to 8"),
    ("fleet={checkpoint: {interval: 0}}", "fleet.checkpoint.interval: Input should be greater than 0"),
    ("fleet={checkpoint: {storage_bandwidth: 0}}", "fleet.checkpoint.storage_bandwidth: Input should be greater"),
    ("fleet={recovery: {detection: -5}}", "fleet.recovery.detection: must not be negative"),
    ("fleet={recovery: {init_per_gpu: 2e6}}", "fleet.recovery.init_per_gpu: '2e6' is outside the range"),
    ("fleet={checkpoint: {interval: 1e-9}}", "fleet.horizon: about"),
    ("fleet={components: {gpu: {mtbf: 1e-3}}}", "fleet.horizon: about"),
    ("fleet=7", "fleet: Input should be a valid dictionary"),
    ("fleet.preset=llama4", "fleet.preset: Input should be 'llama3-405b', 'meta-rsc1' or 'meta-rsc2'"),
    ("fleet={preset: [1]}", "fleet.preset: Input should be"),
    ("fleet={components: {sdc: {detection: -1}}}", "fleet.components.sdc.detection: must not be negative"),
    ("fleet={stragglers: {mtbf: 1 h, slowdown: 2, duration: 1 h, fails: 1.5}}", "fleet.stragglers.fails: Input "
                                                                               "should be less than or equal to 1"),
    ("fleet={checkpoint: {interval: youngest}}", "fleet.checkpoint.interval: cannot read 'youngest'"),
    ("fleet={checkpoint: {interval: [1]}}", "fleet.checkpoint.interval: expected a time quantity"),
    ("fleet={failures: [{at: 5, component: maintenance, unit: 1}]}", "fleet.failures.0.unit: no maintenance 1"),
]


@pytest.mark.parametrize("override,expected", HOSTILE, ids=[override for override, _ in HOSTILE])
def test_hostile_fleet_input_is_one_line(tmp_path, capsys, override, expected):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_code:
        main(["run", QUICKSTART, "--set", "train.steps=2", "--set", "report.trace=false", "--set", override,
              "--out", str(out), "-q"])
    err = capsys.readouterr().err.strip()
    assert exit_code.value.code == 2, err
    assert err.startswith("error: ") and "\n" not in err and expected in err, err
    assert not (out / "report.json").exists()


@pytest.mark.parametrize("field,value", [("cluster.faults", "[{at: 1, device: 0, fail: true}]"),
                                         ("cluster.spares", "1"), ("train.checkpoint", "{every: 5}"),
                                         ("cluster.random_faults", "{device_mtbf: 10}")])
def test_fleet_refuses_the_full_simulations_faults(capsys, field, value):
    with pytest.raises(SystemExit) as exit_code:
        main(["validate", QUICKSTART, "--set", "fleet={}", "--set", f"{field}={value}"])
    err = capsys.readouterr().err.strip()
    assert exit_code.value.code == 2
    assert f"{field}: not with fleet" in err and "\n" not in err


FLEET_DEFAULTS = FleetSpec().model_dump(mode="json")


def leaf_paths(node, prefix=()):
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from leaf_paths(value, (*prefix, key))
    else:
        yield prefix


FLEET_PATHS = sorted(leaf_paths(FLEET_DEFAULTS)) + [("stragglers", key) for key in ("mtbf", "slowdown", "duration",
                                                                                    "fails")]
HOSTILE_VALUES = st.one_of(st.none(), st.booleans(), st.integers(min_value=-10**30, max_value=10**30),
                           st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                           st.sampled_from(["54 d", "-1 h", "1e400 s", "3 weeks", "0", "sync", "gpu", "1e-300",
                                            "daly", "meta-rsc2"]),
                           st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=4), st.integers(),
                                                                                max_size=2))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(changes=st.lists(st.tuples(st.sampled_from(FLEET_PATHS), HOSTILE_VALUES), max_size=4))
def test_any_mutation_of_the_fleet_section_validates_or_is_one_line(changes):
    raw = {"cluster": {"devices": 2}, "fleet": json.loads(json.dumps(FLEET_DEFAULTS))}
    for path, value in changes:
        node = raw["fleet"]
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    try:
        scenario = validate_scenario(parse_yaml_text(yaml.safe_dump(raw), "s.yaml", ScenarioError), source="s.yaml")
    except ScenarioError as error:
        assert "\n" not in str(error) and str(error).startswith("s.yaml: fleet"), str(error)
        return
    fleet = scenario.fleet  # a valid section prices its checkpoints and restarts in finite seconds
    costs = Costs.of(fleet, 2, fleet.checkpoint.bytes_per_gpu or 1e9)
    assert all(math.isfinite(value) and value >= 0 for value in vars(costs).values())
