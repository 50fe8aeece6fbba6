"""PyTorch profiler (Kineto) traces, one per rank, that Holistic Trace Analysis reads: a view of the event log.

What `torch.profiler` writes on a real GPU is a Chrome trace with a header
(`distributedInfo` with the rank and world size, `deviceProperties`) and
events of categories `kernel`, `gpu_memcpy` and `cuda_runtime`, in
microseconds, each GPU event on a stream and tied by a correlation id to the
CPU call that launched it. This module writes the same for each simulated
rank, from the cluster's event log (hw/eventlog.py):

- compute, optimizer and sampling spans are kernels on the compute stream
  (7, PyTorch's default stream as Kineto numbers it), named after the span
  ("forward", "optimizer step");
- communication is NCCL kernels (`ncclDevKernel_<label>`; Holistic Trace
  Analysis, HTA, tells a communication kernel by a name starting with "nccl"
  and holding "Kernel": hta/utils/utils.py) on a communication stream (20).
  Its kernels are the seconds report.json counts as communication (the log's
  `communication_parts`): a wait for a peer inside a collective is idle
  there, so it is a gap between two kernels here. A real NCCL kernel spins
  through such a wait; HTA on a real trace counts it as communication;
- a checkpoint written or read is a `gpu_memcpy` ("Memcpy DtoH (...)",
  "Memcpy HtoD (...)", stream 30): HTA counts it as memory, not compute;
- a pipeline bubble and a lost device's time have no kernel: idle.

Kernels of one kind that overlap go on the next stream of their kind (21,
22, ...). Each kernel's launch (`cudaLaunchKernel`, on the host's thread) is
placed where its stream became free for it (its predecessor's end, or 0):
the simulator models no host, so HTA's idle time breakdown never calls a gap
a host wait. Times are whole microseconds, each span's ends rounded to the
nearest (so back-to-back kernels stay back to back; HTA rounds a fractional
time stamp up and a fractional end down, which would open a gap between
them). There are no `ProfilerStep#N` annotations: HTA analyses the whole run,
and warns that it found none.

With representatives (a mirrored device reports its representative's
figures), a trace is written for each rank that ran, and its `simtrain`
header lists the ranks it stands for.

    traces = build_kineto(cluster, ranks=range(8))          # rank -> the trace's JSON-ready dict
    for path, payload in kineto_files(traces).items():      # "kineto/rank0.json" -> bytes
        (out_dir / path).write_bytes(payload)

    from hta.trace_analysis import TraceAnalysis
    analysis = TraceAnalysis(trace_dir=str(out_dir / "kineto"))
    analysis.get_temporal_breakdown(visualize=False)        # idle, compute, non-compute microseconds per rank
"""
import json
from collections.abc import Iterable, Mapping

from ..hw.cluster import Cluster
from ..hw.eventlog import Span
from ..version import __version__

KERNEL_KINDS = {"compute": "compute", "optimizer": "compute", "sampling": "compute",
                "checkpoint": "copy_out", "restart": "copy_in"}  # span kind -> kernel category
IDLE_KINDS = ("bubble", "lost")  # spans that are waits: no kernel
FIRST_STREAM = {"compute": 7, "communication": 20, "copy_out": 30, "copy_in": 30}
HOST_PID, HOST_TID, DEVICE_PID = 1, 1, 0  # made-up process and thread ids: one host process, one device


def build_kineto(cluster: Cluster, ranks: Iterable[int], mirror_of: Mapping[int, int] | None = None
                 ) -> dict[int, dict]:
    """Rank -> its Kineto trace (a JSON-ready dict), for each of `ranks` that ran its own spans (not in
    `mirror_of`, device rank -> the rank whose figures it reports); needs a log that records its spans."""
    if not cluster.log.record:
        raise RuntimeError("Kineto traces need an event log that records its spans")
    mirror_of = mirror_of or {}
    ranks = sorted(ranks)
    stands_for = {rank: [] for rank in ranks if rank not in mirror_of}
    for rank in ranks:
        stands_for[mirror_of.get(rank, rank)].append(rank)
    spans = {rank: [] for rank in stands_for}
    for span in cluster.log.spans:
        if span.rank in spans and span.kind != "communication":
            spans[span.rank].append(span)
    for part in cluster.log.communication_parts:
        if part.rank in spans:
            spans[part.rank].append(part)
    return {rank: rank_trace(cluster, rank, len(ranks), spans[rank], stands_for[rank]) for rank in stands_for}


def rank_trace(cluster: Cluster, rank: int, world_size: int, spans: list[Span], stands_for: list[int]) -> dict:
    """One rank's trace: its kernels (`spans`: the rank's spans, communication as its counted parts) and their
    launches. `distributedInfo` comes first: HTA finds a file's rank by the first match of `"rank":\\s+(\\d+)`
    in its text (hta/common/trace_file.py)."""
    device = cluster.devices[rank]
    events = [_meta(HOST_PID, None, "process_name", f"simtrain rank {rank}"),
              _meta(HOST_PID, HOST_TID, "thread_name", "host (launches)"),
              _meta(DEVICE_PID, None, "process_name", f"GPU 0 ({device.node})")]
    stream_free: dict[int, int] = {}  # stream -> when its last kernel ends (us)
    named_streams = set()
    for correlation, span in enumerate(sorted(spans, key=lambda s: (s.start, s.end, s.kind, s.name)), start=1):
        if span.kind in IDLE_KINDS:
            continue
        category = "communication" if span.kind == "communication" else _category(span.kind)
        start_us, end_us = round(span.start * 1e6), round(span.end * 1e6)
        stream = FIRST_STREAM[category]
        while stream_free.get(stream, 0) > start_us:  # a kernel of this kind still runs there: the next stream
            stream += 1
        launch_us = stream_free.get(stream, 0)
        stream_free[stream] = max(end_us, launch_us)
        if stream not in named_streams:
            named_streams.add(stream)
            events.append(_meta(DEVICE_PID, stream, "thread_name", f"stream {stream} ({category})"))
        ids = {"External id": correlation, "correlation": correlation}
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": HOST_PID,
                       "tid": HOST_TID, "ts": launch_us, "dur": 0, "args": {**ids, "cbid": 211}})
        events.append({"ph": "X", "cat": "gpu_memcpy" if category.startswith("copy") else "kernel",
                       "name": _kernel_name(category, span.name), "pid": DEVICE_PID, "tid": stream,
                       "ts": start_us, "dur": end_us - start_us,
                       "args": {**ids, "device": 0, "context": 1, "stream": stream, "queued": 0}})
    return {
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world_size},
        "schemaVersion": 1,
        "deviceProperties": [_device_properties(device.spec)],
        "traceName": f"rank{rank}.json",
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": 0,  # simulated time starts at 0
        "simtrain": {"version": __version__, "stands_for": stands_for},
        "traceEvents": events,
    }


def kineto_files(traces: Mapping[int, dict]) -> dict[str, bytes]:
    """The files the traces are written to, relative to a run's directory: "kineto/rank<N>.json" -> its text.
    The separators are json's defaults: HTA's rank pattern wants the space after the colon."""
    return {f"kineto/rank{rank}.json": json.dumps(trace).encode() for rank, trace in sorted(traces.items())}


def _category(kind: str) -> str:
    if kind not in KERNEL_KINDS:
        raise ValueError(f"Kineto trace: no kernel category for span kind {kind!r} (report/kineto.py KERNEL_KINDS)")
    return KERNEL_KINDS[kind]


def _kernel_name(category: str, name: str) -> str:
    """What HTA sees: NCCL's kernel name for communication, a memcpy's for a copy, the span's name for compute
    (lowered and prefixed where HTA would take it for communication, memory or a synchronization:
    hta/utils/utils.py)."""
    if category == "communication":
        return f"ncclDevKernel_{name}"
    if category == "copy_out":
        return f"Memcpy DtoH ({name})"
    if category == "copy_in":
        return f"Memcpy HtoD ({name})"
    reserved = name.startswith(("nccl", "Memset", "dma")) or "Memcpy" in name or "Sync" in name
    return f"kernel {name.lower()}" if reserved else name


def _device_properties(spec) -> dict:
    properties = {"id": 0, "name": spec.name, "totalGlobalMem": int(spec.memory_bytes)}
    if spec.streaming_multiprocessors is not None:
        properties["numSms"] = spec.streaming_multiprocessors
    return properties


def _meta(pid: int, tid: int | None, name: str, value: str) -> dict:
    event = {"ph": "M", "name": name, "pid": pid, "ts": 0, "args": {"name": value}}  # every time stamp whole
    if tid is not None:
        event["tid"] = tid
    return event
