"""ZeRO-Offload: a sharded rank's optimizer (and optionally its parameters) in host memory, stepped by the host.

`parallel.sharding.offload` moves part of each rank's share of sharded data
parallelism (strategies/distributed_optimizer.py, in every layout) into
`cluster.shared_memory`, the host's DRAM (hw/shared_memory.py), as
DeepSpeed's ZeRO-Offload does (Ren et al. 2021; DeepSpeed's
`offload_optimizer` and, under stage 3, `offload_param`):

- `optimizer`: the fp32 master shard, its fp32 gradient and the optimizer's
  state of it live on the host; the device keeps its parameters in the
  compute dtype (all of them under stages 1 and 2, its chunks under stage 3)
  and, under stage 1, its whole gradient;
- `optimizer_and_parameters` (stage 3): the rank's parameter chunks
  live on the host too; the device holds a unit's parameters only while they
  are gathered.

What a rank holds, by ledger (P the padded parameter count, S = P / N its
shard's, e the compute dtype's bytes, K S the optimizer's state: Adam's 8 S):

    device  weights    P e (stages 1, 2), S e (stage 3), 0 (with parameters)
            gradients  P e (stage 1), 0 (stages 2, 3: a unit's gradient lives only while it is reduced)
    host    master_weights 4 S, gradients 4 S, optimizer_state K S, weights S e (with parameters)

so for bf16 Adam under stage 2 a device keeps 2 Psi and the host 16 Psi / N
a rank (ZeRO-Offload's 2 Psi on the GPU; its 12 Psi of fp32 parameter and
moments on the CPU, with simtrain's fp32 master gradient 4 Psi beside them).

Time, on the simulated clock: as each unit's reduce-scatter ends, the rank's
reduced chunk (S_u elements in the reduce dtype) is copied to the host over
its host link (a `network.transfer` from the device to the store: the
device's own host link, then the store's link that every rank shares),
overlapped with the rest of the backward. The optimizer step waits for the
last copy, then runs on the host unit by unit (hw/host_compute.py: its DRAM
traffic at the DRAM bandwidth of `cluster.shared_memory.host`, or at the
store's, shared by the ranks stepping at once); as each unit's step ends, its
updated chunk (in the compute dtype) is copied back to the device while the
host steps the next unit, and the step ends when the last copy has landed (then stages 1 and 2 all-gather the parameters as without
offload). Under `optimizer_and_parameters` nothing is copied back after the
step: the rank's chunk of a unit is copied from the host before each of its
gathers (not prefetched: the copy is exposed). With a rank's U units of
copies c_u = S_u e / host link, host steps h_u and exposed waits:

    step = (the step without offload) - (the device's update) + (waits on the last gradient copies)
           + h_0 + ... + h_{U-1} + (waits on the parameter copies after the last host step)

The numerics are the unoffloaded run's: the host steps the same fp32 shard
with the same optimizer, so the trained parameters are the same bit for bit.

    offload = HostOffload(job, {rank: shard.layout}, stage, "optimizer", element=2, reduce_element=2, main=False)
    offload.post_gradient(rank, unit)            # in the backward, as a unit's reduction ends
    yield from offload.gradients_on_host(rank)   # then the update, charged by offload.host_step(rank)
"""
from pydantic import Field

from ..hw.host_compute import host_step_s
from ..report.sections import ReportSection
from ..step_ops import Busy, Transfer, Wait
from ..train.optim import optimizer_state_bytes
from .scheme_checks import offload_host_bandwidth
from .sharded_replica import chunk_update_bytes

TO_HOST, FROM_HOST = "offload_gradients", "offload_parameters"  # the copies' labels
_FP32_BYTES = 4


class HostOffload:
    """A job's offload to the host: what each rank keeps there, its copies over the host link, the host step."""

    def __init__(self, job, layouts: dict, stage: int, what: str, element: int, reduce_element: int, main: bool):
        """`element`, `reduce_element`: bytes of an element of the compute and the reduce dtype; `main`: the ranks'
        gradient buffers are fp32 main gradients (train/replica.py main_grads_of)."""
        store = job.cluster.shared_memory
        self.job, self.store, self.layouts, self.stage = job, store, layouts, stage
        self.parameters = what == "optimizer_and_parameters"
        self.element, self.reduce_element = element, reduce_element
        self.grad_element = reduce_element if main else element  # the gradient buffer's
        train = job.scenario.train
        self.ranks = job.world  # the ranks that step together on the one host
        self.host_bandwidth = offload_host_bandwidth(store, job.scenario.cluster.shared_memory, what)
        self._step_bytes = {rank: [chunk_update_bytes(layout.chunk_numel(unit), train.precision, train.optimizer, main)
                                   for unit in range(len(layout.units))] for rank, layout in layouts.items()}
        self._to_host: dict[int, list] = {}  # rank -> the gradient copies posted this step

    # ---- memory ----

    def split(self, rank: int, held: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        """`held` (sharded_replica.held_bytes: rank `rank`'s bytes without offload) split into what the device and
        what the host keep, by category."""
        train, layout = self.job.scenario.train, self.layouts[rank]
        shard = layout.shard_numel
        weights = shard * self.element if self.stage == 3 else held["weights"]  # ZeRO-Offload's 16-bit shard
        device = {"weights": 0 if self.parameters else weights,
                  "gradients": layout.padded_numel * self.grad_element if self.stage == 1 else 0}
        host = {"master_weights": shard * _FP32_BYTES, "gradients": shard * _FP32_BYTES,
                "optimizer_state": optimizer_state_bytes(train.optimizer, shard * _FP32_BYTES)}
        if self.parameters:
            host["weights"] = weights
        return device, host

    def holding(self, rank: int, host: dict[str, int], program):
        """Step program: `program`, with `host`'s bytes held on the host's ledger while it runs."""
        for category, nbytes in host.items():
            self.store.memory.alloc(category, nbytes)
        try:
            return (yield from program)
        finally:
            for category, nbytes in host.items():
                self.store.memory.free(category, nbytes)

    # ---- the copies and the host step ----

    def post_gradient(self, rank: int, unit: int) -> None:
        """Start copying rank `rank`'s reduced chunk of unit `unit` to the host (it runs beside the program)."""
        nbytes = self.layouts[rank].chunk_numel(unit) * self.reduce_element
        self._to_host.setdefault(rank, []).append(self._post(rank, to_host=True, nbytes=nbytes))

    def gradient_after(self, program, rank: int, unit: int):
        """Collective program: `program` (HSDP's all-reduce of rank `rank`'s reduced chunk of unit `unit`), then
        that chunk's copy to the host posted as it ends."""
        value = yield from program
        self.post_gradient(rank, unit)
        return value

    def gradients_on_host(self, rank: int):
        """Step program: wait until every gradient copy rank `rank` posted has landed on the host."""
        yield from self._landed(rank, self._to_host.pop(rank, []), TO_HOST)

    def host_step(self, rank: int):
        """Step program: the host's optimizer step of rank `rank`'s shard, unit by unit, each unit's updated
        chunk copied back to the device as the next unit steps (unless the parameters live on the host);
        ends when the last copy has landed."""
        copies = []
        for unit, nbytes in enumerate(self._step_bytes[rank]):
            yield Busy(host_step_s(nbytes, self.ranks, self.host_bandwidth), "host optimizer step",
                       kind="optimizer", nbytes=nbytes)
            if not self.parameters:
                copies.append(self._post(rank, to_host=False,
                                         nbytes=self.layouts[rank].chunk_numel(unit) * self.element))
        yield from self._landed(rank, copies, FROM_HOST)

    def parameters_to_device(self, rank: int, unit: int):
        """Step program (optimizer_and_parameters): copy rank `rank`'s chunk of unit `unit` from the host."""
        if self.parameters:
            device = self.job.devices[rank]
            yield Transfer(self.store.node, device.node, self.layouts[rank].chunk_numel(unit) * self.element,
                           FROM_HOST)

    def _post(self, rank: int, to_host: bool, nbytes: int):
        """A copy between rank `rank`'s device and the host, started now: its event."""
        device = self.job.devices[rank]
        src, dst = (device.node, self.store.node) if to_host else (self.store.node, device.node)
        label = TO_HOST if to_host else FROM_HOST
        self.job.cluster.log.count_bytes(device.rank, "communication", label, nbytes)
        return self.job.cluster.network.transfer(src, dst, nbytes, label=label)

    def _landed(self, rank: int, copies: list, label: str):
        """Step program: wait for `copies`; the time waited is the rank's exposed communication."""
        env, device = self.job.cluster.env, self.job.devices[rank]
        started = env.now
        for copy in copies:
            yield Wait(copy)
        if env.now > started:
            self.job.cluster.log.span(device.rank, "communication", label, started, env.now)

    # ---- the report ----

    def report(self, what: str) -> dict:
        """report.json's `sharding.offload`: what is offloaded and the bytes each way, every rank's."""
        moved = {TO_HOST: 0, FROM_HOST: 0}
        for device in self.job.devices:
            by_label = self.job.cluster.log.bytes_by_label(device.rank, "communication")
            for label in moved:
                moved[label] += int(by_label.get(label, 0))
        return {"what": what, "to_host_bytes": moved[TO_HOST], "from_host_bytes": moved[FROM_HOST]}


class OffloadSection(ReportSection):
    what: str = Field(description="what lives in host memory: none, optimizer or optimizer_and_parameters")
    to_host_bytes: int = Field(description="bytes copied from the devices to the host (reduced gradient chunks)")
    from_host_bytes: int = Field(description="bytes copied from the host to the devices (parameter chunks)")


NO_OFFLOAD = {"what": "none", "to_host_bytes": 0, "from_host_bytes": 0}
