"""Shared test setup: torch on one host thread, as simtrain.run computes.

References computed in a test then sum in the same order as the simulator
(bit-for-bit comparisons hold), and thousands of tiny ops skip a thread pool's
contention.
"""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
