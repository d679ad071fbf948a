import pytest
import torch

import dist_pool


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running; deselected by default, run with -m slow")
    # Many tensors come back from worker ranks through queues; file descriptors run out.
    torch.multiprocessing.set_sharing_strategy("file_system")


def pytest_collection_modifyitems(config, items):
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: covered by a faster case in the default run; "
                                   "run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _shutdown_pools():
    yield
    dist_pool.shutdown()
