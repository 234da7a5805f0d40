"""Shared pytest setup: markers, and state that every test must leave as it found it."""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU-only machines)")
    config.addinivalue_line("markers", "megatron: needs megatron-core (or a Megatron-LM checkout)")
    config.addinivalue_line("markers", "slow: spawns processes (mcore/dist.run_processes), runs "
                            "Megatron-LM or training in a subprocess, or takes over ~5 s; "
                            "`make test-fast` leaves these out")


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    import torch

    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
