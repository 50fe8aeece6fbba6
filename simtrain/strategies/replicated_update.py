"""DDP under pipeline and tensor parallelism: the replicated strategy of a model-parallel step's data parallelism
(distributed_optimizer.py is the sharded one; expert_model_parallel.py's ExpertUpdate adds the experts' groups).

After the last microbatch's backward each rank all-reduces (and averages) its
share's gradient over its dp (x cp) group, Megatron-Core's dp-cp group, with
`parallel.all_reduce`'s algorithm, then steps its own optimizer on its whole
share. With `parallel.overlap` the gradient is cut into DDP's buckets of
`bucket_cap_mb` and each bucket's all-reduce runs beside that backward as
soon as the bucket is complete (bucket_overlap.py; with experts their
buckets apart, all-reduced over their holders: ExpertUpdate). A ring all-reduce sends
2(N-1)/N of the buffer per rank. With K-FAC (train.optimizer.name kfac, data
parallelism alone) the averaged gradient is preconditioned before the step
(strategies/kfac_sync.py), whose factors and decompositions each rank holds.

    update = ReplicatedUpdate(scheme)            # the ModelParallel scheme, parallel.sharding.stage 0
    output = yield from update.during(rank, action, cost, program)    # each schedule action (pipeline.py)
    yield from update.update(rank)               # after its last backward: all-reduce, vote (fp16), step
"""
from ..step_ops import Collective, MemoryBound, PostCollective, WaitCollectives
from ..train.precision import persistent_bytes, update_bytes
from .bucket_overlap import BucketOverlap, buffer_runs, chunk_params, megatron_buckets
from .kfac_sync import DistributedKfac
from .overflow_vote import overflow_vote
from .shard_layout import ShardLayout


class ReplicatedUpdate:
    """Plain DDP under pp x tp: the gradient all-reduced over the dp group, every rank stepping its share; with
    `parallel.overlap` in DDP's buckets beside the last microbatch's backward (bucket_overlap.py)."""

    def __init__(self, scheme):
        self.scheme = scheme
        parallel, train = scheme.job.scenario.parallel, scheme.job.scenario.train
        replicas = scheme.replicas
        self.held = [None if r is None else persistent_bytes(r.params, train.precision, train.optimizer,
                                                             r.main_grads) for r in replicas]
        self._step_bytes = [None if r is None else update_bytes(r.params, train.precision, train.optimizer,
                                                                r.main_grads) for r in replicas]
        self._step_kernels = scheme.update_kernels(scheme.running)  # a calibrated host's, charged kernel_overhead
        self.kfac = None  # K-FAC's preconditioning between the all-reduce and the step
        if train.optimizer.name == "kfac":  # its collectives on the dp group as the scheme holds it now (regroup)
            self.kfac = DistributedKfac(replicas, scheme.job.devices, lambda rank: scheme.comms.dp_cp[rank],
                                        train.optimizer)
            for rank, held in enumerate(self.held):
                if held is not None:
                    held["kfac"] = self.kfac.memory_bytes(rank)
        self.microbatches, self.overlap_param_gather = scheme.microbatches, False  # what BucketOverlap reads
        overlapping = parallel.overlapped and scheme.layout.dp * scheme.layout.cp > 1
        self.buckets: dict[int, BucketOverlap] = {}  # rank -> its DDP buckets, with parallel.overlap
        self._tp_summed: dict[int, set] = {}  # rank -> ids of its parameters summed over tp (tp_summed_parameters)
        # (rank, unit) -> (the gradient buffer, the bucket's view of it): made once, while the buffer is the same
        self._views: dict[tuple[int, int], tuple] = {}
        for rank in scheme.running if overlapping else ():
            if replicas[rank] is None:  # a real run's process holds its own rank alone
                continue
            replica, chunks, experts = replicas[rank], chunk_params(replicas[rank]), self.first_expert(rank)
            # closed at bucket_cap_bytes or more, as torch DDP closes its buckets; the experts' in buffers of their
            # own (ExpertUpdate), as Megatron-Core's
            cap = max(1, -(-int(parallel.bucket_cap_bytes) // replica.grad_buffer.element_size()))
            runs = buffer_runs(chunks, experts)
            units = megatron_buckets([[replica.params[p].numel() for p in run] for run in runs], [True] * len(runs),
                                     cap)
            layout = ShardLayout([p.numel() for p in replica.params], units, 1)  # one shard: grad_buffer's offsets
            self.buckets[rank] = BucketOverlap(self, rank, layout, chunks, experts)
            self._tp_summed[rank] = {id(p) for p in replica.model.tp_summed_parameters()}
        self.sums_tp_grads = overlapping  # the buckets sum them over tp, each before its all-reduce

    def first_expert(self, rank: int) -> int | None:
        """The index of the rank's first expert parameter, its experts laid out last (ExpertUpdate's); None."""
        return None

    def begin(self, rank: int):
        """Step program: a new step for the rank's buckets (nothing else before a step's microbatches)."""
        if rank in self.buckets:
            yield from self.buckets[rank].begin()

    def resume(self, rank: int):
        """Step program: nothing to fetch after a load (each rank holds its whole share)."""
        yield from ()

    def before(self, rank: int, action):
        """Step program: nothing before a schedule action."""
        yield from ()

    def after(self, rank: int, action):
        """Step program, after a schedule action: with overlap, the buckets the backward's end completed."""
        if rank in self.buckets:
            yield from self.buckets[rank].after(action)

    def during(self, rank: int, action, cost, program):
        """Step program: a schedule action's forward or backward `program`; with overlap, each bucket's all-reduce
        posted in the last microbatch's backward once the bucket is complete (bucket_overlap.py)."""
        if rank in self.buckets:
            return (yield from self.buckets[rank].during(action, cost, program))
        return (yield from program)

    def post_reduce(self, rank: int, unit: int):
        """Step program (BucketOverlap's): bucket `unit`'s all-reduce (averaging) over the dp (x cp) group, posted
        on the rank's communication stream (the buckets' all-reduces run one after another, as DDP's on its
        process group's stream); `reduce` waits for them all."""
        dp_comm, dp_index, dp_reduce = self.scheme.comms.dp_cp[rank]
        buffer = self.scheme.replicas[rank].grad_buffer
        kept = self._views.get((rank, unit))
        if kept is None or kept[0] is not buffer:
            kept = self._views[rank, unit] = (buffer, buffer[self.buckets[rank].layout.unit_slice(unit)])
        view = kept[1]
        yield PostCollective(dp_reduce(dp_index, dp_comm.world, view, average=True), "dp_allreduce", dp_comm,
                             dp_index)

    def sum_bucket_tp_grads(self, rank: int, unit: int):
        """Step program (BucketOverlap's): the gradients of bucket `unit`'s parameters that are each tp rank's
        share (train/partition.py tp_summed_parameters: sequence parallelism's, an MoE layer's) summed across the
        tp group, before its all-reduce."""
        replica, whole = self.scheme.replicas[rank], self._tp_summed[rank]
        if not whole:  # one tp rank, or none such: nothing to sum
            return
        grads = replica.gradients([replica.params[index] for index in self.buckets[rank].layout.units[unit]
                                   if id(replica.params[index]) in whole])
        if grads:
            yield from self.scheme.sum_tp_grads(rank, grads)

    def update(self, rank: int):
        """Step program: all-reduce and average the gradient (`reduce`), precondition it (K-FAC), vote on an fp16
        overflow, step."""
        scheme = self.scheme
        replica = scheme.replicas[rank]
        yield from self.reduce(rank)
        if self.kfac is not None:
            yield from self.kfac.step(rank)
        found_inf = replica.precision.find_overflow(replica.grad_buffer)
        if scheme.vote:
            found_inf = yield from overflow_vote(*scheme.comms.model[rank], found_inf)
        replica.apply_update(replica.precision.settle(found_inf))
        yield MemoryBound(self._step_bytes[rank], "optimizer step", kind="optimizer", kernels=self._step_kernels[rank],
                          updates=1)

    def update_s(self, rank: int) -> float:
        """Seconds rank `rank`'s update takes its device alone: the optimizer's step, and K-FAC's work of a step
        with nothing sent."""
        kfac = self.kfac.single_device_step_s(self.scheme.steps) if self.kfac is not None else 0.0
        return self.scheme.job.devices[rank].memory_bound_time(self._step_bytes[rank]) + kfac

    def reduce(self, rank: int):
        """Step program: all-reduce and average the gradient over the dp (x cp) group (expert_model_parallel.py's
        ExpertUpdate: the experts' over their holders)."""
        scheme = self.scheme
        if rank in self.buckets:  # the buckets' all-reduces, posted in the backward, awaited
            yield WaitCollectives()
            self.buckets[rank].reducing = []
        elif scheme.layout.dp * scheme.layout.cp > 1:  # the dp-cp group (context parallelism: cp > 1)
            dp_comm, dp_index, dp_reduce = scheme.comms.dp_cp[rank]
            yield Collective(dp_reduce(dp_index, dp_comm.world, scheme.replicas[rank].grad_buffer, average=True),
                             "dp_allreduce", dp_comm, dp_index)

    def finish(self, rank: int):
        """Step program, after a rank's last step: nothing left to gather."""
        yield from ()

    def ended(self, rank: int) -> None:
        """A rank's program has ended: nothing to gather."""

    def publish(self) -> None:
        """The clock stopped before the programs ended: every rank holds its share whole already."""

    def whole_model(self, rank: int):
        """The rank's share of the model, whole (what ModelParallel.trained_model assembles)."""
        return self.scheme.replicas[rank].model

    def report_sections(self) -> dict:
        """report.json's `parallel` fields of DDP (whether its buckets' all-reduces overlapped the backward, and
        how many a rank has: one, the whole gradient, without overlap), and `kfac` with K-FAC (kfac_sync.py)."""
        return {"parallel": {"overlap": bool(self.buckets),
                             "buckets": max((bucket.units for bucket in self.buckets.values()), default=1)},
                **(self.kfac.report_section(self.scheme.steps) if self.kfac is not None else {})}
