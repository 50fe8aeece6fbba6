"""The frameworks people train with, run unmodified on simulated ranks: torchtitan (torchtitan.py), Megatron-Core
(megatron.py), any script as torchrun runs it (script.py); the stand-ins they share (stand_ins.py)."""
