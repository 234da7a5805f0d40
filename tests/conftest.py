"""Shared pytest setup: markers, the session's gloo jobs, and state that every test must leave as it
found it.

Tiers: `make test-fast` runs what is neither `gpu` nor `slow`; `make test-medium` adds the slow
tests marked `medium` (one or two per area, about two minutes in all); `make test` (CI) runs
everything but `gpu`.
"""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU-only machines)")
    config.addinivalue_line("markers", "megatron: needs megatron-core (or a Megatron-LM checkout)")
    config.addinivalue_line("markers", "slow: runs in a gloo job (the `gloo` fixture) or a "
                            "subprocess (Megatron-LM, torchrun, a script), or takes over ~5 s; "
                            "`make test-fast` leaves these out")
    config.addinivalue_line("markers", "medium: a slow test that `make test-medium` runs too "
                            "(one or two per area)")


def pytest_collection_modifyitems(config, items):
    """A test that runs in a gloo job is slow: the fast tier starts no process group."""
    unmarked = [item.nodeid for item in items if "gloo" in getattr(item, "fixturenames", ())
                and not item.get_closest_marker("slow")]
    if unmarked:
        raise pytest.UsageError("tests using the gloo fixture must be marked slow: "
                                + ", ".join(unmarked))


@pytest.fixture(scope="session")
def gloo():
    """Long-lived gloo jobs, one per world size, shared by the session's tests (tests/workers.py):
    `gloo.run(fn, world_size, *args)` runs fn(*args) on every rank and returns their results."""
    from tests.workers import GlooJobs

    jobs = GlooJobs()
    yield jobs
    jobs.close()


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    import torch

    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
