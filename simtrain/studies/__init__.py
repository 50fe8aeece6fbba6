"""Studies of many runs: pbt.py, a population of jobs on one cluster (population-based training)."""
