"""Shared test fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: OpenMP threads only add overhead (and stall badly on a busy 2-core box).
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """Training runs gc.freeze() what survives their first steps (train.freeze_survivors);
    hand those objects back to the collector after each test, so that a test session does
    not keep every finished run's objects."""
    yield
    import gc

    gc.unfreeze()
