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
    scheme.report_sections()["parallel"]["schedule"]    # the layout; report/parallel.py adds bubble and bytes
"""
import torch

from ..comm.simulated import SimCommunicator
from ..errors import ScenarioError
from ..train.partition import RankModule, assemble, balanced_counts, model_units, unit_flops
from ..train.precision import persistent_bytes, update_bytes
from ..train.tensor_parallel import AllReduceBackward, AllReduceForward
from .layout import Layout
from .pipeline_schedule import pipeline_schedule
from .program import Alloc, Busy, Collective, Free, MemoryBound, PostTransfer, Wait
from .representatives import MirroredCollectives
from .rank_replicas import RankReplicas
from .stage_execution import ChunkCost, chunk_backward, chunk_forward, measure_chunk, replay_backward, replay_forward


def rank_shares(model, layout: Layout, scenario, sample_x: torch.Tensor, ranks=None) -> list[RankModule | None]:
    """Every job rank's share of `model` under `layout` (None for a rank not in `ranks`, when given), the parts
    balanced on batches shaped like `sample_x` (one-line errors name the field at fault)."""
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
        counts = list(pipeline.split)
    elif parts > len(units):
        raise ScenarioError(f"parallel.pp: {parts} model parts (pp x virtual_stages) but the model has only "
                            f"{len(units)} splittable layers")
    else:
        counts = balanced_counts(unit_flops(model, units, sample_x), parts)
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
        self.comms = ({dimension: self._communicators(self.layout.groups(dimension), parallel)
                       for dimension in ("dp", "tp")} if self.mirrored is None else {})
        self.vote = train.precision == "fp16"  # fp16: the overflow vote of each replica's model-parallel group
        if self.vote and self.mirrored is None:
            self.comms["model"] = self._communicators(self.layout.replicas(), parallel)
        self._voted: dict[int, list] = {}  # representatives: step -> [ranks at the vote, event of the last]
        # (dimension, rank), or "vote" -> the nodes of the groups an all-reduce is timed with
        self._mirror_groups: dict[tuple[str, int] | str, list[tuple[str, ...]]] = {}
        self._held = [None if r is None else persistent_bytes(r.params, train.precision, train.optimizer)
                      for r in self.replicas]
        self._step_bytes = [None if r is None else update_bytes(r.params, train.precision, train.optimizer)
                            for r in self.replicas]
        self._costs: dict[tuple, ChunkCost] = {}  # by model part and shapes: the same on every rank holding it
        self._arrivals: dict[tuple, object] = {}  # (job rank, message) -> simpy event of its arrival
        self._waiting: set[int] = set()  # job ranks waiting for a message
        self._losses = [[] for _ in range(self.steps)]
        self._ranks_done = [0] * self.steps
        self.loss_curve: list[tuple[float, float | None]] = []

    def _communicators(self, groups: list[list[int]], parallel) -> dict[int, tuple]:
        """rank -> (communicator of its group among `groups`, its rank there, the group's all-reduce)."""
        by_rank = {}
        topology = self.job.cluster.topology
        for group in groups:
            devices = [self.job.devices[rank] for rank in group]
            nodes = [device.node for device in devices]
            comm = SimCommunicator(self.job.cluster.network, nodes, log=self.job.cluster.log,
                                   ledgers=[device.memory for device in devices],
                                   global_ranks=[device.rank for device in devices])
            all_reduce = (self.job.all_reduce_builder(parallel.scheme, topology, nodes, parallel.channels,
                                                      "parallel.scheme", "parallel.channels")
                          if len(group) > 1 else None)
            for index, rank in enumerate(group):
                by_rank[rank] = (comm, index, all_reduce)
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
        pipeline = self.layout.group("pp", rank)
        dtype = replica.precision.name

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
            for action in schedule:
                part = action.chunk * self.layout.pp + stage
                ops = replica.model.ops[action.chunk]
                if action.kind == "forward":
                    last = part == parts - 1
                    if part == 0:
                        inputs = (xs[action.microbatch],)
                    else:
                        received = yield from self._receive(rank, ("forward", action.microbatch, part))
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
                        yield from self._send(rank, pipeline[(stage + 1) % self.layout.pp], output,
                                              ("forward", action.microbatch, part + 1))
                else:
                    inputs, target, tape, cost, held = pending.pop((action.microbatch, action.chunk))
                    grads = None
                    if part < parts - 1:
                        received = yield from self._receive(rank, ("backward", action.microbatch, part))
                        grads = (received,)
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
                        yield from self._send(rank, pipeline[(stage - 1) % self.layout.pp], input_grad,
                                              ("backward", action.microbatch, part - 1))
            if self.layout.dp > 1:
                yield dp_all_reduce(replica.grad_buffer)
            found_inf = replica.precision.find_overflow(replica.grad_buffer)
            if self.vote:
                found_inf = yield from self._overflow_vote(rank, step, found_inf)
            replica.apply_update(replica.precision.settle(found_inf))
            yield MemoryBound(self._step_bytes[rank], "optimizer step", kind="optimizer")
            self._step_done(step, losses)

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
        counted = 0
        if arrived[0] == len(self.running):  # the last stage to arrive logs the votes' bytes
            del self._voted[step]
            counted = nbytes * self.layout.dp  # every replica votes alike
            arrived[1].succeed()
        yield Wait(arrived[1])  # idle, as a rank whose all-reduce waits for its peers' first sends
        yield Busy(seconds, "overflow_vote", "communication", nbytes=counted, staging=staging)
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
        return Busy(seconds, label, "communication", nbytes=nbytes * len(groups), staging=staging)

    def _send(self, rank: int, peer: int, tensor: torch.Tensor, message: tuple):
        """Step program: hand `tensor` to the link towards job rank `peer` and carry on (a non-blocking
        send); it lands in the peer's mailbox when the transfer ends."""
        arrival = self._arrival(peer, message)
        done = yield PostTransfer(self.job.devices[rank].node, self.job.devices[peer].node, tensor.nbytes, "pp_p2p")
        posted = self.job.cluster.env.now
        done.callbacks.append(lambda _: arrival.succeed((tensor, posted)))
        # a representative's send stands for those of every rank it represents
        self.job.cluster.log.count_bytes(self.job.devices[rank].rank, "communication", "pp_p2p",
                                         tensor.nbytes * (self.world // len(self.running)))

    def _receive(self, rank: int, message: tuple):
        """Step program: wait for `message` (direction, microbatch, model part) to reach job rank `rank`;
        returns a copy of its tensor. Waiting while it moves is communication; before it was sent, bubble."""
        env, log, device = self.job.cluster.env, self.job.cluster.log, self.job.devices[rank]
        waiting_from = env.now
        self._waiting.add(rank)
        tensor, posted = yield Wait(self._arrival(rank, message))
        self._waiting.discard(rank)
        del self._arrivals[rank, message]
        moving_from = max(waiting_from, posted)
        if moving_from > waiting_from:
            log.span(device.rank, "bubble", "bubble", waiting_from, moving_from)
        if env.now > moving_from:  # its bytes are counted by the send
            log.span(device.rank, "communication", "pp_p2p", moving_from, env.now)
        return tensor.detach().clone()

    def _arrival(self, rank: int, message: tuple):
        """The event of `message` reaching job rank `rank` (made by whichever side asks first)."""
        key = (rank, message)
        if key not in self._arrivals:
            self._arrivals[key] = self.job.cluster.env.event()
        return self._arrivals[key]

    def _cost(self, replica, chunk: int, part: int, inputs: tuple, target) -> ChunkCost:
        """What model part `part` (the replica's chunk `chunk`) costs on inputs of these shapes, measured
        once: every rank holding that part (each tp slice, each data-parallel replica) has the same."""
        key = (part, tuple(t.shape for t in inputs), None if target is None else tuple(target.shape))
        if key not in self._costs:
            self._costs[key] = measure_chunk(replica.model.chunks[chunk], replica.model.chunk_ops, inputs, target)
        return self._costs[key]

    def _step_done(self, step: int, losses: list) -> None:
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
        stuck = {self.job.devices[rank].rank for rank in self._waiting}
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
        shares = [self.replicas[rank].model for rank in range(self.world)
                  if self.layout.coordinates(rank)["dp"] == 0]
        return assemble(self.job.model, shares)

    def final_models(self) -> list:
        return [self.trained_model()]

    def samples_per_step(self) -> int:
        return self.layout.dp * self.job.scenario.data.batch_size

    def single_device_step_s(self) -> float | None:
        return None  # the model is split because one device is not the baseline

    def report_sections(self) -> dict:
        """report.json's `parallel`: the layout (report/parallel.py adds the bubble and the bytes)."""
        return {"parallel": {
            "dp": self.layout.dp, "pp": self.layout.pp, "tp": self.layout.tp,
            "placement": list(self.layout.placement),
            "schedule": self.pipeline.schedule if self.layout.pp > 1 else None,
            "microbatches": self.microbatches,
            "virtual_stages": self.pipeline.virtual_stages,
            "stage_of_rank": [self.layout.coordinates(rank)["pp"] for rank in range(self.world)],
            "representatives": self.mirrored is not None,
        }}


