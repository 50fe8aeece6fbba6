"""The same scenario gives the same report, every time (DESIGN.md, Conventions: determinism).

- A storage's number (simtrain/storage_identity.py) is never handed to another storage, even one the host's
  allocator places at the freed storage's address: the measurements that compare storages (saved activations,
  the GEMMs beside tp collectives, saved sequence shards, users' ranks' memory) once keyed on that address, and
  the same scenario then ended in a KeyError one run and out of memory the next.
- Numerics-off layouts of the kinds that moved (fp8 with tp_comm_overlap under pp, sharding, experts), each
  run twice in fresh processes: report.json byte for byte, less `wall_time_s` (the host's clock).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from simtrain.storage_identity import StorageIds

ROOT = Path(__file__).resolve().parent.parent


def test_a_freed_storage_number_is_not_given_to_the_next_storage_at_its_address():
    ids = StorageIds()
    first = torch.empty(1024)
    number, address = ids.of(first), first.untyped_storage()._cdata
    assert ids.of(first.view(32, 32)) == number  # a view shares its storage
    assert ids.of(first.clone()) != number
    del first
    reused = None
    for _ in range(64):  # the allocator hands the freed block on, and its storage object often the same address
        candidate = torch.empty(1024)
        if candidate.untyped_storage()._cdata == address:
            reused = candidate
            break
    if reused is None:
        pytest.skip("the allocator placed no new storage at the freed one's address")
    assert ids.of(reused) != number


CASES = {
    "fp8 tp_comm_overlap pp": ("scenarios/llama_small.yaml", [
        "cluster.devices=16", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
        "parallel.tp_comm_overlap=true", "parallel.representatives=true", "train.steps=2"]),
    "zero3": ("scenarios/zero3.yaml", ["cluster.devices=64", "train.steps=2"]),
    "experts": ("scenarios/moe_expert_parallel.yaml", ["train.steps=2"]),
}


def _report(scenario: str, overrides: list[str], out: Path) -> str:
    command = [sys.executable, "-m", "simtrain", "run", scenario, "--no-numerics", "--quiet", "--out", str(out)]
    for override in overrides:
        command += ["--set", override]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok"
    del report["wall_time_s"]
    return json.dumps(report, sort_keys=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_numerics_off_layout_reports_the_same_bytes_in_two_fresh_processes(case, tmp_path):
    scenario, overrides = CASES[case]
    first, second = (_report(scenario, overrides, tmp_path / str(run)) for run in range(2))
    assert first == second
