"""What the step engine composes, each written once: replication, sharding, experts, tensor overlap.

The engine (schemes/model_parallel.py) runs every synchronous layout; what a
layout does beyond its pipeline and tensor-parallel regions is a strategy of
this package, handed the engine's typed context:

- replication: replicated_update.py (DDP's all-reduce, in buckets beside the
  backward: bucket_overlap.py), kfac_sync.py, sync_batchnorm.py;
- sharding: distributed_optimizer.py (ZeRO 1-3 and HSDP in every layout, its
  FSDP units under data parallelism alone: unit_overlap.py), sharded_replica.py,
  shard_layout.py, shard_units.py, sharded_update.py, offload.py;
- experts: expert_model_parallel.py, expert_groups.py, moe_report.py;
- tensor parallelism: tp_overlap.py (tp_comm_overlap), saved_shards.py
  (sequence parallelism's kept shards);
- shared: overflow_vote.py, representatives.py, weight_norms.py and
  scheme_checks.py (the refusals on the scenario's numbers).

No module here imports a scheme (the layer contract in pyproject.toml).
"""
