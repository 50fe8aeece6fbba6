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


def test_a_run_paces_the_garbage_collector_and_its_figures_do_not_depend_on_when_it_collects(monkeypatch):
    """A run sets the collector's thresholds to runner.RUN_COLLECTOR_THRESHOLDS and restores the caller's after.
    What the run measures (saved activations, whose finalizers release their storages) does not depend on when
    the collector runs: the quickstart's report is the same with the run's thresholds and with a collection at
    nearly every allocation, numerics on and off."""
    import gc

    import simtrain
    from simtrain import runner
    from simtrain.scenario import load_scenario

    seen = []
    caller = gc.get_threshold()
    for numerics in (True, False):
        reports = []
        for thresholds in (runner.RUN_COLLECTOR_THRESHOLDS, (1, 1, 1)):
            monkeypatch.setattr(runner, "RUN_COLLECTOR_THRESHOLDS", thresholds)
            scenario = load_scenario(ROOT / "scenarios" / "quickstart.yaml",
                                     ["train.steps=3", "report.trace=false", f"numerics={str(numerics).lower()}"])
            data = simtrain.run(scenario, on_step=lambda *_: seen.append(gc.get_threshold())).data
            reports.append({key: value for key, value in data.items() if key != "wall_time_s"})
            assert gc.get_threshold() == caller
        assert reports[0] == reports[1]
    assert set(seen) == {(50_000, 20, 20), (1, 1, 1)}
