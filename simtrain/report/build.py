"""What a run reports: report.json, the Chrome trace, the terminal summary.

Every figure is a view of the cluster's event log (device spans) and the
network's transfer records and link counters; nothing is measured twice.

    report = build_report(scenario, cluster, run_result)
    report.write(Path("runs/quickstart"))
    print_summary(report.data)

report.json is byte-identical for the same scenario except `wall_time_s`. It is
strict JSON: a figure that is not a finite number (the loss of a run that
diverged) is written as null, as is a rate over no simulated time.
"""
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..hw.catalog import calibration_of
from ..hw.cluster import Cluster
from ..scenario import Scenario
from ..version import __version__
from .chakra_files import chakra_files
from .core import ReportCore
from .flops import flops_section
from .kineto import build_kineto, kineto_files
from .parallel import parallel_section
from .sections import check_section
from .trace import build_trace

BREAKDOWN_KINDS = ("compute", "communication", "optimizer", "sampling", "bubble")
FAULT_KINDS = ("checkpoint", "restart")  # in the breakdown of a run with faults or checkpoints


@dataclass
class RunResult:
    """What a scheme produced, beyond what the cluster logged."""

    scheme: str  # the registry's name of the scheme that ran (simtrain/schemes/__init__.py)
    steps: int
    samples_per_step: int
    loss_curve: list[tuple[float, float]]  # (sim_time_s, batch loss) per step or update
    train_loss_curve: list[list[float]]  # [step, sim_time_s, training-set loss] every report.every steps
    time_to_target_s: float | None  # first time train_loss_curve reached train.target_loss
    final_loss: float | None  # None: numerics off
    final_accuracy: float | None
    single_device_step_s: float | None  # None: no baseline (a population)
    final_models: list[torch.nn.Module]  # every replica, rank order
    wall_time_s: float
    # report.json's sections beyond the core (each registered by its owner: report/sections.py); a `parallel`
    # section holds the layout, and build_report adds the bubble and the bytes (report/parallel.py)
    extra: dict = field(default_factory=dict)
    # device rank -> the device rank whose figures it reports (a representative's: strategies/representatives.py)
    mirror_of: dict[int, int] = field(default_factory=dict)
    # a mirrored rank's own groups and peers, for its Chakra trace (strategies/mirrored_ranks.py's Counterparts)
    counterparts: object = None
    status: str = "ok"  # or "out_of_memory", "failed" (a fault stopped the job): the run stopped after `steps` steps
    model_flops_per_step: float | None = None  # train/model_flops.py; None: not known
    # the global ranks of the job that the sections describe (a population's best member); None: every job's
    section_ranks: list[int] | None = None
    model_flops_formula: str | None = None
    tokens_per_sample: int | None = None  # a language model's sequence length; None: samples are not tokens


def json_text(value, indent: str = "") -> str:
    """report.json's text: an object a key a line, indented two spaces a level; a list of objects or lists an
    item a line (a device, a link, a point of the loss curve), each item on its one line; any other list on one
    line. A device is one line to grep, and 100,000 devices' report takes 94 MB and 2.4 s of CPU to write,
    against 126 MB and 3.9 s with every value on a line of its own (2026-12-07)."""
    inner = indent + "  "
    if isinstance(value, dict) and value:
        return "{\n" + ",\n".join(f"{inner}{json.dumps(key)}: {json_text(item, inner)}"
                                   for key, item in value.items()) + f"\n{indent}}}"
    if isinstance(value, list) and value and all(isinstance(item, (dict, list)) for item in value):
        return "[\n" + ",\n".join(inner + json.dumps(item, allow_nan=False) for item in value) + f"\n{indent}]"
    return json.dumps(value, allow_nan=False)


@dataclass
class Report:
    """report.json's content, the final models and the trace, ready to write."""

    data: dict
    final_models: list[torch.nn.Module]
    trace: dict | None
    scenario_yaml: str
    kineto: dict[int, dict] | None = None  # rank -> its PyTorch profiler trace (report/kineto.py)
    chakra: Mapping[str, bytes] | None = None  # chakra/'s files by name (report/chakra_files.py); None: not asked for

    def to_json(self) -> str:
        return json_text(finite_or_none(self.data)) + "\n"

    def write(self, out_dir: Path) -> list[Path]:
        """Write report.json, scenario.resolved.yaml, final_model.pt (with numerics), trace.json,
        kineto/rank<N>.json and chakra/; the paths written (each folder as one).

        Each file is written to a temporary name and renamed into place, so an
        interrupted write never leaves a half file over an earlier good one.
        """
        out_dir.mkdir(parents=True, exist_ok=True)
        outputs = {"report.json": self.to_json().encode(), "scenario.resolved.yaml": self.scenario_yaml.encode()}
        if self.trace is not None:
            outputs["trace.json"] = json.dumps(self.trace, separators=(",", ":")).encode()
        written = []
        for name, payload in outputs.items():
            written.append(write_atomic(out_dir / name, lambda f, p=payload: f.write(p)))
        # (name, its bytes) of each folder's files, one made at a time (report/chakra_files.py)
        folders = {"kineto": kineto_files(self.kineto).items() if self.kineto is not None else None,
                   "chakra": ((f"chakra/{name}", payload) for name, payload in self.chakra.items())
                   if self.chakra is not None else None}
        for folder, files in folders.items():  # a file per rank: the folder named once among what was written
            if files is not None:
                (out_dir / folder).mkdir(exist_ok=True)
                for name, payload in files:
                    write_atomic(out_dir / name, lambda f, p=payload: f.write(p))
                written.append(out_dir / folder)
        if not self.final_model_is_meta:
            written.append(write_atomic(out_dir / "final_model.pt",
                                         lambda f: torch.save(self.final_model.state_dict(), f)))
        return written

    @property
    def final_model_is_meta(self) -> bool:
        """Numerics off: the model has shapes but no values, and no final_model.pt is written."""
        return any(p.is_meta for p in self.final_model.parameters())

    @property
    def final_model(self) -> torch.nn.Module:
        """Rank 0's model: what final_model.pt holds."""
        return self.final_models[0]


def finite_or_none(value):
    """`value` (JSON-like: dicts, lists, numbers) with every float that is not finite replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def write_atomic(path: Path, write) -> Path:
    """`write(file)` into a temporary name beside `path`, then renamed to it: never a half file at `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def build_report(scenario: Scenario, cluster: Cluster, result: RunResult) -> Report:
    sim_time = cluster.log.last_end_s
    steps = result.steps
    step_time = sim_time / steps if steps else None  # None: stopped (out of memory) before a step ended
    log = cluster.log
    kinds = (*BREAKDOWN_KINDS, *(FAULT_KINDS if "faults" in result.extra else ()))
    devices, breakdown_total = [], {kind: 0.0 for kind in (*kinds, "idle")}
    job_names = {rank: name for name, ranks in cluster.jobs for rank in ranks}
    # The devices of the jobs (a spare that never joined one does not count); every device if no job ran.
    counted = {device.rank for device in cluster.devices if device.rank in job_names or not job_names}
    spent_by_source = {}  # a mirrored device reports its representative's figures: each worked out once
    for device in cluster.devices:
        source = cluster.devices[result.mirror_of.get(device.rank, device.rank)]
        if source.rank not in spent_by_source:
            spent = {kind: log.total(source.rank, kind) for kind in kinds}
            spent["communication"] = log.exposed_communication(source.rank)  # what overlaps other work is hidden
            spent["idle"] = max(0.0, sim_time - sum(spent.values()))
            spent_by_source[source.rank] = spent
        spent = dict(spent_by_source[source.rank])
        if device.rank in counted:
            for kind, seconds in spent.items():
                breakdown_total[kind] += seconds
        memory = source.memory
        devices.append({
            "rank": device.rank,
            "job": job_names.get(device.rank),
            "node": device.node,
            "device": device.spec.name,
            "peak_memory_bytes": memory.peak_total,
            "peak_memory_bytes_by_category": dict(memory.peak_breakdown),
            "capacity_bytes": int(device.spec.memory_bytes),
            "breakdown_s": spent,
        })
    ranks = sorted(counted)
    # the ranks whose spans were simulated, of the job the sections describe
    ran = sorted({result.mirror_of.get(rank, rank) for rank in (result.section_ranks or ranks)})
    extra = dict(result.extra)
    if "parallel" in extra:
        extra["parallel"] = parallel_section(extra["parallel"], log, ran, sim_time)
    for key, section in extra.items():
        check_section(key, section)
    checkpointing = scenario.train.checkpointing
    recomputation = checkpointing if isinstance(checkpointing, str) else f"{checkpointing.segments} segments"
    flops = flops_section(
        result.model_flops_per_step, steps, sim_time,
        peaks=[cluster.devices[rank].spec.peak_flops[scenario.train.precision] for rank in ranks],
        device_flops=[log.flops(result.mirror_of.get(rank, rank), "compute") for rank in ranks],
        formula=result.model_flops_formula, recomputation=recomputation)
    per_step = {kind: seconds / len(counted) / steps if steps else None
                for kind, seconds in breakdown_total.items()}
    links = [
        {**stat, "utilization": stat["busy_s"] / sim_time if sim_time > 0 else 0.0}
        for stat in cluster.network.link_stats()
    ]
    data = {
        "name": scenario.name,
        "status": result.status,
        "scheme": result.scheme,
        "all_reduce": scenario.parallel.all_reduce,
        "devices_count": len(cluster.devices),
        "sim_time_s": sim_time,
        "steps": steps,
        "step_time_s": step_time,
        "throughput_samples_per_s": result.samples_per_step * steps / sim_time if steps and sim_time > 0 else None,
        "throughput_tokens_per_s_per_device": (result.samples_per_step * result.tokens_per_sample * steps / sim_time
                                               / len(ranks)
                                               if result.tokens_per_sample and steps and sim_time > 0 else None),
        "breakdown_s": per_step,
        **_step_time_error(scenario, step_time),
        "scaling_efficiency": (result.single_device_step_s / step_time
                               if step_time and result.single_device_step_s is not None else None),
        "flops": flops,
        "final_loss": result.final_loss,
        "final_accuracy": result.final_accuracy,
        "loss_curve": [[t, loss] for t, loss in result.loss_curve],
        "train_loss_curve": result.train_loss_curve,
        **({"time_to_target_s": result.time_to_target_s} if scenario.train.target_loss is not None else {}),
        **extra,
        "devices": devices,
        "links": links,
        **({"shared_memory": _shared_memory_entry(cluster)} if cluster.shared_memory is not None else {}),
        "wall_time_s": result.wall_time_s,
        "simtrain_version": __version__,
    }
    # The core checked against its model: every device that ran its own program (a mirrored device's entry is its
    # representative's figures under its own rank) and one link (every link's entry comes from one expression)
    ReportCore.model_validate({**{key: value for key, value in data.items() if key not in extra},
                               "devices": [entry for entry in devices if entry["rank"] not in result.mirror_of],
                               "links": links[:1]})
    trace = build_trace(cluster) if scenario.report.trace else None
    kineto = build_kineto(cluster, ranks, result.mirror_of) if scenario.report.kineto else None
    chakra = (chakra_files(cluster, ranks, steps, result.mirror_of, result.counterparts) if scenario.report.chakra
              else None)
    return Report(data=data, final_models=result.final_models, trace=trace, scenario_yaml=scenario.to_yaml(),
                  kineto=kineto, chakra=chakra)


def _step_time_error(scenario: Scenario, step_time: float | None) -> dict:
    """report.json's `step_time_error` where the device takes its generation's calibrated efficiency and a step
    ended: the step time times the calibration's relative spread over its other published rows."""
    calibrated = calibration_of(scenario.cluster.device)
    if calibrated is None or not step_time:
        return {}
    generation, calibration = calibrated
    return {"step_time_error": {"seconds": step_time * calibration.spread, "relative": calibration.spread,
                                "generation": generation, "rows": len(calibration.residuals)}}


def _shared_memory_entry(cluster: Cluster) -> dict:
    store = cluster.shared_memory
    return {
        "location": store.location,
        "node": store.node,
        "bandwidth_Bps": store.bandwidth,
        "latency_s": store.latency,
        "peak_memory_bytes": store.memory.peak_total,
        "peak_memory_bytes_by_category": dict(store.memory.peak_breakdown),
        "capacity_bytes": store.capacity_bytes,
    }
