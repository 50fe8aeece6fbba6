"""Chakra execution traces out and in (report/chakra.py, simtrain/replay/), checked by Chakra's own package.

Out: every node of every rank's file decodes with chakra 1.0.0's own reader (protolib's decodeMessage into
et_def_pb2's messages, what its jsonizer runs), its dependencies name nodes of the file and make no cycle, and the
collectives' bytes are report.json's. In: a trace replays to the step time of the run that wrote it, and
workloads written by Chakra's own text converter and generator replay in the closed-form time of their compute
and ring collectives.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import simtrain.dist
from simtrain.dist import Representatives
from simtrain import load_scenario, run
from simtrain.replay import read_traces, replay
from simtrain.scenario import validate_scenario
from test_hostile_input import cli
from test_dist_representatives import fsdp_tp_adam, stages
from test_representatives import GPT, scenario

pytest.importorskip("chakra.schema.protobuf.et_def_pb2")
from chakra.schema.protobuf import et_def_pb2 as pb  # noqa: E402
from chakra.src.converter.text_converter import TextConverter  # noqa: E402
from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"
ROUND_TRIP_REL = 1e-9  # a replay of simtrain's own trace gives the run's step time to rounding


def decoded(path: Path) -> tuple[pb.GlobalMetadata, list[pb.Node]]:
    """The file read as chakra's jsonizer reads it: its metadata, then nodes until none is left."""
    handle = openFileRd(str(path))
    metadata = pb.GlobalMetadata()
    assert decodeMessage(handle, metadata)
    nodes = []
    node = pb.Node()
    while decodeMessage(handle, node):
        nodes.append(node)
        node = pb.Node()
    handle.close()
    return metadata, nodes


def attrs(node: pb.Node) -> dict:
    return {attr.name: getattr(attr, attr.WhichOneof("value")) for attr in node.attr}


def assert_a_dag(nodes: list[pb.Node]) -> None:
    ids = [node.id for node in nodes]
    assert len(set(ids)) == len(ids)
    done = set()
    for node in nodes:  # written in an order where every dependency comes first: no cycle
        assert set(node.data_deps) | set(node.ctrl_deps) <= done, node
        done.add(node.id)


def run_with_chakra(tmp_path: Path, scenario: Path, *overrides: str):
    report = run(load_scenario(scenario, ["train.steps=2", "report.chakra=true", *overrides]))
    report.write(tmp_path)
    return report, tmp_path / "chakra"


def test_a_runs_traces_decode_with_chakras_reader_and_their_collectives_carry_report_jsons_bytes(tmp_path):
    report, folder = run_with_chakra(tmp_path, QUICKSTART)
    gradient_bytes = sum(p.numel() * p.element_size() for p in report.final_model.parameters())
    groups = json.loads((folder / "comm_group.json").read_text())
    assert groups == {"0": [0, 1, 2, 3]}
    sent = 0
    for rank in range(4):
        metadata, nodes = decoded(folder / f"et.{rank}.et")
        assert {attr.name: attr.int64_val for attr in metadata.attr if attr.name in ("rank", "steps")} == \
            {"rank": rank, "steps": 2}
        # a forward, a backward, the bucket's all-reduce, the optimizer step: per step
        assert [pb.NodeType.Name(node.type) for node in nodes] == \
            ["COMP_NODE", "COMP_NODE", "COMM_COLL_NODE", "COMP_NODE"] * 2
        assert_a_dag(nodes)
        for node in nodes:
            values = attrs(node)
            assert values["is_cpu_op"] is False
            if node.type == pb.COMM_COLL_NODE:
                assert values["comm_type"] == pb.ALL_REDUCE and values["pg_name"] == "0"
                assert values["comm_size"] == gradient_bytes  # the buffer: every gradient, one bucket
                sent += values["bytes_sent"]
            else:
                assert values["num_ops"] >= 0 and node.duration_micros == round(values["duration_s"] * 1e6)
    assert sent == report.data["parallel"]["bytes_by_kind"]["dp_allreduce"]
    assert sent == pytest.approx(2 * 4 * 2 * 3 / 4 * gradient_bytes, abs=4 * 2 * 4)  # 2 steps, 2(n-1)/n each


@pytest.mark.parametrize("scenario, overrides, posted", [
    ("quickstart.yaml", (), False),
    ("quickstart.yaml", ("parallel.all_reduce=nccl",), False),
    ("zero3.yaml", ("numerics=false",), True),  # all-gathers prefetched beside the compute, reduce-scatters beside
    ("gpt_small.yaml", ("numerics=false", "parallel.tp=2", "cluster.devices=8"), False),
    ("gpt_small.yaml", ("numerics=false", "parallel.tp=2", "parallel.pp=2", "cluster.devices=8"), True),  # messages
    ("pipeline.yaml", ("parallel.pipeline.schedule=1f1b",), True),
])
def test_a_replay_of_a_runs_own_trace_gives_its_step_time(tmp_path, scenario, overrides, posted):
    report, folder = run_with_chakra(tmp_path, ROOT / "scenarios" / scenario, *overrides)
    data = replay(read_traces([str(folder)]), load_scenario(ROOT / "scenarios" / scenario, list(overrides))).data
    assert data["steps"] == 2
    assert data["step_time_s"] == pytest.approx(report.data["step_time_s"], rel=ROUND_TRIP_REL)
    assert data["trace_step_time_s"] == pytest.approx(report.data["step_time_s"], rel=ROUND_TRIP_REL)
    for device, ours in zip(report.data["devices"], data["devices"]):
        assert ours["breakdown_s"]["compute"] == pytest.approx(device["breakdown_s"]["compute"], rel=1e-9)
        if not posted:  # the run counts a posted collective or message only while awaited (engine.py)
            # the replay counts a collective from its first transfer to its last, a wait for a peer within included
            assert ours["breakdown_s"]["communication"] == pytest.approx(device["breakdown_s"]["communication"],
                                                                         rel=1e-4)


def test_users_code_writes_traces_that_replay_to_its_time_with_its_collectives_sizes(tmp_path):
    size = 1 << 20

    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        torch.ones(64, 128) @ torch.ones(128, 256)
        work = dist.all_reduce(torch.ones(size // 4), async_op=True)
        simtrain.dist.compute(1e9)  # beside the all-reduce
        work.wait()
        dist.all_gather([torch.empty(1024) for _ in range(world)], torch.ones(1024))
        if rank < 2:  # a message from rank 0 to rank 1
            peer = 1 - rank
            (dist.isend if rank == 0 else dist.irecv)(torch.ones(4096) if rank == 0 else torch.empty(4096), peer).wait()

    result = simtrain.dist.spawn(rank_code, world=4, bandwidth="50 GB/s", latency="5 us")
    folder = result.report.write_chakra(tmp_path)
    _, nodes = decoded(folder / "et.2.et")
    sizes = {pb.CollectiveCommType.Name(attrs(n)["comm_type"]): attrs(n)["comm_size"] for n in nodes
             if n.type == pb.COMM_COLL_NODE}
    assert sizes == {"ALL_REDUCE": size, "ALL_GATHER": 4 * 1024 * 4}
    _, nodes = decoded(folder / "et.1.et")
    receives = [attrs(n) for n in nodes if n.type == pb.COMM_RECV_NODE]
    assert [(r["comm_src"], r["comm_size"]) for r in receives] == [(0, 4096 * 4)]
    cluster = validate_scenario({"cluster": {"devices": 4, "link": {"bandwidth": "50 GB/s", "latency": "5 us"}}})
    data = replay(read_traces([str(folder)]), cluster).data
    assert data["step_time_s"] == pytest.approx(result.report.data["sim_time_s"], rel=ROUND_TRIP_REL)


def text_workload(tmp_path: Path, kind: str, layer: str, passes: int) -> Path:
    """Chakra's own text converter's traces of a one-layer workload, on 4 ranks."""
    text = tmp_path / "workload.txt"
    text.write_text(f"{kind}\n1\n{layer}\n")
    TextConverter(str(text), str(tmp_path / "workload"), num_npus=4, num_passes=passes).convert()
    return tmp_path


RING = {"cluster": {"topology": "ring", "devices": 4, "link": {"bandwidth": "50 GB/s", "latency": "5 us"}},
        "parallel": {"all_reduce": "ring"}}


def ring_all_reduce_s(nbytes: int, world: int = 4) -> float:
    """A ring all-reduce's closed form: 2(n-1) steps of the latency and a chunk of nbytes / n at 50 GB/s."""
    return 2 * (world - 1) * (5e-6 + nbytes / world / 50e9)


def test_a_microbenchmark_from_chakras_converter_replays_as_its_ring_all_reduces(tmp_path):
    size = 1 << 22
    folder = text_workload(tmp_path, "MICRO", f"l0 -1 0 NONE 0 0 NONE 0 0 ALLREDUCE {size} 0", passes=3)
    traces = read_traces([str(folder)])
    assert traces.world == 4 and traces.nodes == 12
    data = replay(traces, validate_scenario(RING)).data
    assert data["step_time_s"] == pytest.approx(3 * ring_all_reduce_s(size), rel=1e-9)
    assert data["trace_step_time_s"] is None  # the converter writes durations, no start times
    assert data["collective_bytes_by_type"] == {"ALL_REDUCE": 4 * 3 * size}


def test_a_data_parallel_workload_from_chakras_converter_replays_its_compute_and_all_reduce(tmp_path):
    size = 1 << 20
    folder = text_workload(tmp_path, "DATA", f"l0 -1 30 NONE 0 0 NONE 0 50 ALLREDUCE {size} 0", passes=2)
    data = replay(read_traces([str(folder)]), validate_scenario(RING)).data
    # each pass: forward 30 us, weight gradient 50 us, then its all-reduce, which the next forward waits for
    assert data["step_time_s"] == pytest.approx(2 * (80e-6 + ring_all_reduce_s(size)), rel=1e-9)
    for device in data["devices"]:
        assert device["breakdown_s"]["compute"] == pytest.approx(2 * 80e-6, rel=1e-12)  # both passes
        assert device["trace_compute_s"] == pytest.approx(2 * 80e-6, rel=1e-12)


def test_simtrain_replay_prints_the_figures_as_json(tmp_path, capsys):
    _, folder = run_with_chakra(tmp_path, QUICKSTART)
    report = json.loads((tmp_path / "report.json").read_text())
    assert cli("replay", folder, "--cluster", QUICKSTART, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"] == 4 and data["nodes"] == 4 * 8
    assert data["step_time_s"] == pytest.approx(report["step_time_s"], rel=ROUND_TRIP_REL)
    assert data["difference"] == pytest.approx(0.0, abs=ROUND_TRIP_REL)


def test_chakras_generator_microbenchmarks_replay_in_their_closed_form_times(tmp_path, monkeypatch):
    from chakra.src.generator import generator

    monkeypatch.chdir(tmp_path)  # the generator writes <benchmark>.<npu>.et where it runs
    size = 65536
    generator.one_metadata_node_all_types(4)
    generator.one_comp_node(4, 5)
    generator.two_comp_nodes_dependent(4, 5)
    generator.two_comp_nodes_independent(4, 5)
    generator.one_comm_coll_node_allreduce(4, size)
    generator.one_comm_coll_node_allgather(4, size)
    generator.one_comm_coll_node_reducescatter(4, size)
    generator.one_comm_coll_node_alltoall(4, size)
    generator.one_comm_coll_node_broadcast(4, size)
    generator.one_comm_coll_node_barrier(4)
    ring = validate_scenario(RING)

    def step_s(benchmark: str) -> float:
        return replay(read_traces([str(path) for path in sorted(tmp_path.glob(f"{benchmark}.*.et"))]), ring) \
            .data["step_time_s"]

    assert step_s("one_metadata_node_all_types") == 0
    assert step_s("one_comp_node") == pytest.approx(5e-6, rel=1e-12)
    assert step_s("two_comp_nodes_dependent") == pytest.approx(10e-6, rel=1e-12)
    assert step_s("two_comp_nodes_independent") == pytest.approx(10e-6, rel=1e-12)  # one compute stream per device
    assert step_s("ALL_REDUCE") == pytest.approx(ring_all_reduce_s(size), rel=1e-9)
    # a ring all-gather or reduce-scatter: n - 1 steps of the latency and a chunk of size / n
    assert step_s("ALL_GATHER") == pytest.approx(3 * (5e-6 + size / 4 / 50e9), rel=1e-9)
    assert step_s("REDUCE_SCATTER") == pytest.approx(3 * (5e-6 + size / 4 / 50e9), rel=1e-9)
    # one float all-reduced: at each of the 2(n - 1) steps some rank moves the one chunk that holds it
    assert step_s("BARRIER") == pytest.approx(2 * 3 * (5e-6 + 4 / 50e9), rel=1e-9)
    # all-to-all's two-hop routes share the ring's links, NCCL chooses the broadcast's algorithm: no closed form
    # here; they run, past one hop's latency
    assert step_s("ALL_TO_ALL") > 5e-6 and step_s("BROADCAST") > 5e-6


def node_summaries(files: dict[str, bytes], folder: Path, rank: int) -> list[tuple]:
    """A rank's nodes as what names them (type, name, collective, buffer, the group's ranks, peer), sorted: nodes
    that start at one instant may come in either order. (A representative's collective's bytes sent are its
    group's mean: a tree's or a hierarchical ring's ranks send unlike shares.)"""
    groups = json.loads(files["comm_group.json"])
    (folder / f"et.{rank}.et").write_bytes(files[f"et.{rank}.et"])
    summaries = []
    for node in decoded(folder / f"et.{rank}.et")[1]:
        a = attrs(node)
        summaries.append((node.type, node.name, a.get("comm_type", -1), a.get("comm_size", -1),
                          tuple(groups[a["pg_name"]]) if "pg_name" in a else (), a.get("comm_src", -1),
                          a.get("comm_dst", -1)))
    return sorted(summaries)


@pytest.mark.parametrize("precision, layout", [
    # pipeline messages, ring attention's steps, dp's all-reduces, tp's all-gathers and reduce-scatters, whole and
    # in steps beside the GEMMs
    ("bf16", dict(tp=2, pp=2, cp=2, dp=2, sequence_parallel=True, tp_comm_overlap=True)),
    ("fp16", dict(model={**GPT, "moe": {"experts": 4, "top_k": 2}}, tp=2, pp=2, ep=2, sharding={"stage": 1},
                  pipeline={"microbatches": 4})),  # all-to-alls, ZeRO-1's collectives, the overflow vote
], ids=["tp-sp-overlap-pp-cp-dp", "moe-ep-zero1-fp16"])
def test_with_representatives_every_rank_writes_the_full_simulations_nodes(tmp_path, precision, layout):
    """Under parallel.representatives a mirrored rank writes its representative's nodes with its own groups and
    peers: on 16 devices every rank's nodes are the full simulation's (the same collectives of the same buffers
    over the same ranks, the same messages to and from the same peers), and the traces replay to the run's step
    time."""
    files, steps = {}, {}
    for flag in (False, True):
        raw = scenario(16, 4, representatives=flag, **dict(layout)).model_dump(mode="json", by_alias=True)
        raw["train"]["precision"], raw["report"]["chakra"] = precision, True
        report = run(validate_scenario(raw))
        files[flag], steps[flag] = report.chakra, report.data["step_time_s"]
        if flag:
            report.write(tmp_path / "represented")
    assert json.loads(files[True]["comm_group.json"]).keys() == json.loads(files[False]["comm_group.json"]).keys()
    for rank in range(16):
        assert node_summaries(files[True], tmp_path, rank) == node_summaries(files[False], tmp_path, rank), rank
    # the replay runs every rank's collectives on the network, where the run timed a representative's mirrored
    replayed = replay(read_traces([str(tmp_path / "represented" / "chakra")]), validate_scenario(raw)).data
    assert replayed["step_time_s"] == pytest.approx(steps[True], rel=1e-3)
    assert steps[True] == pytest.approx(steps[False], rel=0.01)


@pytest.mark.parametrize("rank_code, mesh, alike_dims", [(fsdp_tp_adam, (2, 4), (0,)), (stages, (2, 2), (1,))],
                         ids=["fsdp2-x-tp", "pipeline-send"])
def test_users_code_with_representatives_writes_the_traces_every_rank_run_writes(rank_code, mesh, alike_dims):
    """Under spawn's representatives a represented rank posts its own part of every collective and send
    (torchdist/representatives.py): its trace is its representative's compute and its own communication, byte for
    byte the file of the run where every rank ran."""
    world = mesh[0] * mesh[1]
    every = simtrain.dist.spawn(rank_code, world=world, numerics=False)
    alike = simtrain.dist.spawn(rank_code, world=world, numerics=False,
                                representatives=Representatives(mesh, alike_dims))
    assert alike.report.chakra() == every.report.chakra()
