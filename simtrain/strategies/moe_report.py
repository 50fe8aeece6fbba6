"""report.json's `moe` section: routing, drops and all-to-all per step of a mixture-of-experts job.

The step engine's experts (strategies/expert_model_parallel.py `ExpertLayers`)
keep, per step, what every ep group's routing did: `routing_figures` turns
the (assigned, kept) matrices, [ep rank][expert], of every MoE layer's
forwards (one ep group each) into the step's tokens per expert (kept
assignments: min, mean, max and their imbalance max / mean), the
assignments dropped past an expert's capacity, the bytes the exchanges moved
(every kept token bound for another rank crosses the network four times:
dispatch, combine and their backwards) and each expert's share of the
assignments. `moe_section` puts the steps together with the loss curve's step
ends and each step's all-to-all seconds (a rank's mean). The summary line
(views.py) and moe.png (report/moe_plot.py) read it.

    step = routing_figures(experts=8, ep=8, routings=[(assigned, kept), ...], token_bytes=512)
    section = moe_section(8, 8, "router", [step, ...], loss_curve, [0.0015, ...])
"""
from pydantic import Field

from ..report.sections import ReportSection, register_section


def routing_figures(experts: int, ep: int, routings, token_bytes: int) -> dict | None:
    """One step's figures from `routings`, the (assigned, kept) matrices of its MoE layers' forwards, one ep group's
    each (None: there were none)."""
    received, assigned_total, kept_total, moved = [], 0, 0, 0
    share = [0] * experts
    per = experts // ep
    for assigned, kept in routings:
        received += [sum(column) for column in zip(*kept)]
        assigned_total += sum(map(sum, assigned))
        kept_total += sum(map(sum, kept))
        share = [total + sum(column) for total, column in zip(share, zip(*assigned))]
        moved += sum(map(sum, kept)) - sum(sum(row[src * per:(src + 1) * per]) for src, row in enumerate(kept))
    if not received:
        return None
    mean = sum(received) / len(received)
    return {"min": min(received), "mean": mean, "max": max(received),
            "imbalance": max(received) / mean if mean else 1.0, "dropped": assigned_total - kept_total,
            # every kept token crosses to another rank four times: dispatch, combine and their backwards
            "bytes": 4 * moved * token_bytes, "share": share}


def moe_section(ep: int, experts: int, routing: str, steps: list[dict], loss_curve, all_to_all_time_s) -> dict:
    """report.json's `moe` section from each step's routing figures (`steps`: routing_figures') and the loss
    curve's step ends; `all_to_all_time_s` a list per step."""
    times = [end - start for (start, _), (end, _) in zip([(0.0, None)] + loss_curve, loss_curve)]
    shares = [sum(step["share"][e] for step in steps) for e in range(experts)]
    return {
        "ep": ep, "experts": experts, "routing": routing,
        "tokens_per_expert_min": [step["min"] for step in steps],
        "tokens_per_expert_mean": [step["mean"] for step in steps],
        "tokens_per_expert_max": [step["max"] for step in steps],
        "imbalance": [step["imbalance"] for step in steps],
        "dropped_tokens": [step["dropped"] for step in steps],
        "all_to_all_bytes": [step["bytes"] for step in steps],
        "all_to_all_time_s": all_to_all_time_s,
        "step_time_s": times,
        "expert_share": [share / sum(shares) for share in shares] if sum(shares) else [],
    }


class MoeSection(ReportSection):
    ep: int = Field(description="expert-parallel ranks per group (parallel.ep)")
    experts: int = Field(description="routed experts per MoE layer")
    routing: str = Field(description="where the routing came from: router (numerics on), or the routing model "
                                     "(balanced, zipf, histogram)")
    tokens_per_expert_min: list[int] = Field(description="per step: the fewest tokens an expert took (kept "
                                                         "assignments, over every MoE layer and ep group)")
    tokens_per_expert_mean: list[float] = Field(description="per step: the mean tokens an expert took")
    tokens_per_expert_max: list[int] = Field(description="per step: the most tokens an expert took")
    imbalance: list[float] = Field(description="per step: max / mean tokens per expert (1: balanced)")
    dropped_tokens: list[int] = Field(description="per step: assignments dropped past an expert's capacity")
    all_to_all_bytes: list[int] = Field(description="per step: bytes the MoE all-to-alls moved between ranks "
                                                    "(dispatch, combine and their backwards)")
    all_to_all_time_s: list[float] | None = Field(description="per step: a rank's mean seconds of exposed "
                                                              "all-to-all communication (dispatch, combine and "
                                                              "their backwards): waited for, with transfers of "
                                                              "its own in flight; what runs behind the other "
                                                              "pass of a DualPipe pair is hidden, not counted")
    step_time_s: list[float] = Field(description="per step: its simulated seconds")
    expert_share: list[float] = Field(description="each expert's share of the run's assignments (before drops): "
                                                  "model.moe.routing.histogram for a run without numerics")


register_section("moe", MoeSection, "mixture of experts: routing, drops and all-to-all per step "
                                    "(strategies/moe_report.py)")
