"""Host CPUs that run an offloaded optimizer step (ZeRO-Offload), and what that step costs.

ZeRO-Offload (Ren et al. 2021) keeps each data-parallel rank's fp32 master
shard and its optimizer state in the host's DRAM and steps the optimizer
there, on the CPU (DeepSpeed's CPU Adam). That step streams every element of
the shard through the CPU once: Adam reads the fp32 parameter, gradient and
two moments and writes back the parameter and moments (28 bytes a
parameter), and under mixed precision the rank also unscales its 16-bit
reduced gradient into the fp32 one and rounds the parameter back into its
16-bit copy (2 (e + 4) bytes more, e the 16-bit dtype's bytes: 40 in all for
bf16): `chunk_update_bytes` (strategies/sharded_replica.py) counts exactly the
bytes an on-device update reads and writes of HBM. A well-vectorized CPU Adam
does a handful of FLOPs per byte, far below a server CPU's FLOP/s to
memory-bandwidth ratio, so the step is memory-bound:

    host step of one rank = bytes x ranks stepping at once / host DRAM bandwidth

the host's DRAM bandwidth shared evenly by the ranks that step on it together
(every rank of a synchronous step does). The bandwidth is the datasheet's
peak; no efficiency is fitted (a CPU Adam reaches a large fraction of it
only with all cores and pinned memory, as DeepSpeed's does): the figure is a
lower bound on the host step.

`HOSTS` holds two hosts with their public figures. `cluster.shared_memory`
(hw/shared_memory.py) is the host memory that offload keeps its state in and
copies to and from over each GPU's `host_link`; `cluster.shared_memory.host`
names the server whose CPUs step the optimizer, at its DRAM bandwidth (none
named: at the store's own `bandwidth`, one DGX A100 socket's by default):

    cluster: {shared_memory: {host: dgx-h100, host_link: {bandwidth: 63 GB/s}}}
    host_step_s(nbytes, ranks=8, memory_bandwidth_Bps=host_memory_bandwidth(scenario.cluster.shared_memory))
"""
from dataclasses import dataclass

from ..errors import ScenarioError


@dataclass(frozen=True)
class HostSpec:
    """A GPU server's host: its CPUs, their DRAM bandwidth and each GPU's PCIe link."""

    name: str
    cpus: str
    memory_bandwidth_Bps: float  # every socket's DRAM channels together, peak
    pcie_bandwidth_Bps: float  # one GPU's PCIe x16 link, per direction


HOSTS: dict[str, HostSpec] = {
    # NVIDIA DGX A100 user guide (system specifications): 2x AMD EPYC 7742. AMD's EPYC 7002 datasheet: eight
    # DDR4-3200 channels a socket, 8 x 3200 MT/s x 8 B = 204.8 GB/s, 409.6 GB/s for two. GPUs on PCIe 4.0 x16:
    # 16 GT/s x 16 lanes x 128/130 / 8 = 31.5 GB/s per direction (PCI-SIG base specification 4.0).
    "dgx-a100": HostSpec(name="dgx-a100", cpus="2x AMD EPYC 7742 (64 cores)", memory_bandwidth_Bps=409.6e9,
                         pcie_bandwidth_Bps=31.5e9),
    # NVIDIA DGX H100 user guide (system specifications): 2x Intel Xeon Platinum 8480C. Intel's 4th-generation
    # Xeon Scalable: eight DDR5-4800 channels a socket, 8 x 4800 MT/s x 8 B = 307.2 GB/s, 614.4 GB/s for two.
    # GPUs on PCIe 5.0 x16: 32 GT/s x 16 x 128/130 / 8 = 63.0 GB/s per direction (PCI-SIG base spec. 5.0).
    "dgx-h100": HostSpec(name="dgx-h100", cpus="2x Intel Xeon Platinum 8480C (56 cores)",
                         memory_bandwidth_Bps=614.4e9, pcie_bandwidth_Bps=63.0e9),
}


def host_memory_bandwidth(spec) -> float:
    """Bytes/s the host's CPUs step an offloaded optimizer at: `cluster.shared_memory.host`'s DRAM bandwidth, or
    the store's own bandwidth when no host is named (`spec`: the scenario's SharedMemorySpec)."""
    if spec.host is None:
        return spec.bandwidth
    name = spec.host.strip().lower()
    if name not in HOSTS:
        raise ScenarioError(f"cluster.shared_memory.host: unknown host {spec.host!r}; known: {', '.join(HOSTS)}")
    return HOSTS[name].memory_bandwidth_Bps


def host_step_s(nbytes: float, ranks: int, memory_bandwidth_Bps: float) -> float:
    """Seconds one rank's host optimizer step of `nbytes` of DRAM traffic takes while `ranks` ranks step on the
    same host at once, sharing its `memory_bandwidth_Bps` evenly."""
    return nbytes * ranks / memory_bandwidth_Bps
