"""The frameworks people train with, run unmodified on simulated ranks: torchtitan (torchtitan.py)."""
