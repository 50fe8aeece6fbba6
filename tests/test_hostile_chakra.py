"""Hostile Chakra execution traces given to `simtrain replay` (replay/trace_file.py, replay/engine.py): truncated,
not protobuf, cyclic, dangling, huge, collectives without partners, ranks missing, ranks waiting on each other.

Each ends in one line naming the file (and the node) and exit code 2, never a traceback or a hang; the contract
is simtrain/errors.py's, as in test_hostile_input.py.
"""
import io
import json
import os
from pathlib import Path

import pytest

from test_hostile_input import cli, one_line_error

pytest.importorskip("chakra.schema.protobuf.et_def_pb2")
from chakra.schema.protobuf import et_def_pb2 as pb  # noqa: E402
from chakra.src.third_party.utils.protolib import encodeMessage  # noqa: E402

from simtrain.limits import MAX_CHAKRA_FILE_BYTES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "cluster: {topology: ring, devices: 4, link: {bandwidth: 50 GB/s, latency: 5 us}}\n"


def compute(node_id: int, *deps: int, micros: int = 10) -> pb.Node:
    return pb.Node(id=node_id, name=f"compute {node_id}", type=pb.COMP_NODE, duration_micros=micros,
                   data_deps=list(deps))


def all_reduce(node_id: int, *deps: int, size: int = 4096, group: str = "") -> pb.Node:
    node = pb.Node(id=node_id, name=f"all_reduce {node_id}", type=pb.COMM_COLL_NODE, data_deps=list(deps))
    node.attr.extend([pb.AttributeProto(name="comm_type", int64_val=pb.ALL_REDUCE),
                      pb.AttributeProto(name="comm_size", int64_val=size)]
                     + ([pb.AttributeProto(name="pg_name", string_val=group)] if group else []))
    return node


def encoded(nodes: list[pb.Node]) -> bytes:
    out = io.BytesIO()
    encodeMessage(out, pb.GlobalMetadata(version="1.0.2-chakra.1.0.0"))
    for node in nodes:
        encodeMessage(out, node)
    return out.getvalue()


def write(folder: Path, ranks: dict[int, list[pb.Node]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for rank, nodes in ranks.items():
        (folder / f"et.{rank}.et").write_bytes(encoded(nodes))
    return folder


def good(folder: Path) -> Path:
    """Four ranks: a compute, then an all-reduce after it."""
    return write(folder, {rank: [compute(1), all_reduce(2, 1)] for rank in range(4)})


def replay_error(capsys, tmp_path: Path, traces: Path) -> str:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    return one_line_error(capsys, "replay", traces, "--cluster", cluster)


def test_the_good_traces_replay(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    assert cli("replay", good(tmp_path / "traces"), "--cluster", cluster, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    # 10 us of compute, then a ring all-reduce of 4 KiB: 2(n-1) steps of 5 us and a quarter of it at 50 GB/s
    assert data["step_time_s"] == pytest.approx(10e-6 + 2 * 3 * (5e-6 + 1024 / 50e9), rel=1e-12)


def test_a_truncated_file(tmp_path, capsys):
    folder = good(tmp_path / "traces")
    data = (folder / "et.1.et").read_bytes()
    (folder / "et.1.et").write_bytes(data[:len(data) - 5])
    assert "et.1.et: message 3 at byte" in replay_error(capsys, tmp_path, folder)
    (folder / "et.1.et").write_bytes(b"")
    assert "et.1.et: its metadata at byte 0: its length is cut short" in replay_error(capsys, tmp_path, folder)


@pytest.mark.parametrize("payload", [CLUSTER.encode(), b"\x00" * 64, b"\xff" * 64, bytes(range(256)),
                                     b"\x89PNG\r\n\x1a\n" + bytes(200)],
                         ids=["yaml", "zeros", "ones", "every byte", "png"])
def test_a_file_that_is_not_a_chakra_trace(tmp_path, capsys, payload):
    folder = good(tmp_path / "traces")
    (folder / "et.2.et").write_bytes(payload)
    error = replay_error(capsys, tmp_path, folder)
    assert "et.2.et: " in error and ("not a Chakra" in error or "truncated" in error), error


def test_cyclic_dependencies(tmp_path, capsys):
    folder = good(tmp_path / "traces")
    write(folder, {3: [compute(1, 3), compute(2, 1), compute(3, 2), all_reduce(4, 3)]})
    assert "et.3.et: node 1 ('compute 1') is on or after a dependency cycle" in replay_error(capsys, tmp_path, folder)


def test_a_dependency_on_a_node_that_does_not_exist(tmp_path, capsys):
    folder = good(tmp_path / "traces")
    write(folder, {0: [compute(1), all_reduce(2, 1, 99)]})
    assert "et.0.et: node 2 ('all_reduce 2') depends on node 99, which the trace does not have" in \
        replay_error(capsys, tmp_path, folder)


def test_a_node_id_used_twice(tmp_path, capsys):
    folder = good(tmp_path / "traces")
    write(folder, {0: [compute(1), compute(1), all_reduce(2, 1)]})
    assert "et.0.et: node id 1 is used twice" in replay_error(capsys, tmp_path, folder)


def test_a_huge_file_is_refused_before_it_is_read(tmp_path, capsys):
    folder = good(tmp_path / "traces")
    with open(folder / "et.1.et", "r+b") as handle:  # sparse: nothing is written
        handle.truncate(MAX_CHAKRA_FILE_BYTES + 1)
    assert f"et.1.et: {MAX_CHAKRA_FILE_BYTES + 1} bytes, past the limit" in replay_error(capsys, tmp_path, folder)


def test_too_many_nodes_stop_the_decoding_at_the_limit(tmp_path, capsys, monkeypatch):
    import simtrain.replay.trace_file as trace_file
    monkeypatch.setattr(trace_file, "MAX_CHAKRA_NODES", 7)  # four ranks of two nodes: the eighth is refused
    folder = good(tmp_path / "traces")
    assert "et.3.et: more than 7 nodes in the traces given, past the limit (MAX_CHAKRA_NODES)" in \
        replay_error(capsys, tmp_path, folder)


def test_a_collective_with_no_partner(tmp_path, capsys):
    folder = good(tmp_path / "traces")
    write(folder, {1: [compute(1), all_reduce(2, 1), all_reduce(3, 2)]})
    assert "et.1.et: node 3 ('all_reduce 3'), collective #2 of rank 1 on group '', has no partner on rank 0" in \
        replay_error(capsys, tmp_path, folder)


def test_collectives_that_differ_across_ranks(tmp_path, capsys):
    folder = good(tmp_path / "traces")
    write(folder, {2: [compute(1), all_reduce(2, 1, size=8192)]})
    assert "et.2.et: node 2 ('all_reduce 2'), collective #1 of rank 2 on group '', is a ALL_REDUCE of 8192 B where " \
           "rank 0 runs a ALL_REDUCE of 4096 B" in replay_error(capsys, tmp_path, folder)


def test_a_missing_rank(tmp_path, capsys):
    folder = good(tmp_path / "traces")
    os.remove(folder / "et.2.et")
    assert "missing rank 2: no <prefix>.2.et among the traces given (ranks 0, 1, 3)" in \
        replay_error(capsys, tmp_path, folder)


def test_a_group_that_names_a_rank_without_a_trace(tmp_path, capsys):
    folder = write(tmp_path / "traces", {rank: [compute(1), all_reduce(2, 1, group="7")] for rank in range(4)})
    (folder / "comm_group.json").write_text('{"7": [0, 1, 2, 3, 4]}')
    assert "comm_group.json: group '7' names rank 4, which has no trace" in replay_error(capsys, tmp_path, folder)
    (folder / "comm_group.json").write_text('{"7": [0, 1, 2, 3')
    assert "comm_group.json: not JSON" in replay_error(capsys, tmp_path, folder)
    (folder / "comm_group.json").write_text('{"8": [0, 1, 2, 3]}')
    assert "et.0.et: node 2 ('all_reduce 2'): pg_name '7' is not a group of comm_group.json" in \
        replay_error(capsys, tmp_path, folder)


def test_ranks_that_wait_on_each_other_end_in_one_line_not_a_hang(tmp_path, capsys):
    folder = write(tmp_path / "traces", {
        0: [all_reduce(1, group="a"), all_reduce(2, 1, group="b")],
        1: [all_reduce(1, group="b"), all_reduce(2, 1, group="a")]})
    (folder / "comm_group.json").write_text('{"a": [0, 1], "b": [0, 1]}')
    assert "never ran: its ranks wait for each other" in replay_error(capsys, tmp_path, folder)


def test_a_cluster_too_small_for_the_traces(tmp_path, capsys):
    folder = write(tmp_path / "traces", {rank: [compute(1), all_reduce(2, 1)] for rank in range(9)})
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(f"cluster: {{topology: {ROOT / 'topologies' / 'dgx-a100-1node.yaml'}}}\n")
    assert "cluster.devices: the traces have 9 ranks, the cluster 8 devices" in \
        one_line_error(capsys, "replay", folder, "--cluster", cluster)
    assert "absent.yaml" in one_line_error(capsys, "replay", folder, "--cluster", tmp_path / "absent.yaml")


def p2p(node_id: int, kind: str, peer: int, *deps: int, size: int = 4096, tag: int = 0) -> pb.Node:
    node = pb.Node(id=node_id, name=f"{kind} {node_id}", data_deps=list(deps),
                   type=pb.COMM_SEND_NODE if kind == "send" else pb.COMM_RECV_NODE)
    node.attr.extend([pb.AttributeProto(name="comm_dst" if kind == "send" else "comm_src", int64_val=peer),
                      pb.AttributeProto(name="comm_size", int64_val=size),
                      pb.AttributeProto(name="comm_tag", int64_val=tag)])
    return node


def test_a_send_and_its_receive_replay_as_one_transfer(tmp_path, capsys):
    folder = write(tmp_path / "traces", {0: [compute(1), p2p(2, "send", 1, 1, size=1 << 20)],
                                         1: [p2p(1, "recv", 0, size=1 << 20), compute(2, 1)]})
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    assert cli("replay", folder, "--cluster", cluster, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    # rank 1 computes once the 1 MiB has crossed the one link: 10 us, then 5 us and 1 MiB at 50 GB/s, then 10 us
    assert data["step_time_s"] == pytest.approx(10e-6 + 5e-6 + (1 << 20) / 50e9 + 10e-6, rel=1e-12)


def test_a_send_without_its_receive(tmp_path, capsys):
    folder = write(tmp_path / "traces", {0: [compute(1), p2p(2, "send", 1), p2p(3, "send", 1, tag=5)],
                                         1: [p2p(1, "recv", 0), compute(2, 1)]})
    assert "et.0.et: rank 0 sends [4096] B to rank 1 (tag 5), which receives [] B" in \
        replay_error(capsys, tmp_path, folder)
    write(folder, {0: [compute(1), p2p(2, "send", 3)]})
    assert "et.0.et: node 2 ('send 2'): peer rank 3 is not another rank of the traces" in \
        replay_error(capsys, tmp_path, folder)


@pytest.mark.parametrize("comm_type", ["ALL_REDUCE", "ALL_GATHER", "BROADCAST", "ALL_TO_ALL", "BARRIER"])
def test_every_collective_type_replays_on_groups_of_one_two_and_four(tmp_path, capsys, comm_type):
    def collective(node_id, group):
        node = all_reduce(node_id, node_id - 1, group=group)
        node.attr[0].int64_val = pb.CollectiveCommType.Value(comm_type)
        return node

    group = {0: "solo", 1: "pair", 2: "pair"}
    ranks = {rank: [compute(1), collective(2, group[rank]), collective(3, "all")] for rank in (0, 1, 2)}
    ranks[3] = [compute(1), collective(2, "all")]
    folder = write(tmp_path / "traces", ranks)
    (folder / "comm_group.json").write_text('{"solo": [0], "pair": [1, 2], "all": [0, 1, 2, 3]}')
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    assert cli("replay", folder, "--cluster", cluster, "--json") == 0, capsys.readouterr().err
    # the compute, then at least one hop's latency of the collective of all four
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 10e-6 + 5e-6
