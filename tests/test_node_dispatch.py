"""DeepEP's dispatch (`parallel.moe_dispatch: deepep`): each token crosses to a host once.

References: a direct split-and-concatenate (pairwise's blocks) for what lands where; single-process torch (the
whole model on every rank's batch) and pairwise for training, with a capacity too; for the bytes between hosts,
the closed form tokens x distinct destination hosts x hidden x 4 bytes (plus 4 bytes a row for the rows' places),
counted from the router's choices token by token (with a capacity, of the assignments kept), and with balanced
group-limited routing (numerics off) in numbers.
"""
import pytest
import simpy
import torch

import simtrain
from simtrain.comm.node_dispatch import node_dispatch
from simtrain.comm.simulated import SimCommunicator
from simtrain.hw.network import Network
from simtrain.train.data import hold_out_validation, load_dataset
from simtrain.train.models import build_model
from simtrain.train.moe import MoE
from simtrain.train.sampling import build_loader
from test_all_to_all import expected_outputs, two_level
from test_expert_parallel import assert_same_parameters, one_device, one_step
from test_group_routing import reference_choices, scenario

HIDDEN = 16


def routed(world, gpus, tokens=6, top_k=3, experts_per_rank=2, seed=0):
    """Every rank's rows (its tokens, once per chosen expert, experts in order), their token ids, the counts of
    rows rank src sends rank dst, and the tokens of rank src that reach each host."""
    generator = torch.Generator().manual_seed(seed)
    experts, hosts = world * experts_per_rank, world // gpus
    sends, ids, counts, rows = [], [], [], []
    for _ in range(world):
        tokens_of = torch.randn(tokens, 3, generator=generator)
        chosen = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
        index = torch.cat([(chosen == e).nonzero(as_tuple=True)[0] for e in range(experts)])
        sends.append(tokens_of[index])
        ids.append(index)
        per_expert = torch.bincount(chosen.flatten(), minlength=experts)
        counts.append(per_expert.view(world, experts_per_rank).sum(dim=1).tolist())
        host = chosen // experts_per_rank // gpus
        rows.append([int((host == h).any(dim=1).sum()) for h in range(hosts)])
    return sends, ids, counts, rows


def run_dispatch(sends, counts, hosts, rows=None, ids=None, meta=False):
    """(what every rank received, the bytes that crossed between hosts, the time) of node_dispatch."""
    world, gpus = len(sends), len(hosts[0])
    env = simpy.Environment()
    topology = two_level(len(hosts), gpus)
    network = Network(env, topology, record=True)
    comm = SimCommunicator(network, topology.devices)
    to = (lambda t: t.to("meta")) if meta else (lambda t: t)
    recvs = [to(send.new_empty((sum(counts[src][dst] for src in range(world)), *send.shape[1:])))
             for dst, send in enumerate(sends)]
    for rank in range(world):
        comm.run(rank, node_dispatch(rank, world, to(sends[rank]), recvs[rank], counts, hosts=hosts, node_rows=rows,
                                     token_ids=None if ids is None else to(ids[rank])))
    env.run()
    assert comm.stuck() == []
    host_of = {node: rank // gpus for rank, node in enumerate(topology.devices)}
    between = sum(record.nbytes for record in network.records if host_of[record.src] != host_of[record.dst])
    return recvs, between, env.now


@pytest.mark.parametrize("hosts,gpus,seed", [(2, 2, 0), (3, 2, 1), (2, 4, 2), (4, 1, 3), (1, 4, 4)])
def test_blocks_land_where_pairwise_puts_them_each_token_crossing_to_a_host_once(hosts, gpus, seed):
    """Every block lands as split-and-concatenate puts it, with and without token ids; with them the bytes between
    hosts are sum over ranks and other hosts of (tokens reaching it) x 3 x 4 + (rows bound there) x 4, without
    them every row's 3 x 4; meta tensors take the same time."""
    world = hosts * gpus
    groups = [list(range(h * gpus, (h + 1) * gpus)) for h in range(hosts)]
    sends, ids, counts, rows = routed(world, gpus, seed=seed)
    expected = expected_outputs(counts, sends)
    tokens_out = sum(rows[src][h] for src in range(world) for h in range(hosts) if h != src // gpus)
    rows_out = sum(counts[src][dst] for src in range(world) for dst in range(world) if dst // gpus != src // gpus)
    recvs, between, seconds = run_dispatch(sends, counts, groups, rows, ids)
    assert all(torch.equal(got, want) for got, want in zip(recvs, expected))
    assert between == tokens_out * 3 * 4 + rows_out * 4
    if hosts > 1:
        assert tokens_out < rows_out  # some token went to two experts of one host
    recvs, between, _ = run_dispatch(sends, counts, groups)
    assert all(torch.equal(got, want) for got, want in zip(recvs, expected)) and between == rows_out * 3 * 4
    assert run_dispatch(sends, counts, groups, rows, ids, meta=True)[2] == seconds


FOUR_HOSTS = {"topology": "hierarchical", "gpus_per_node": 2, "device": "a100-40gb",
              "link": {"bandwidth": 1e9, "latency": 1e-6}, "inter_node_link": {"bandwidth": 2.5e8, "latency": 5e-6}}


def deepep(devices, parallel=None, **options):
    return scenario(devices, devices, cluster=FOUR_HOSTS, parallel=parallel or {"moe_dispatch": "deepep"}, **options)


def moved_between_hosts(job, label, gpus=2):
    host_of = {device.node: rank // gpus for rank, device in enumerate(job.devices)}
    return sum(record.nbytes for record in job.cluster.network.records
               if record.label == label and host_of[record.src] != host_of[record.dst])


def test_deepep_trains_to_the_parameters_of_one_device_and_of_pairwise():
    """ep 8 over 4 hosts of 2 GPUs, group-limited top-3 of 8 experts in 2 of 4 groups: as one device, and bit for
    bit as pairwise (every row lands where pairwise puts it)."""
    spec = deepep(8)
    report = simtrain.run(spec)
    reference, _ = one_device(spec, 8)
    assert_same_parameters(report.final_model, reference)
    pairwise = simtrain.run(deepep(8, parallel={"moe_dispatch": "pairwise"})).final_model.state_dict()
    assert all(torch.equal(tensor, pairwise[name]) for name, tensor in report.final_model.state_dict().items())


def test_dispatch_bytes_between_hosts_are_the_tokens_times_their_distinct_hosts():
    """ep 8 over 4 hosts of 2 GPUs (a group of 2 experts a host): each rank's batch routed by the initial model,
    token by token; the dispatch moves between hosts sum over tokens of (its distinct hosts other than its own) x
    hidden x 4 bytes, plus 4 bytes a row bound for another host; the combine, weighted at home, every such row."""
    spec = deepep(8, steps=1)
    job = one_step(spec)
    data = hold_out_validation(load_dataset(spec.data.name, spec.data.loader_options(), spec.seed),
                               spec.data.validation_fraction, spec.seed)
    reference = build_model(spec.model, data.info, spec.seed)
    token_hosts = rows = 0
    for rank in range(8):
        x, _ = build_loader(spec, data.train, 8, rank).next_batch()
        inputs = []  # each MoE layer's tokens, as its router sees them
        hooks = [layer.router.register_forward_hook(lambda module, args, out: inputs.append(args[0].detach()))
                 for layer in reference.modules() if isinstance(layer, MoE)]
        reference(x)
        for hook in hooks:
            hook.remove()
        routers = [layer.router for layer in reference.modules() if isinstance(layer, MoE)]
        for router, tokens in zip(routers, inputs):
            for token in tokens.reshape(-1, HIDDEN):
                hosts = [e // 2 for e in reference_choices(torch.softmax(router.weight @ token, 0).detach(),
                                                            spec.model.moe)]
                token_hosts += len(set(hosts) - {rank // 2})
                rows += sum(h != rank // 2 for h in hosts)
    assert token_hosts < rows
    assert moved_between_hosts(job, "moe dispatch") == token_hosts * HIDDEN * 4 + rows * 4
    assert moved_between_hosts(job, "moe combine") == rows * HIDDEN * 4


def test_balanced_group_limited_dispatch_moves_the_closed_form_between_hosts():
    """Numerics off, balanced routing, 8 experts top-4 in 2 of 4 groups (a group a host), ep 8 over 4 hosts of
    2 GPUs, T = 32 tokens a rank: each token reaches 2 hosts, each host T 2 / 4 of a rank's tokens, so a rank
    sends (G-1)/G M T = 48 tokens of H x 4 bytes to other hosts, and the (G-1)/G k T = 96 rows' places (4 bytes
    each); pairwise would send those 96 rows whole."""
    spec = deepep(8, numerics=False, steps=1)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={
        "moe": spec.model.moe.model_copy(update={"top_k": 4})})})
    job = one_step(spec)
    layers, tokens = 2, 32
    assert moved_between_hosts(job, "moe dispatch") == 8 * layers * (3 * 2 * tokens // 4 * HIDDEN * 4
                                                                     + 3 * 4 * tokens // 4 * 4)
    assert moved_between_hosts(job, "moe combine") == 8 * layers * 3 * 4 * tokens // 4 * HIDDEN * 4


def with_capacity(spec, factor):
    moe = spec.model.moe.model_copy(update={"capacity_factor": factor})
    return spec.model_copy(update={"model": spec.model.model_copy(update={"moe": moe})})


def test_deepep_with_a_capacity_trains_as_pairwise_and_one_device():
    """ep 8 over 4 hosts, capacity factor 0.5 (assignments dropped every step): the dispatch sends each token to
    the hosts of its kept assignments ("moe notify" counts them after the drops), and training is bit for bit
    pairwise's with the same capacity and one device's (its drops decided over the global batch) to 1e-5."""
    spec = with_capacity(deepep(8), 0.5)
    report = simtrain.run(spec)
    reference, dropped = one_device(spec, 8)
    assert all(dropped) and report.data["moe"]["dropped_tokens"] == dropped
    assert_same_parameters(report.final_model, reference)
    pairwise = simtrain.run(with_capacity(deepep(8, parallel={"moe_dispatch": "pairwise"}), 0.5))
    assert all(torch.equal(tensor, pairwise.final_model.state_dict()[name])
               for name, tensor in report.final_model.state_dict().items())


def test_dispatch_bytes_between_hosts_with_a_capacity_count_the_kept_assignments():
    """ep 8 over 4 hosts, capacity factor 0.5, one step: the global batch through one device's model, each
    layer's router choices token by token (ranks in order), expert e keeping its first C = ceil(0.5 T 3 / 8)
    assignments; the dispatch moves between hosts sum over tokens of (the distinct hosts of its kept assignments
    other than its own) x hidden x 4 bytes, plus 4 bytes a kept row bound for another host; the combine every
    such row. "moe counts" gathers each rank's 8 assignments, "moe notify" its tokens for each of the 4 hosts,
    8 bytes each, a ring all-gather: 8 x 7 chunks a layer."""
    spec = with_capacity(deepep(8, steps=1), 0.5)
    job = one_step(spec)
    data = hold_out_validation(load_dataset(spec.data.name, spec.data.loader_options(), spec.seed),
                               spec.data.validation_fraction, spec.seed)
    reference = build_model(spec.model, data.info, spec.seed)
    x = torch.cat([build_loader(spec, data.train, 8, rank).next_batch()[0] for rank in range(8)])
    inputs = []  # each MoE layer's tokens, as its router sees them (the global batch, rank by rank)
    layers = [layer for layer in reference.modules() if isinstance(layer, MoE)]
    hooks = [layer.router.register_forward_hook(lambda module, args, out: inputs.append(args[0].detach()))
             for layer in layers]
    reference(x)
    for hook in hooks:
        hook.remove()
    token_hosts = rows = dropped = 0
    for layer, tokens in zip(layers, inputs):
        tokens = tokens.reshape(-1, HIDDEN)
        per_rank, capacity = len(tokens) // 8, -(-len(tokens) * 3 // 16)  # ceil(0.5 T 3 / 8)
        taken = [0] * 8
        for index, token in enumerate(tokens):
            home, kept_hosts = index // per_rank // 2, []
            for expert in reference_choices(torch.softmax(layer.router.weight @ token, 0).detach(), spec.model.moe):
                taken[expert] += 1
                if taken[expert] <= capacity:
                    kept_hosts.append(expert // 2)
                else:
                    dropped += 1
            token_hosts += len(set(kept_hosts) - {home})
            rows += sum(h != home for h in kept_hosts)
    assert dropped > 0 and token_hosts < rows
    assert moved_between_hosts(job, "moe dispatch") == token_hosts * HIDDEN * 4 + rows * 4
    assert moved_between_hosts(job, "moe combine") == rows * HIDDEN * 4
    moved = lambda label: sum(record.nbytes for record in job.cluster.network.records  # noqa: E731
                              if record.label == label)
    assert moved("moe counts") == 2 * 8 * 7 * 8 * 8 and moved("moe notify") == 2 * 8 * 7 * 4 * 8


def test_balanced_routing_with_a_capacity_of_one_drops_nothing_and_moves_the_dropless_bytes():
    """Numerics off, balanced routing, capacity factor 1.0 (every expert's share exactly): the dispatch and
    combine move between hosts what they move dropless."""
    spec = deepep(8, numerics=False, steps=1)
    dropless, capped = one_step(spec), one_step(with_capacity(spec, 1.0))
    for label in ("moe dispatch", "moe combine"):
        assert moved_between_hosts(capped, label) == moved_between_hosts(dropless, label) > 0


@pytest.mark.parametrize("dispatch,capacity", [("hierarchical", None), ("deepep", None), ("deepep", 1.25)])
def test_representatives_time_the_dispatch_as_the_whole_simulation(dispatch, capacity):
    """Numerics off, balanced routing, ep 8 over 4 hosts: one rank simulated, its exchanges timed as the job's
    dispatch runs them (hierarchical was timed as pairwise), gives the step and all-to-all times of every rank
    simulated, to 1e-9; with a capacity factor too (deepep's "moe notify" mirrored as "moe counts" is)."""
    def figures(representatives):
        spec = deepep(8, numerics=False, parallel={"moe_dispatch": dispatch, "representatives": representatives})
        report = simtrain.run(with_capacity(spec, capacity))
        return report.data["step_time_s"], report.data["moe"]["all_to_all_time_s"]

    (step, all_to_all), (step_alone, all_to_all_alone) = figures(True), figures(False)
    assert step == pytest.approx(step_alone, rel=1e-9)
    assert all_to_all == pytest.approx(all_to_all_alone, rel=1e-9)
