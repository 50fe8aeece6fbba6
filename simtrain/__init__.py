"""simtrain: real torch numerics on simulated GPUs, links and clocks."""
__version__ = "0.1.0"
