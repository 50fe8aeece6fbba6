"""The longer form of tests/test_valid_scenarios.py: many drawn scenarios, each run, the outcomes counted.

    python bench/valid_scenarios.py --examples 1000 [--seed 0]

Prints how many ran, each refusal's reason with its count (the combinations still refused, for the support
table), and every draw that ended in a traceback, with the scenario: those are bugs. Exits 1 if any did.
"""
import argparse
import collections
import json
import sys
import traceback
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from scenario_space import outcome, scenarios  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    outcomes, crashes = collections.Counter(), []

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(scenarios())
    def draw(raw):
        try:
            outcomes[outcome(raw)] += 1
        except Exception as error:  # a bug: kept with its scenario, the draws go on
            crashes.append((f"{type(error).__name__}: {error}".splitlines()[0][:200],
                            traceback.format_exception(error)[-2].strip().splitlines()[0], raw))

    draw()
    for reason, count in outcomes.most_common():
        print(f"{count:6d}  {reason}")
    print(f"{len(crashes):6d}  tracebacks")
    for message, where, raw in crashes:
        print(f"  {message}\n    at {where}\n    {json.dumps(raw)}")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
