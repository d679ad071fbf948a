import importlib.metadata

import pytest
import torch

import dist_pool
import launch_pool
import plan_server

VERSIONED = ("torch", "transformers", "accelerate", "deepspeed")
"""The packages whose installed versions a run reports (in its header and on every failure)."""


def installed_versions() -> str:
    found = []
    for name in VERSIONED:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running; deselected by default, run with -m slow")
    config.addinivalue_line("markers", "hf_facing: the fast job over what binds to transformers, "
                                       "accelerate and deepspeed; .ci/run also runs it on the "
                                       "newest and on the oldest supported releases")


def pytest_report_header(config):
    return f"versions: {installed_versions()}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure names the versions it failed on (the test id names the family)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("versions", installed_versions()))
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
    launch_pool.shutdown()
    plan_server.shutdown()
