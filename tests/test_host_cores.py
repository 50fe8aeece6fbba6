"""A host's CPU cores shared by the ranks of a calibrated run: processor sharing against its closed forms.

References: k pieces of work of c seconds each on m cores under processor
sharing all end at c max(1, k/m) (a FIFO queue of m servers would end them at
c, 2c, ... ceil(k/m) c); work that arrives later shares from then on, worked by
hand; a simulated run on shared cores against the same run with a core per
rank (its compute exactly k/m times as long); the ring all-reduce's closed form
when each message first takes δ + bytes/γ of a core; the scenario's one-line
errors.
"""
import pytest
import simpy
import torch
import yaml

import simtrain
from simtrain.cli import main
from simtrain.comm import build_all_reduce
from simtrain.comm.simulated import SimCommunicator
from simtrain.hw.host_cores import HostCores, HostMessages
from simtrain.hw.network import Network
from simtrain.hw.topology_builders import LinkClass, build_topology


def end_times(cores: int, work: list[tuple[float, float]]) -> list[float]:
    """When each (arrival s, core seconds) piece of work ends on `cores` shared cores."""
    env = simpy.Environment()
    shared = HostCores(env, cores)
    ends = [None] * len(work)

    def arrive(index, at, seconds):
        yield env.timeout(at)
        yield shared.run(seconds)
        ends[index] = env.now
    for index, (at, seconds) in enumerate(work):
        env.process(arrive(index, at, seconds))
    env.run()
    return ends


@pytest.mark.parametrize("ranks, cores", [(4, 2), (3, 2), (2, 2), (1, 2), (5, 3)])
def test_k_ranks_of_compute_c_on_m_cores_all_end_at_c_times_k_over_m(ranks, cores):
    c = 1.5e-3
    assert end_times(cores, [(0.0, c)] * ranks) == pytest.approx([c * max(1.0, ranks / cores)] * ranks, rel=1e-12)


def test_work_that_arrives_later_shares_the_core_from_then():
    """One core: A (2 s) alone for 1 s, then A and B (0.5 s) at half speed each until B ends at 2 s, when A has
    0.5 s left, alone again: 2.5 s."""
    assert end_times(1, [(0.0, 2.0), (1.0, 0.5)]) == pytest.approx([2.5, 2.0], rel=1e-12)


def scenario(tmp_path, **cluster):
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump({
        "name": "cores", "seed": 0, "numerics": False,
        "cluster": {"topology": "switch", "devices": 4, "device": "a100-40gb", **cluster},
        "model": {"name": "mlp", "hidden": [64]},
        "data": {"name": "synthetic", "samples": 256, "features": 32, "classes": 4, "batch_size": 16},
        "train": {"steps": 1}, "parallel": {"all_reduce": "ring", "overlap": False}, "report": {"trace": False}}))
    return simtrain.load_scenario(path)


def test_four_ranks_on_two_cores_compute_at_half_speed(tmp_path):
    own = simtrain.run(scenario(tmp_path)).data
    shared = simtrain.run(scenario(tmp_path, host_cores=2)).data["breakdown_s"]
    # the four ranks' forward and backward start together: each at 2/4 of a core; their optimizer steps follow
    # the ring's ends, a little apart, so they overlap for most of their time
    assert shared["compute"] == pytest.approx(2 * own["breakdown_s"]["compute"], rel=1e-12)
    assert own["breakdown_s"]["optimizer"] < shared["optimizer"] <= 2 * own["breakdown_s"]["optimizer"]
    assert shared["communication"] == pytest.approx(own["breakdown_s"]["communication"], rel=1e-12)
    enough = simtrain.run(scenario(tmp_path, host_cores=4)).data  # a core each: nothing moves
    assert (enough["step_time_s"], enough["breakdown_s"]) == (own["step_time_s"], own["breakdown_s"])


@pytest.mark.parametrize("cores", [2, 4])
def test_each_message_takes_a_core_before_it_moves(cores):
    """Ring all-reduce of n bytes over N = 4 ranks on a switch: 2(N - 1) steps, in each every rank's message
    of n/N bytes first has δ + (n/N)/γ of a core (N messages on m cores: N/m times as long when N > m), then
    two hops of latency a and its bytes at the link's rate B."""
    world, nbytes, a, rate = 4, 1 << 20, 5e-6, 2e9
    delta, per_byte = 300e-6, 1 / 0.5e9
    topology = build_topology("switch", world, LinkClass(bandwidth=rate, latency=a))
    env = simpy.Environment()
    messages = HostMessages(HostCores(env, cores), delta, per_byte)
    comm = SimCommunicator(Network(env, topology, record=False), topology.devices, host=messages)
    all_reduce = build_all_reduce("ring", topology, topology.devices)
    ends = []
    for rank in range(world):
        program = all_reduce(rank, world, torch.empty(nbytes // 4, device="meta"))
        comm.run(rank, program).callbacks.append(lambda _: ends.append(env.now))
    env.run()
    chunk = nbytes / world
    step = (delta + chunk * per_byte) * max(1.0, world / cores) + 2 * a + chunk / rate
    assert ends == pytest.approx([2 * (world - 1) * step] * world, rel=1e-9)


@pytest.mark.parametrize("overrides, message", [
    (["cluster.host_cores=0"], "cluster.host_cores"),
    (["cluster.host_message_work.latency=1ms"], "host_message_work: needs host_cores"),
    (["cluster.host_cores=2", "cluster.faults=[{at: 1, device: 0, fail: true}]"], "host_cores: does not run with "
                                                                                   "faults"),
    (["cluster.host_cores=2", "parallel.tp=2", "parallel.representatives=true", "numerics=false"],
     "parallel.representatives: needs devices that compute on their own"),
])
def test_bad_host_keys_are_one_line_errors(tmp_path, capsys, overrides, message):
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", "cluster": {"topology": "switch", "devices": 4}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(path), *(arg for override in overrides for arg in ("--set", override))])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
