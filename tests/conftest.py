import pytest
import torch

import dist_pool


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running; deselected by default, run with -m slow")
    # Many tensors come back from worker ranks through queues; file descriptors run out.
    torch.multiprocessing.set_sharing_strategy("file_system")


@pytest.fixture(scope="session", autouse=True)
def _shutdown_pools():
    yield
    dist_pool.shutdown()
