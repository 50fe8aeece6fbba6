"""The `simtrain` torch.distributed backend: a process group whose collectives run on the simulated cluster.

Every rank thread has its own `SimProcessGroup` object per group (torch keeps one
registry per rank thread, world.py); the members of a group share one `Group`,
which holds the group's communicator on the simulated network and the state
the ranks agree through. Each call posts a collective program (simtrain/comm,
programs.py) for the rank and returns a `SimWork` at once; the program runs on
the simulated clock, and `wait()` hands the rank's turn to the clock until it
has ended (scheduler.py).

    dist.init_process_group("simtrain")          # in a rank of simtrain.dist.spawn
    work = dist.all_reduce(grads, async_op=True)  # starts now, in simulated time
    ...                                           # compute here overlaps the all-reduce
    work.wait()

- Collectives of a group run in the order each rank calls them, one after the
  other (a stream per group, as NCCL's communicators run): a rank's second
  all_reduce starts when its first has ended. Point-to-point operations do not
  queue: an isend and an irecv between the same ranks run side by side.
- Before a rank posts anything, the FLOPs its torch ops performed since its last
  post are charged on its device (run.py), and the rank waits for them.
- Every member must call the group's collectives in the same order with the same
  sizes; the first difference raises `CollectiveMismatch` naming both ranks.
- `ReduceOp.PREMUL_SUM(factor)` (NCCL's; FSDP2 posts it for a gradient divide
  factor other than the group's size, as torchtitan sets): each rank's input
  multiplied by the factor, then summed.
- A collective's writes into its tensors run below autograd, as a C++
  backend's do (gloo's, NCCL's): they leave the tensors' version counters as
  they were (selective activation checkpointing keeps a functional
  collective's output and checks that nothing has written it since). The
  programs' first steps run here, under `BELOW_AUTOGRAD`; the rest in the
  clock's thread, which runs under it too (run.py).
- A coalesced call (`_coalescing_manager`, FSDP2, DTensor) is one collective
  whose program runs its tensors' operations one after the other.
- Each rank's group keeps the name torch gives it (`_set_group_name`), by which
  DeviceMesh and functional collectives find it: torch stores it on a group's
  C++ backends, and a Python process group has none.
- `Work.get_future()` returns a completed future whose tensors wait for the
  collective when first read (arriving.py): torch's C++ code (DDP's reducer)
  blocks on futures where no Python runs, where a pending one could never be
  completed by the clock.
"""
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves

from ..comm import build_all_reduce
from ..comm.broadcast import broadcast
from ..comm.ops import Recv, Send
from ..comm.simulated import SimCommunicator
from ..errors import CollectiveMismatch, NumericsOffUnsupported, SimtrainError
from .arriving import ArrivingTensor
from .call_arguments import group_rank, laid_end_to_end, one_per_rank, one_tensor, split_rows
from .numerics_off import called_at
from .programs import COMBINE, all_gather, all_to_all, gather, reduce, reduce_scatter, ring_all_reduce_with, scatter

REDUCE_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "product",
              dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min", dist.ReduceOp.PREMUL_SUM: "premul_sum"}


# Ops under it skip autograd and its version counters, as a C++ kernel's inner ops do.
BELOW_AUTOGRAD = torch._C._AutoDispatchBelowADInplaceOrView


class SimWork(dist.Work):
    """A posted operation; `wait()` gives the rank's turn to the clock until the operation has ended."""

    def __init__(self, run, done, what, result):
        super().__init__()
        self._run, self._done, self._what, self._result = run, done, what, result

    def wait(self, timeout=None) -> bool:
        if not self._done.processed:
            self._run.wait(self._done, self._what)
        return True

    def is_completed(self) -> bool:
        return self._done.processed

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self._result if self._done.processed else
                          [ArrivingTensor(tensor, self) for tensor in self._result])
        return future

    def result(self):
        self.wait()
        return self._result


class _Pending:
    """What a rank waits on, said at the moment a deadlock is reported."""

    def __init__(self, group, seq: int, call: str):
        self.group, self.seq, self.call = group, seq, call

    def __str__(self) -> str:
        missing = [rank for rank, issued in zip(self.group.ranks, self.group.issued) if issued <= self.seq]
        text = f"{self.call} (collective #{self.seq} of group {self.group.ranks})"
        return text + (f", which ranks {missing} have not called" if missing else "")


class Group:
    """A process group's shared state: its ranks, its communicator, the order of its collectives."""

    def __init__(self, run, ranks: list[int]):
        self.run = run
        self.ranks = list(ranks)
        cluster = run.cluster
        self.nodes = [cluster.devices[rank].node for rank in self.ranks]
        self.comm = SimCommunicator(cluster.network, self.nodes, cluster.log,
                                    [cluster.devices[rank].memory for rank in self.ranks], self.ranks)
        self.all_reduce = build_all_reduce(run.algorithm, cluster.topology, self.nodes, run.channels,
                                           "parallel.all_reduce", "parallel.channels")
        self.mirrors: dict[tuple, Group] = {}  # this group's ranks moved along the alike dimension, by ranks
        self.issued = [0] * len(self.ranks)  # collectives each member has called
        self._last = [None] * len(self.ranks)  # each member's latest collective's end event
        self._calls: dict[int, tuple[int, str]] = {}  # collective # -> (first caller, its call)
        self._exchanges: dict[int, dict] = {}  # collective # -> {group rank: its all-to-all sizes}

    def collective(self, me: int, call: str, program, result, exchange=None) -> SimWork:
        """Post collective `call` (its kind and sizes) for group rank `me`, and for each rank it stands for
        (representatives.py); `program(member, payload)` makes a member's program, `payload(tensor)` what it moves
        for `tensor`.

        `exchange` (all-to-alls, whose sizes differ by rank): the elements this rank sends to and
        receives from each group rank, checked against what every other rank posted."""
        work = self._collective(me, call, lambda: program(me, _own), result, exchange)
        for group, member in self.run.stand_ins(self, me, call):
            group._collective(member, call, lambda member=member: program(member, _stand_in_payload), None, exchange)
        return work

    def _collective(self, me: int, call: str, program, result, exchange) -> SimWork:
        seq = self.issued[me]
        self.issued[me] += 1
        first, exchanges = self._calls.setdefault(seq, (me, call)), self._exchanges.setdefault(seq, {})
        if first[1] != call:
            raise CollectiveMismatch(f"collective #{seq} of group {self.ranks}: rank {self.ranks[first[0]]} "
                                     f"called {first[1]}, rank {self.ranks[me]} called {call}")
        if exchange is not None:
            self._check_exchange(seq, me, exchange, exchanges)
        if min(self.issued) > seq:
            del self._calls[seq], self._exchanges[seq]
        env = self.run.cluster.env
        done = env.event()
        label = call.partition("(")[0]

        def start(_=None):
            self.comm.run(me, program(), label).callbacks.append(ended)

        def ended(_):
            self.run.collective_end_s[self.ranks[me]] = env.now
            done.succeed(result)

        previous = self._last[me]
        if previous is None or previous.processed:
            start()
        else:
            previous.callbacks.append(start)
        self._last[me] = done
        return SimWork(self.run, done, _Pending(self, seq, call), result)

    def _check_exchange(self, seq: int, me: int, exchange, posted: dict) -> None:
        sends, receives = exchange
        for peer, (peer_sends, peer_receives) in posted.items():
            for src, dst, sent, expected in ((me, peer, sends[peer], peer_receives[me]),
                                             (peer, me, peer_sends[me], receives[peer])):
                if sent != expected:
                    raise CollectiveMismatch(f"collective #{seq} of group {self.ranks}: in the all-to-all rank "
                                             f"{self.ranks[src]} sends {sent} elements to rank {self.ranks[dst]}, "
                                             f"which expects {expected}")
        posted[me] = exchange

    def point_to_point(self, kind: str, me: int, peer: int, tag: int, tensor: torch.Tensor) -> SimWork:
        """Post a send to, or a recv from, group rank `peer` on the group's communicator (the one mailbox:
        matched per (src, dst, tag) in posting order), and for each rank it stands for (in the group's mirrors);
        it moves once the peer posts its match."""
        call = f"{kind} of {_sizes(tensor)}"
        for group, member in self.run.stand_ins(self, me, call):  # each rank's own transfer, charged from now
            group.comm.wait(group.comm.post(member, _point_to_point(kind, peer, _stand_in_payload(tensor), tag), kind))
        done = self.comm.wait(self.comm.post(me, _point_to_point(kind, peer, _own(tensor), tag), kind))
        what = (f"send to rank {self.ranks[peer]} (tag {tag}), no matching recv posted" if kind == "send" else
                f"recv from rank {self.ranks[peer]} (tag {tag}), no matching send posted")
        return SimWork(self.run, done, what, [tensor])


def _point_to_point(kind: str, peer: int, tensor, tag: int):
    # a recv buffer may require grad (pipelining's): the transfer writes its storage, not autograd's leaf
    yield Send(peer, tensor, tag) if kind == "send" else Recv(peer, tensor.detach(), tag=tag)


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """What a collective moves for a rank's own `tensor`: the tensor, or for a fake one (numerics off) its twin on
    the meta device: the same bytes, and no copy through torch's fake dispatch as each transfer lands (a fake
    tensor has no values to copy)."""
    return _meta_twin(tensor) if isinstance(tensor, FakeTensor) else tensor


def _stand_in_payload(tensor: torch.Tensor) -> torch.Tensor:
    """What a rank stood in for moves (representatives.py): for a fake tensor its twin on the meta device, for a
    real one (an integer tensor of numerics off) a copy of its representative's: its part is its
    representative's."""
    if isinstance(tensor, FakeTensor):
        return _meta_twin(tensor)
    with torch._C._DisableTorchDispatch():
        return tensor.detach().clone()


def _meta_twin(tensor: FakeTensor) -> torch.Tensor:
    """A tensor of `tensor`'s size, strides and dtype on the meta device: bytes without values."""
    with torch._C._DisableTorchDispatch():
        return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta")


class SimProcessGroup(dist.ProcessGroup):
    """One rank's handle on a Group: torch.distributed's collectives as simulated programs."""

    def __init__(self, group: Group, rank: int):
        super().__init__(rank, len(group.ranks))
        self.group = group
        self._me = rank
        self._name = None

    def _get_backend_name(self) -> str:
        return "simtrain"

    @property
    def group_name(self) -> str:
        """The name torch gave the group (`_set_group_name`): DeviceMesh and functional collectives look it up."""
        if self._name is None:
            raise SimtrainError("group_name: the simtrain process group has not been registered by torch yet")
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def allreduce(self, tensors, opts=None):
        tensor, op = one_tensor(tensors, "all_reduce"), _reduce_op(opts, "all_reduce")
        factor = _premul_factor(opts)
        return self._post(f"all_reduce({op}) of {_sizes(tensor)}",
                          lambda me, payload: self._all_reduce(me, payload(tensor), op, factor), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        op, factor = _reduce_op(opts, "all_reduce_coalesced"), _premul_factor(opts)

        def program(me, payload):
            for tensor in tensors:
                yield from self._all_reduce(me, payload(tensor), op, factor)

        return self._post(f"all_reduce_coalesced({op}) of {_sizes(*tensors)}", program, tensors)

    def _all_reduce(self, me: int, tensor, op: str, factor: float):
        world = len(self.group.ranks)
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        if op == "premul_sum":
            buf.mul_(factor)  # in place: the all-reduce overwrites it
        if op in ("sum", "avg", "premul_sum"):
            yield from self.group.all_reduce(me, world, buf.view(-1), average=op == "avg")
        else:
            yield from ring_all_reduce_with(me, world, buf, COMBINE[op])
        if buf is not tensor:
            tensor.copy_(buf)

    def broadcast(self, tensors, opts=None):
        tensor = one_tensor(tensors, "broadcast")
        root = group_rank(opts.rootRank, len(self.group.ranks), "broadcast", "root")
        return self._post(f"broadcast(root {root}) of {_sizes(tensor)}",
                          lambda me, payload: broadcast(me, len(self.group.ranks), {root: payload(tensor)}), tensors)

    def reduce(self, tensors, opts=None):
        tensor = one_tensor(tensors, "reduce")
        op, world = _reduce_op(opts, "reduce"), len(self.group.ranks)
        root = group_rank(opts.rootRank, world, "reduce", "root")
        factor = _premul_factor(opts)

        def program(me, payload):
            buf = payload(tensor)
            buf = buf if me == root else buf.clone()  # only the root's tensor changes
            if op == "premul_sum":
                buf.mul_(factor)
            yield from reduce(me, world, buf, root, COMBINE[_combined(op)])
            if op == "avg" and me == root:
                buf.div_(world)

        return self._post(f"reduce({op}, root {root}) of {_sizes(tensor)}", program, tensors)

    def gather(self, output_tensors, input_tensors, opts=None):
        tensor, world = one_tensor(input_tensors, "gather"), len(self.group.ranks)
        root = group_rank(opts.rootRank, world, "gather", "root")
        if self._me == root:
            one_per_rank(output_tensors[0], world, "gather", "output")

        def program(me, payload):
            if me != root:
                return gather(me, world, root, [payload(tensor)] * world)  # it sends its own entry only
            outputs = [payload(output) for output in output_tensors[0]]
            outputs[root].copy_(payload(tensor))
            return gather(me, world, root, outputs)

        return self._post(f"gather(root {root}) of {_sizes(tensor)}", program, output_tensors, inputs=[tensor])

    def scatter(self, output_tensors, input_tensors, opts=None):
        tensor, world = one_tensor(output_tensors, "scatter"), len(self.group.ranks)
        root = group_rank(opts.rootRank, world, "scatter", "root")
        if self._me == root:
            one_per_rank(input_tensors[0], world, "scatter", "input")

        def program(me, payload):
            if me != root:
                return scatter(me, world, root, [payload(tensor)] * world)  # it receives its own entry only
            inputs = [payload(input) for input in input_tensors[0]]
            payload(tensor).copy_(inputs[root])
            return scatter(me, world, root, inputs)

        return self._post(f"scatter(root {root}) of {_sizes(tensor)}", program, output_tensors,
                          inputs=input_tensors[0] if self._me == root else [])

    def allgather(self, output_tensors, input_tensors, opts=None):
        outputs, tensor = one_tensor(output_tensors, "all_gather"), one_tensor(input_tensors, "all_gather")
        one_per_rank(outputs, len(self.group.ranks), "all_gather", "output")
        return self._post(f"all_gather of {_sizes(*outputs)}",
                          lambda me, payload: _gather(me, [payload(output) for output in outputs], payload(tensor)),
                          output_tensors, inputs=[tensor])

    def all_gather_single(self, output, input, opts=None):
        return self._gather_into("all_gather_into_tensor", [output], [input])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._gather_into("all_gather_into_tensor_coalesced", outputs, inputs)

    def _gather_into(self, name, outputs, inputs):
        """Each of `inputs` gathered into the matching one of `outputs` (world rows), one after the other."""
        world = len(self.group.ranks)
        for output, tensor in zip(outputs, inputs):
            laid_end_to_end(output, tensor, world, name, "output", "inputs")

        def program(me, payload):
            for output, tensor in zip(outputs, inputs):
                yield from _gather(me, list(payload(output).view(world, -1).unbind(0)), payload(tensor).reshape(-1))

        sizes = '; '.join(_sizes(*output.view(world, -1).unbind(0)) for output in outputs)
        return self._post(f"{name} of {sizes}", program, outputs, inputs=inputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        output, inputs = one_tensor(output_tensors, "reduce_scatter"), one_tensor(input_tensors, "reduce_scatter")
        one_per_rank(inputs, len(self.group.ranks), "reduce_scatter", "input")
        return self._scatter("reduce_scatter", [output], [inputs], _reduce_op(opts, "reduce_scatter"),
                             _premul_factor(opts))

    def reduce_scatter_single(self, output, input, opts=None):
        return self._scatter_rows("reduce_scatter_tensor", [output], [input], _reduce_op(opts, "reduce_scatter_tensor"),
                                  _premul_factor(opts))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._scatter_rows("reduce_scatter_tensor_coalesced", outputs, inputs,
                                  _reduce_op(opts, "reduce_scatter_tensor_coalesced"), _premul_factor(opts))

    def _scatter_rows(self, name, outputs, inputs, op, factor):
        """Each of `inputs`, split in world rows, reduce-scattered into the matching one of `outputs`."""
        world = len(self.group.ranks)
        for output, input in zip(outputs, inputs):
            laid_end_to_end(input, output, world, name, "input", "outputs")
        return self._scatter(name, outputs, [list(input.reshape(world, -1).unbind(0)) for input in inputs], op, factor)

    def _scatter(self, name, outputs, inputs, op, factor):
        """Each list of `inputs` (one chunk per rank) reduce-scattered into the matching output, one after the
        other."""
        world = len(self.group.ranks)

        def program(me, payload):
            for output, parts in zip(outputs, inputs):
                chunks = [payload(chunk).clone() for chunk in parts]  # the inputs stay as the caller gave them
                if op == "premul_sum":
                    for chunk in chunks:
                        chunk.mul_(factor)
                reduced = yield from reduce_scatter(me, world, chunks, COMBINE[_combined(op)])
                output = payload(output)
                output.view(-1).copy_(reduced.view(-1))
                if op == "avg":
                    output.div_(world)

        return self._post(f"{name}({op}) of {'; '.join(_sizes(*parts) for parts in inputs)}", program, outputs,
                          inputs=[part for parts in inputs for part in parts])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        world = len(self.group.ranks)
        return self._all_to_all("all_to_all", one_per_rank(output_tensors, world, "all_to_all", "output"),
                                one_per_rank(input_tensors, world, "all_to_all", "input"), output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        world = len(self.group.ranks)
        outputs = split_rows(output, output_split_sizes, world, "output_split_sizes")
        inputs = split_rows(input, input_split_sizes, world, "input_split_sizes")
        return self._all_to_all("all_to_all_single", outputs, inputs, [output])

    def _all_to_all(self, name, outputs, inputs, result):
        exchange = ([t.numel() for t in inputs], [t.numel() for t in outputs])

        def program(me, payload):
            return all_to_all(me, len(outputs), [payload(t) for t in outputs], [payload(t) for t in inputs])

        return self._post(f"{name} of {_dtype(inputs[0])}", program, result, exchange, inputs)

    def barrier(self, opts=None):
        # an all-reduce of one element without values (a meta tensor, on every rank and rank stood in for alike)
        return self._post("barrier", lambda me, payload: self.group.all_reduce(
            me, len(self.group.ranks), payload(torch.empty(1, device="meta"))), [])

    def send(self, tensors, dst, tag):
        return self._point_to_point("send", dst, tag, one_tensor(tensors, "send"))

    def recv(self, tensors, src, tag):
        return self._point_to_point("recv", src, tag, one_tensor(tensors, "recv"))

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        raise SimtrainError("allgather_coalesced: not supported by the simtrain backend")

    def recv_anysource(self, tensors, tag):
        raise SimtrainError("recv: the simtrain backend needs a source rank (recv from any source is not supported)")

    def _post(self, call: str, program, result, exchange=None, inputs=()) -> SimWork:
        """Post `program` for `call`, whose outputs are `result` and whose inputs, where apart from them, `inputs`."""
        _no_values_from_fakes(call, result, inputs)
        run = self.group.run
        run.flush()
        if run.detached(self.group.ranks, call):  # the witness (representatives.py): recorded, not run
            return run.witness_work(call, result)
        with run.backend(), BELOW_AUTOGRAD():
            return run.posted(self.group.collective(self._me, call, program, result, exchange))

    def _point_to_point(self, kind: str, peer: int, tag: int, tensor) -> SimWork:
        peer = group_rank(peer, len(self.group.ranks), kind, "destination" if kind == "send" else "source")
        run = self.group.run
        run.flush()
        call = f"{kind} with group rank {peer} (tag {tag}) of {_sizes(tensor)}"
        if run.detached(self.group.ranks, call):
            return run.witness_work(call, [tensor])
        with run.backend(), BELOW_AUTOGRAD():
            return run.posted(self.group.point_to_point(kind, self._me, peer, tag, tensor))


def _no_values_from_fakes(call: str, outputs, inputs) -> None:
    """Numerics off: a collective that would write a fake input's values into a real output (an integer tensor
    the rank made, gathering counts computed from fake ones: values that depend on the data) is one line."""
    fakes = [tensor for tensor in tree_leaves(inputs) if isinstance(tensor, FakeTensor)]
    real = [tensor for tensor in tree_leaves(outputs) if not isinstance(tensor, (FakeTensor, ArrivingTensor))]
    if fakes and real:
        raise NumericsOffUnsupported(
            f"numerics off (spawn numerics=False): {call} would write the values of a fake {fakes[0].dtype} tensor "
            f"into a real {real[0].dtype} one: values that depend on the data, which fake tensors do not have"
            f"{called_at()}")


def _gather(me: int, chunks: list, tensor):
    chunks[me].copy_(tensor)
    return all_gather(me, len(chunks), chunks)


def _reduce_op(opts, collective: str) -> str:
    op = REDUCE_OPS.get(opts.reduceOp.op if opts is not None else dist.ReduceOp.SUM)
    if op is None:
        raise SimtrainError(f"{collective}: reduce op {opts.reduceOp.op.name} is not supported by the simtrain "
                            f"backend (it supports {', '.join(REDUCE_OPS.values())})")
    return op


def _premul_factor(opts) -> float | None:
    """The factor of a `ReduceOp.PREMUL_SUM(factor)` (a number; NCCL's factor given as a tensor is refused)."""
    if opts is None or opts.reduceOp.op != dist.ReduceOp.PREMUL_SUM:
        return None
    factor = opts.reduceOp.factor
    if not isinstance(factor, float):
        raise SimtrainError(f"reduce op PREMUL_SUM: a factor given as {type(factor).__name__} is not supported by "
                            f"the simtrain backend (it takes a number)")
    return factor


def _combined(op: str) -> str:
    """How received chunks combine under `op`: the sums (avg and premul_sum scale before or after) by adding."""
    return "sum" if op in ("avg", "premul_sum") else op


def _sizes(*tensors) -> str:
    """'[3, 3, 2] float32': the element counts of `tensors` and their dtype, as a call's signature."""
    counts = [t.numel() for t in tensors]
    return f"{counts if len(counts) > 1 else counts[0]} {_dtype(tensors[0])}"


def _dtype(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
