"""What a checkpoint and a restart cost a fleet's job, in seconds, from `fleet.checkpoint` and `fleet.recovery`.

A job of n GPUs whose checkpoint holds S bytes per GPU:

- **write to storage**: `latency + n S / storage_bandwidth` (every GPU writes
  at once and they share the storage's bandwidth; as train/job_checkpoint.py's
  `to: storage`). Sync: training waits for it. Async: training waits only
  for the snapshot to host memory, `latency + S / host_bandwidth` (each GPU
  over its own link, at once), then the write goes on in the background;
- **replicas** (k > 0): after the snapshot, each host sends it to k peers,
  `k S / peer_bandwidth` per GPU, in the background (Gemini, SOSP 2023);
- **restart**: relaunch, then communicator initialisation
  (`init_per_gpu x n`), then the load: `latency + n S / storage_bandwidth`
  from storage, or `latency + S / peer_bandwidth` from a peer's memory.

    costs = Costs(scenario.fleet, gpus=16384, bytes_per_gpu=30e9)
    costs.blocking_s, costs.background_s, costs.restart_s(from_memory=False)
"""
from dataclasses import dataclass

from ..scenario.fleet import FleetSpec


@dataclass(frozen=True)
class Costs:
    """Seconds of each part of a checkpoint and of a restart."""

    blocking_s: float  # training stops for this at each checkpoint
    background_s: float  # then the write to storage goes on this long (async; 0 for sync)
    replicate_s: float  # the copies to peers, after the blocking part (0: no replicas)
    relaunch_s: float
    communicator_init_s: float
    load_storage_s: float
    load_peer_s: float

    @classmethod
    def of(cls, fleet: FleetSpec, gpus: int, bytes_per_gpu: float) -> "Costs":
        checkpoint, recovery = fleet.checkpoint, fleet.recovery
        storage_s = checkpoint.latency + gpus * bytes_per_gpu / checkpoint.storage_bandwidth
        snapshot_s = checkpoint.latency + bytes_per_gpu / checkpoint.host_bandwidth
        sync = checkpoint.mode == "sync"
        return cls(
            blocking_s=storage_s if sync else snapshot_s,
            background_s=0.0 if sync else storage_s,
            replicate_s=checkpoint.replicas * bytes_per_gpu / checkpoint.peer_bandwidth,
            relaunch_s=recovery.relaunch,
            communicator_init_s=recovery.init_per_gpu * gpus,
            load_storage_s=storage_s,
            load_peer_s=checkpoint.latency + bytes_per_gpu / checkpoint.peer_bandwidth,
        )

    def restart_parts(self, from_memory: bool) -> list[tuple[str, float]]:
        """A restart's parts in order, each (phase, seconds)."""
        return [("relaunch", self.relaunch_s), ("communicator_init", self.communicator_init_s),
                ("checkpoint_load", self.load_peer_s if from_memory else self.load_storage_s)]
