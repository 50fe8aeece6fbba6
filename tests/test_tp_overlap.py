"""parallel.tp_comm_overlap (strategies/tp_overlap.py, Transformer Engine's userbuffers overlap) against its references.

- Numerics: a gpt under tp 2 with sequence parallelism trains the parameters it trains without the overlap,
  bit for bit (only time moves), and its collectives move the same bytes on the links, label by label.
- Time, closed forms (links of bandwidth B and no latency, a device of R FLOP/s; b sequences of s
  positions, hidden h, tp t, fp32):
  - ring exchange: the all-gather before the QKV Linears runs as t - 1 ring steps, each one shard of
    b (s/t) h x 4 bytes to the next rank (S = that / B), beside a 1/t slice of the QKV GEMMs
    (c = 3 x 2 b s h (h/t) / t / R), the last slice after the last step: c + (t - 1) max(c, S);
  - pipeline: the output projection's GEMM (2 b s (h/t) h FLOPs) in n = 4 slices, each on the SMs the
    reduce-scatter's 16 leave of the device's M (Transformer Engine's num_sm with set_sm_margin):
    g = (that / n / R) x M / (M - 16); each slice's reduce-scatter (t - 1 ring steps of b (s/t/n) h x 4 bytes:
    r = (t - 1) x that / B) started once the slice and the reduce-scatter before it are done:
    g + r + (n - 1) max(g, r);
  - backward: the second MLP Linear's output gradient all-gathered in ring steps beside its input-gradient
    GEMM (2 b s (4h/t) h FLOPs, in t slices), as in forward, on all M SMs (a ring exchange takes none);
  - bulk: the first MLP Linear's input gradient beside the re-gather of its saved input, and its weight
    gradient beside the reduce-scatter of that input gradient, each (2 b s (4h/t) h / R) x M / (M - 16).
  With links that cost nothing the step is its compute: the compute without the overlap, plus, per layer,
  the pipelined and bulk GEMMs' 19 x 2 b s h^2 / t FLOPs (output projection 1, second MLP Linear 4, QKV 2 x 3,
  first MLP Linear 2 x 4) x 16 / (M - 16) / R; on a device without an SM count, the compute without it.
- fp8 (train/fp8.py: each GEMM's operands cast with a scale from their amax, its result scaled back) carves the
  same GEMMs, so the numerics and the closed form of the compute are those above too.
- Representatives time it as the full simulation does (tests/test_representatives.py, a case with the key on).
- Bad input: the key without parallel.sequence_parallel is one line naming parallel.tp_comm_overlap, exit 2.
"""
import pytest
import torch

from simtrain import run
from simtrain.cli import main
from simtrain.hw.catalog import CATALOG
from simtrain.scenario import validate_scenario
from simulated_steps import bytes_by_label, flat_parameters, one_step

B_SEQ, S, H, HEADS = 2, 16, 32, 4  # sequences, positions, hidden, heads


SMS = CATALOG["a100-40gb"].streaming_multiprocessors  # M: the device's streaming multiprocessors
MARGIN = SMS / (SMS - 16)  # the time of a GEMM beside a pipeline or bulk overlap's communication, over its own


def scenario(tp: int, overlap: bool = True, numerics: bool = False, link: dict | None = None, steps: int = 1,
             sms: bool = True, precision: str = "fp32"):
    rate = 1e9
    peak_flops = {"fp32": rate, "tf32": rate, "fp16": rate, "bf16": rate, "fp8": rate}
    device = ({"base": "a100-40gb", "efficiency": 1.0, "peak_flops": peak_flops} if sms else  # 108 SMs
              {"name": "no-sms", "efficiency": 1.0, "peak_flops": peak_flops, "memory": "40 GiB",
               "memory_bandwidth": "1.5 TB/s"})
    return validate_scenario({
        "name": "tp-overlap", "seed": 1, "numerics": numerics,
        "cluster": {"devices": tp, "device": device, "link": link or {"bandwidth": 1e7, "latency": 0}},
        "model": {"name": "gpt", "hidden": H, "layers": 1, "heads": HEADS},
        "data": {"name": "tokens", "batch_size": B_SEQ, "samples": 64, "seq_len": S, "vocab": 16},
        "train": {"steps": steps, "precision": precision, "optimizer": {"lr": 0.1, "momentum": 0.9}},
        "parallel": {"tp": tp, "sequence_parallel": True, "tp_comm_overlap": overlap},
        "report": {"trace": False}})


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_the_overlap_trains_the_same_parameters_and_moves_the_same_bytes(precision):
    overlapped, alone = (one_step(scenario(2, overlap, numerics=True, precision=precision)) for overlap in (True, False))
    trained = [flat_parameters(job.scheme.trained_model()) for job in (overlapped, alone)]
    assert torch.equal(*trained)
    assert bytes_by_label(overlapped) == bytes_by_label(alone)
    assert bytes_by_label(overlapped)["tp_allgather"] > 0


def test_ring_exchange_and_pipeline_take_their_closed_forms_on_slow_links():
    t, n, rate, bandwidth = 4, 4, 1e9, 1e7
    spans = [span for span in one_step(scenario(t)).cluster.log.spans if span.rank == 0]
    names = [span.name for span in spans]
    c = 3 * 2 * B_SEQ * S * H * (H // t) / t / rate
    step_s = B_SEQ * (S // t) * H * 4 / bandwidth
    first = names.index("tp_allgather") - 1  # the first slice of the QKV GEMMs, beside the first ring step
    exchange = spans[first:first + 2 * t - 1]
    assert [span.name for span in exchange] == ["forward_part", "tp_allgather"] * (t - 1) + ["forward_part"]
    assert all(span.end - span.start == pytest.approx(c, rel=1e-12) for span in exchange[::2])
    assert exchange[-1].end - exchange[0].start == pytest.approx(c + (t - 1) * max(c, step_s), rel=1e-12)

    g = 2 * B_SEQ * S * (H // t) * H / n / rate * MARGIN
    r = (t - 1) * B_SEQ * (S // t // n) * H * 4 / bandwidth
    wait = names.index("tp_reducescatter", first + 2 * t)  # the first split's reduce-scatter, awaited
    pipeline = spans[wait - 2:wait + 6]
    assert [span.name for span in pipeline] == ["forward_part", "forward_part", "tp_reducescatter", "forward_part",
                                                "tp_reducescatter", "forward", "tp_reducescatter",
                                                "tp_reducescatter"]
    assert all(span.end - span.start == pytest.approx(g, rel=1e-12) for span in pipeline if span.kind == "compute")
    assert pipeline[-1].end - pipeline[0].start == pytest.approx(g + r + (n - 1) * max(g, r), rel=1e-12)

    # backward: the second MLP Linear's output gradient gathered beside its input-gradient GEMM, as in forward
    c = 2 * B_SEQ * S * (4 * H // t) * H / t / rate
    first = names.index("tp_allgather", names.index("backward")) - 1
    exchange = spans[first:first + 2 * t - 1]
    assert [span.name for span in exchange] == ["backward_part", "tp_allgather"] * (t - 1) + ["backward_part"]
    assert all(span.end - span.start == pytest.approx(c, rel=1e-12) for span in exchange[::2])
    assert exchange[-1].end - exchange[0].start == pytest.approx(c + (t - 1) * max(c, step_s), rel=1e-12)

    # bulk: the first MLP Linear's input gradient beside the re-gather, its weight gradient beside the
    # reduce-scatter of the input gradient (the second bulk pair of the backward: the QKV's comes after)
    half = 2 * B_SEQ * S * (4 * H // t) * H / rate * MARGIN
    regather = names.index("tp_regather", first + 2 * t - 1)
    bulk = spans[regather - 1:regather + 3]
    assert [span.name for span in bulk] == ["backward_part", "tp_regather", "backward", "tp_reducescatter"]
    assert [span.end - span.start for span in bulk[::2]] == pytest.approx([half, half], rel=1e-12)
    before = spans[regather - 2]  # the region's compute before them, beside no collective: on every SM
    assert before.name == "backward_part" and before.end - before.start == pytest.approx(before.flops / rate,
                                                                                          rel=1e-12)


@pytest.mark.parametrize("sms, precision", [(True, "fp32"), (False, "fp32"), (True, "fp8")],
                         ids=["108 SMs", "no SM count", "fp8"])
def test_with_free_links_the_step_is_the_compute(sms, precision):
    # fp8: the casts' scales, reductions of the gathered input, mark no GEMM as reading it (a KeyError before)
    free = {"bandwidth": 1e18, "latency": 0}
    overlapped, alone = (run(scenario(2, overlap, link=free, sms=sms, precision=precision)).data
                         for overlap in (True, False))
    breakdown = overlapped["breakdown_s"]
    assert breakdown["communication"] < 1e-6 * overlapped["step_time_s"]
    assert overlapped["step_time_s"] == pytest.approx(breakdown["compute"] + breakdown["optimizer"], rel=1e-6)
    margin = 19 * 2 * B_SEQ * S * H * H / 2 * 16 / (SMS - 16) / 1e9 if sms else 0.0
    assert breakdown["compute"] == pytest.approx(alone["breakdown_s"]["compute"] + margin, rel=1e-12)
    executed = [data["flops"]["device_tflops_per_device"] * data["sim_time_s"] for data in (overlapped, alone)]
    assert executed[0] == pytest.approx(executed[1], rel=1e-12)  # slower, the GEMMs still count their FLOPs


def test_the_overlap_without_sequence_parallelism_prints_one_line_and_exits_2(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("train: {steps: 1}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--set", "parallel.tp_comm_overlap=true", "--set", "parallel.tp=2",
              "--set", "cluster.devices=2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "parallel.tp_comm_overlap" in err and "sequence_parallel" in err and "\n" not in err
