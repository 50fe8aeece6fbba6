"""Model parallelism mixed with data parallelism: pipeline (pp) and tensor (tp) parallel layouts, on real numerics.

A job of dp x pp x tp devices (schemes/layout.py) trains one model:

- **pipeline**: the model's nn.Sequential is cut into pp * v parts
  (train/partition.py: balanced by measured FLOPs, or `pipeline.split`);
  device s of a pipeline runs parts s, s + pp, ... (its v chunks). Each step
  the device batch is cut into m microbatches, and each stage runs its
  forwards and backwards in the order of the schedule
  (schemes/pipeline_schedule.py: gpipe, 1f1b, interleaved). Activations go
  forward and their gradients back as real tensors over the simulated links.
  A send does not block: the stage hands the tensor to the link and carries
  on with its next action (NCCL moves it on its own stream while the stage
  computes), and the receiver waits for it to arrive. So no schedule can
  deadlock on its sends, and a transfer hides behind the sender's compute.
  A receiver's wait while the tensor is on the wire is communication; its
  wait before the peer has sent it is the pipeline bubble ("bubble" spans).
- **tensor**: each stage is split across its tp devices as Megatron-LM splits
  layers (train/tensor_parallel.py; a gpt's vocabulary too, its loss computed
  vocabulary-parallel in the last stage: train/vocab_parallel.py), with the
  all-reduces of activations and of their gradients run by the chosen
  all-reduce algorithm on the tp group (schemes/stage_execution.py).
- **data**: after the last backward of a step, each device all-reduces (and
  averages) its gradient bucket with the devices that hold the same shard in
  the other replicas, with `parallel.scheme`'s algorithm, then steps its own
  optimizer on its own parameters.
- **fp16 loss scaling**: a step is skipped if any share of the model
  overflowed, as Megatron-LM all-reduces found_inf across its model-parallel
  group. Before stepping, the pp x tp ranks of each replica sum their 0/1
  overflow flags in a 4-byte all-reduce ("overflow_vote"); every rank then
  skips (and backs off its loss scale) or steps together, so their loss
  scalers stay identical. The replicas need no vote: after the dp all-reduce
  they hold the same gradients.

The last stage's loss of a microbatch is its mean cross entropy times 1/m (and
the loss scale under fp16), so
the gradients accumulated over the m microbatches, averaged over the dp
replicas, are those of one device on the whole global batch. Each stage holds
a microbatch's measured activation bytes from its forward to its backward:
GPipe holds m, 1F1B at most pp - s on stage s. Under full recomputation
(train.checkpointing: full) it holds only the chunk's inputs, and runs the
chunk's forward again, with its all-reduces, before the backward. With
numerics off a chunk's work is replayed from its measured costs
(stage_execution.replay_forward, replay_backward), and with
`parallel.representatives` one rank per stage runs for all of them
(representatives.py).

Before each step every rank runs the job's `before_step` program (job.py: a
schedule's hyperparameters, a population's exploit, which copies each rank's
share from the donor's rank of the same coordinates).

    scheme = ModelParallel(job)        # parallel.pp > 1 or parallel.tp > 1
    job.start(); run_to_end(job.cluster.env)
    scheme.report_sections()["parallel"]["bubble_fraction"]
"""
import copy

import torch

from ..errors import ScenarioError
from ..train.partition import RankModule, assemble, balanced_counts, model_units, unit_flops
from ..train.precision import DTYPES, persistent_bytes, update_bytes
from ..train.tensor_parallel import AllReduceBackward, AllReduceForward
from .layout import Layout
from .pipeline_schedule import pipeline_schedule
from ..comm.ops import Recv, Send
from ..step_ops import Alloc, Await, Busy, Collective, Free, MemoryBound, Post, Wait
from .representatives import MirroredCollectives
from .rank_replicas import RankReplicas
from .stage_execution import ChunkCost, chunk_backward, chunk_forward, measure_chunk, replay_backward, replay_forward


def part_counts(model, layout: Layout, scenario, sample_x: torch.Tensor) -> tuple[list, list[int]]:
    """The model's splittable units and how many go to each of its pp x v parts, balanced on batches shaped
    like `sample_x` (one-line errors name the field at fault)."""
    pipeline = scenario.parallel.pipeline
    parts = layout.pp * pipeline.virtual_stages
    try:
        units = model_units(model, tensor_parallel=layout.tp > 1)
    except ValueError as error:
        raise ScenarioError(f"parallel.pp: {error}") from None
    if pipeline.split is not None:
        if len(pipeline.split) != parts or sum(pipeline.split) != len(units):
            raise ScenarioError(f"parallel.pipeline.split: needs {parts} counts (pp x virtual_stages) that add up to "
                                f"the model's {len(units)} splittable layers, got {list(pipeline.split)}")
        return units, list(pipeline.split)
    if parts > len(units):
        raise ScenarioError(f"parallel.pp: {parts} model parts (pp x virtual_stages) but the model has only "
                            f"{len(units)} splittable layers")
    return units, balanced_counts(unit_flops(model, units, sample_x), parts)


def boundary_activations(model, units: list, counts: list[int], sample_x: torch.Tensor, dtype) -> list[torch.Tensor]:
    """Meta tensors shaped as what each model part but the last hands on for a microbatch like `sample_x`
    (its activation, and the gradient that comes back), the model in compute dtype `dtype`: the receive
    buffers of a pipeline's messages, whose sizes a stage must know before they arrive."""
    meta = copy.deepcopy(model).to("meta").to(dtype)
    h = torch.empty(sample_x.shape, dtype=dtype if sample_x.is_floating_point() else sample_x.dtype, device="meta")
    boundaries, first = [], 0
    with torch.no_grad():
        for count in counts[:-1]:
            for unit in units[first:first + count]:
                for index in unit:
                    h = meta[index](h)
            first += count
            boundaries.append(h)
    return boundaries


def rank_shares(model, layout: Layout, scenario, parts: tuple[list, list[int]], ranks=None) -> list[RankModule | None]:
    """Every job rank's share of `model` under `layout`, cut into `parts` (part_counts' units and counts; None
    for a rank not in `ranks`, when given; one-line errors name the field at fault)."""
    pipeline = scenario.parallel.pipeline
    units, counts = parts
    shares = []
    for rank in range(layout.world):
        if ranks is not None and rank not in ranks:
            shares.append(None)
            continue
        where = layout.coordinates(rank)
        part_ids = [chunk * layout.pp + where["pp"] for chunk in range(pipeline.virtual_stages)]
        try:
            shares.append(RankModule(model, units, counts, part_ids, where["tp"], layout.tp,
                                     scenario.train.checkpointing))
        except ValueError as error:
            raise ScenarioError(f"parallel.tp: the model cannot be split {layout.tp} ways: {error}") from None
    if layout.tp > 1 and not any(type(op) in (AllReduceForward, AllReduceBackward)
                                 for share in shares if share is not None for ops in share.ops for op in ops):
        raise ScenarioError("parallel.tp: the model has no layers to split (a Linear, element-wise, Linear run, "
                            "or gpt blocks)")
    return shares


class ModelParallel(RankReplicas):
    """dp x pp x tp training with a pipeline schedule, tensor-parallel layers and a gradient all-reduce."""

    state_placement = "sharded"  # each rank holds its own share of the model and its optimizer state
    only_ring_all_reduces = False

    def __init__(self, job, on_step=None):
        self.job = job
        self.layout: Layout = job.layout
        self.replicas = job.replicas
        self.world = job.world
        scenario = job.scenario
        parallel, train = scenario.parallel, scenario.train
        self.pipeline = parallel.pipeline
        self.microbatches = parallel.microbatches
        self.recompute = train.checkpointing == "full"  # each chunk's forward runs again before its backward
        self.steps = train.steps
        self.on_step = on_step
        # Every rank runs its program, or one per stage does for all (schemes/representatives.py)
        self.mirrored = MirroredCollectives(job) if parallel.representatives else None
        self.running = [rank for rank in range(self.world)
                        if self.mirrored is None or self._represented_by(rank) == rank]
        self.mirror_of = {job.devices[rank].rank: job.devices[self._represented_by(rank)].rank
                          for rank in range(self.world) if self._represented_by(rank) != rank}
        self.comms = ({dimension: self._communicators(self.layout.groups(dimension))
                       for dimension in ("dp", "tp")} if self.mirrored is None else {})
        if self.layout.pp > 1:  # each pipeline's activations and gradients, as Send/Recv programs
            self.comms["pp"] = self._communicators(self.layout.groups("pp"), all_reduce=False)
            self._boundaries = boundary_activations(job.model, *job.parts, job.sample_microbatch(),
                                                    DTYPES[train.precision])
        self.vote = train.precision == "fp16"  # fp16: the overflow vote of each replica's model-parallel group
        if self.vote and self.mirrored is None:
            self.comms["model"] = self._communicators(self.layout.replicas())
        self._voted: dict[int, list] = {}  # representatives: step -> [ranks at the vote, event of the last]
        self._mirrored_bytes = {"dp_allreduce": 0, "tp_allreduce": 0, "overflow_vote": 0}
        # (dimension, rank), or "vote" -> the nodes of the groups an all-reduce is timed with
        self._mirror_groups: dict[tuple[str, int] | str, list[tuple[str, ...]]] = {}
        self._held = [None if r is None else persistent_bytes(r.params, train.precision, train.optimizer)
                      for r in self.replicas]
        self._step_bytes = [None if r is None else update_bytes(r.params, train.precision, train.optimizer)
                            for r in self.replicas]
        self._costs: dict[tuple, ChunkCost] = {}  # by model part and shapes: the same on every rank holding it
        self._losses = [[] for _ in range(self.steps)]
        self._ranks_done = [0] * self.steps
        self._rank_losses = {rank: [] for rank in range(self.world)}  # rank -> its losses of every step
        self.loss_curve: list[tuple[float, float | None]] = []

    def _communicators(self, groups: list[list[int]], all_reduce: bool = True) -> dict[int, tuple]:
        """rank -> (communicator of its group among `groups`, its rank there, the group's all-reduce, or None
        without `all_reduce`)."""
        by_rank = {}
        for group in groups:
            comm = self.job.communicator(group)
            program = self.job.all_reduce(group) if all_reduce and len(group) > 1 else None
            for index, rank in enumerate(group):
                by_rank[rank] = (comm, index, program)
        return by_rank

    def _represented_by(self, rank: int) -> int:
        """The rank whose program stands for `rank`'s: itself, or with representatives its stage's rank
        with tp 0 in replica 0."""
        if self.mirrored is None:
            return rank
        return self.layout.rank(pp=self.layout.coordinates(rank)["pp"])

    @classmethod
    def steps_until_every_rank_stepped(cls, world: int) -> int:
        return 1

    # --- the program of one rank ---

    def program(self, rank: int):
        if self._represented_by(rank) != rank:
            return  # its representative's program stands for it
        replica = self.replicas[rank]
        for category, nbytes in self._held[rank].items():
            yield Alloc(category, nbytes)
        stage, chunks = self.layout.coordinates(rank)["pp"], len(replica.model.chunks)
        parts = self.layout.pp * chunks
        schedule = pipeline_schedule(self.pipeline.schedule, self.layout.pp, stage, self.microbatches, chunks)
        dtype = replica.precision.name
        receives = {}  # (step, direction, microbatch, receiving part) -> the handle of its posted Recv
        if self.layout.pp > 1 and self.steps:
            receives.update((yield from self._post_receives(rank, schedule, 0)))

        def tp_all_reduce(buffer):
            buffer = buffer.view(-1)  # activations: collectives cut a buffer into parts along its first dimension
            if self.mirrored is not None:
                return self._mirrored_all_reduce("tp", rank, buffer, "tp_allreduce")
            tp_comm, tp_rank, tp_reduce = self.comms["tp"][rank]
            return Collective(tp_reduce(tp_rank, self.layout.tp, buffer), "tp_allreduce", tp_comm, tp_rank)

        def dp_all_reduce(buffer):
            if self.mirrored is not None:
                return self._mirrored_all_reduce("dp", rank, buffer, "dp_allreduce")
            dp_comm, dp_rank, dp_reduce = self.comms["dp"][rank]
            return Collective(dp_reduce(dp_rank, self.layout.dp, buffer, average=True), "dp_allreduce", dp_comm,
                              dp_rank)

        for step in range(self.steps):
            if not (yield from self.job.before_step(rank, step)):
                break
            replica.grad_buffer.zero_()
            x, y = replica.loader.next_batch()
            x = replica.precision.cast_input(x)
            replica.last_batch = (x, y)
            xs, ys = x.chunk(self.microbatches), y.chunk(self.microbatches)
            loss_weight = replica.precision.loss_weight(1.0 / self.microbatches)
            pending, losses = {}, []
            if self.layout.pp > 1 and step + 1 < self.steps:  # the next step's receives, ahead of its sends
                receives.update((yield from self._post_receives(rank, schedule, step + 1)))
            for action in schedule:
                part = action.chunk * self.layout.pp + stage
                ops = replica.model.ops[action.chunk]
                if action.kind == "forward":
                    last = part == parts - 1
                    if part == 0:
                        inputs = (xs[action.microbatch],)
                    else:
                        received = yield Await(receives.pop((step, 0, action.microbatch, part)), idle="bubble")
                        inputs = (received.requires_grad_(),)
                    target = ys[action.microbatch] if last else None
                    cost = self._cost(replica, action.chunk, part, inputs, target)
                    held = sum(t.nbytes for t in inputs) if self.recompute else cost.activation_bytes
                    yield Alloc("activations", held)
                    if self.job.numerics:
                        outputs, tape, loss = yield from chunk_forward(ops, inputs, tp_all_reduce, cost, dtype, target,
                                                                       loss_weight)
                        output = outputs[0].detach()
                    else:
                        tape, loss = None, None
                        output = yield from replay_forward(cost, tp_all_reduce, dtype)
                    # under recomputation the backward runs the forward again from the inputs
                    pending[action.microbatch, action.chunk] = (inputs, target, None if self.recompute else tape,
                                                                cost, held)
                    if last:
                        losses.append(loss)
                    else:
                        yield self._send(rank, step, 0, action.microbatch, part + 1, output)
                else:
                    inputs, target, tape, cost, held = pending.pop((action.microbatch, action.chunk))
                    grads = None
                    if part < parts - 1:
                        grads = ((yield Await(receives.pop((step, 1, action.microbatch, part)), idle="bubble")),)
                    if self.recompute:
                        yield Alloc("activations", cost.activation_bytes)
                    if self.job.numerics:
                        if self.recompute:
                            _, tape, _ = yield from chunk_forward(ops, inputs, tp_all_reduce, cost, dtype, target,
                                                                  loss_weight)
                        input_grads = yield from chunk_backward(tape, grads, tp_all_reduce, cost, dtype)
                        input_grad = input_grads[0]
                    else:
                        if self.recompute:
                            yield from replay_forward(cost, tp_all_reduce, dtype)
                        input_grad = yield from replay_backward(cost, tp_all_reduce, dtype)
                    yield Free("activations", held)
                    if self.recompute:
                        yield Free("activations", cost.activation_bytes)
                    if part > 0:
                        yield self._send(rank, step, 1, action.microbatch, part - 1, input_grad)
            if self.layout.dp > 1:
                yield dp_all_reduce(replica.grad_buffer)
            found_inf = replica.precision.find_overflow(replica.grad_buffer)
            if self.vote:
                found_inf = yield from self._overflow_vote(rank, step, found_inf)
            replica.apply_update(replica.precision.settle(found_inf))
            yield MemoryBound(self._step_bytes[rank], "optimizer step", kind="optimizer")
            self._step_done(rank, step, losses)

    def _overflow_vote(self, rank: int, step: int, found_inf: bool):
        """Step program: whether any rank of `rank`'s model-parallel group found an overflow (a sum of
        0/1 flags, one fp32 each). Representatives (numerics off: no overflow) wait for each other (every
        stage's), then take the time of their replica's vote alone: four bytes a rank, latency-bound, which
        the other replicas' votes on shared switch uplinks do not delay (timing them all together flow by
        flow would cost millions of transfers at thousands of GPUs)."""
        flag = torch.tensor([float(found_inf)])
        if self.mirrored is None:
            comm, index, all_reduce = self.comms["model"][rank]
            yield Collective(all_reduce(index, comm.world, flag), "overflow_vote", comm, index)
            return bool(flag.item() > 0)
        if "vote" not in self._mirror_groups:  # replica 0's model-parallel group, where the representatives are
            self._mirror_groups["vote"] = [tuple(self.job.devices[member].node for member in self.layout.replicas()[0])]
        seconds, nbytes, staging = self.mirrored.all_reduce(self._mirror_groups["vote"], flag)
        env = self.job.cluster.env
        arrived = self._voted.setdefault(step, [0, env.event()])
        arrived[0] += 1
        if arrived[0] == len(self.running):  # the last stage to arrive counts the votes' bytes
            del self._voted[step]
            self._mirrored_bytes["overflow_vote"] += nbytes * self.layout.dp  # every replica votes alike
            arrived[1].succeed()
        yield Wait(arrived[1])  # idle, as a rank whose all-reduce waits for its peers' first sends
        yield Busy(seconds, "overflow_vote", "communication", staging=staging)
        return False

    def _mirrored_all_reduce(self, dimension: str, rank: int, buffer: torch.Tensor, label: str) -> Busy:
        """Step program operation: representative `rank`'s all-reduce along `dimension`, timed with the
        groups mirroring its group (the other replicas' for tp, the other tp ranks' for dp)."""
        if (dimension, rank) not in self._mirror_groups:
            stage = self.layout.coordinates(rank)["pp"]
            mirrors = "dp" if dimension == "tp" else "tp"
            self._mirror_groups[dimension, rank] = [
                tuple(self.job.devices[member].node
                      for member in self.layout.group(dimension, self.layout.rank(pp=stage, **{mirrors: index})))
                for index in range(getattr(self.layout, mirrors))]
        groups = self._mirror_groups[dimension, rank]
        seconds, nbytes, staging = self.mirrored.all_reduce(groups, buffer)
        self._mirrored_bytes[label] += nbytes * len(groups)
        return Busy(seconds, label, "communication", staging=staging)

    # --- pipeline messages: Send/Recv programs on the pipeline's communicator (comm/simulated.py's mailbox) ---

    def _tag(self, step: int, direction: int, microbatch: int, part: int) -> int:
        """A message's tag: its step's parity (a stage posts two steps' receives), direction (0 forward, 1
        backward), microbatch and receiving model part."""
        parts = self.layout.pp * self.pipeline.virtual_stages
        return ((step % 2 * 2 + direction) * self.microbatches + microbatch) * parts + part

    def _post_receives(self, rank: int, schedule, step: int):
        """Step program: post every receive of job rank `rank`'s step `step`; returns {message: handle}.

        A stage posts a step's receives before its peers can send them (at the start of the step before), as
        Megatron-LM posts its irecvs ahead: a send's bytes then start to move the moment it is posted, and
        the sender never waits for its receiver. An activation and the gradient that comes back for it have
        the shape of the boundary between their two model parts (`boundary_activations`)."""
        comm, index, _ = self.comms["pp"][rank]
        pp, parts = self.layout.pp, self.layout.pp * self.pipeline.virtual_stages
        handles = {}
        for action in schedule:
            part = action.chunk * pp + self.layout.coordinates(rank)["pp"]
            direction, peer_part = (0, part - 1) if action.kind == "forward" else (1, part + 1)
            if not 0 <= peer_part < parts:
                continue
            like = self._boundaries[min(part, peer_part)]
            out = torch.empty(like.shape, dtype=like.dtype, device="cpu" if self.job.numerics else "meta")
            tag = self._tag(step, direction, action.microbatch, part)
            handles[step, direction, action.microbatch, part] = yield Post(
                _receive(peer_part % pp, out, tag), "pp_p2p", comm, index)
        return handles

    def _send(self, rank: int, step: int, direction: int, microbatch: int, part: int, tensor: torch.Tensor) -> Post:
        """Step-program operation: send `tensor` to model part `part` without waiting (torch's isend; the
        stage never awaits it: its receiver does, and the interpreter completes it)."""
        comm, index, _ = self.comms["pp"][rank]
        tag = self._tag(step, direction, microbatch, part)
        return Post(_send(part % self.layout.pp, tensor, tag), "pp_p2p", comm, index)

    def _cost(self, replica, chunk: int, part: int, inputs: tuple, target) -> ChunkCost:
        """What model part `part` (the replica's chunk `chunk`) costs on inputs of these shapes, measured
        once: every rank holding that part (each tp slice, each data-parallel replica) has the same."""
        key = (part, tuple(t.shape for t in inputs), None if target is None else tuple(target.shape))
        if key not in self._costs:
            self._costs[key] = measure_chunk(replica.model.chunks[chunk], replica.model.chunk_ops, inputs, target)
        return self._costs[key]

    def rank_losses(self, rank: int) -> list[list[float]]:
        """The losses job rank `rank` computed in each step (its microbatches' in the last stage, none in the
        others), where the job holds only some ranks (a real run, simtrain/real: each process its own)."""
        return self._rank_losses[rank]

    def _step_done(self, rank: int, step: int, losses: list) -> None:
        if self.job.numerics:
            self._rank_losses[rank].append([loss.item() for loss in losses])
        self._losses[step].extend(losses)
        self._ranks_done[step] += 1
        if self._ranks_done[step] < len(self.running):
            return
        # every rank has stepped: the losses of all last-stage ranks are in
        losses, self._losses[step] = self._losses[step], None
        # every last-stage rank (each tp rank of each replica) computed each of its microbatches' loss
        mean = float(sum(loss.item() for loss in losses)) / len(losses) if self.job.numerics else None
        now = self.job.cluster.env.now
        self.loss_curve.append((now, mean))
        if self.on_step is not None:
            self.on_step(step, now, mean)

    # --- what the runner reads ---

    def stuck(self) -> list[int]:
        stuck = set()
        for dimension, by_rank in self.comms.items():
            for rank, (comm, index, _) in by_rank.items():
                if index in comm.stuck():
                    stuck.add(self.job.devices[rank].rank)
        return sorted(stuck)

    def trained_model(self):
        """The whole model, assembled from the shares of data-parallel replica 0 (with representatives, which
        compute nothing, the initial meta model)."""
        if self.mirrored is not None:
            return self.job.model
        return self.assemble({rank: self.replicas[rank].model.pieces() for rank in range(self.world)})

    def assemble(self, pieces: dict) -> "torch.nn.Module":
        """The whole model from ranks' pieces (rank -> RankModule.pieces()): those of data-parallel replica 0."""
        return assemble(self.job.model, [piece for rank in self.layout.replicas()[0] for piece in pieces[rank]])

    def final_models(self) -> list:
        return [self.trained_model()]

    def samples_per_step(self) -> int:
        return self.layout.dp * self.job.scenario.data.batch_size

    def single_device_step_s(self) -> float | None:
        return None  # the model is split because one device is not the baseline

    def _collective_bytes(self, communicators: str, label: str) -> int:
        """Bytes the groups of `self.comms[communicators]` sent for `label` (each group's communicator once)."""
        if self.mirrored is not None and communicators != "pp":
            return self._mirrored_bytes[label]
        groups = {id(comm): comm for comm, _, _ in self.comms.get(communicators, {}).values()}
        return sum(comm.bytes_by_label.get(label, 0) for comm in groups.values())

    def report_sections(self) -> dict:
        log = self.job.cluster.log
        sim_time = log.last_end_s
        return {"parallel": {
            "dp": self.layout.dp, "pp": self.layout.pp, "tp": self.layout.tp,
            "placement": list(self.layout.placement),
            "schedule": self.pipeline.schedule if self.layout.pp > 1 else None,
            "microbatches": self.microbatches,
            "virtual_stages": self.pipeline.virtual_stages,
            "stage_of_rank": [self.layout.coordinates(rank)["pp"] for rank in range(self.world)],
            "representatives": self.mirrored is not None,
            "bubble_fraction": (sum(log.total(self.job.devices[rank].rank, "bubble") for rank in self.running)
                                / (sim_time * len(self.running)) if sim_time > 0 else 0.0),
            # a representative's sends stand for those of every tp rank of every replica
            "bytes_by_kind": {"dp_allreduce": self._collective_bytes("dp", "dp_allreduce"),
                              "pp_p2p": self._collective_bytes("pp", "pp_p2p") * (self.world // len(self.running)),
                              "tp_allreduce": self._collective_bytes("tp", "tp_allreduce"),
                              "overflow_vote": self._collective_bytes("model", "overflow_vote")},
        }}




def _send(peer: int, tensor: torch.Tensor, tag: int):
    """A pipeline stage's point-to-point program: send `tensor` to pipeline rank `peer`."""
    yield Send(peer, tensor, tag)


def _receive(peer: int, out: torch.Tensor, tag: int):
    """A pipeline stage's point-to-point program: receive into `out` from pipeline rank `peer`; returns it."""
    return (yield Recv(peer, out, tag=tag))
