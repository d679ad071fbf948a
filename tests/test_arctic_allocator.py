"""arctic.memory.allocator: the launch paths turn on the CUDA allocator's expandable segments unless
the user configured the allocator, and warn when the user's configuration leaves them off.
CUDA is faked available (nothing is allocated: CUDA is not initialized)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from arctic.memory import allocator


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in allocator.ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_unset_is_set(cuda):
    assert allocator.use_expandable_segments() == "set"

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert allocator.use_expandable_segments() == "already"  # idempotent


@pytest.mark.parametrize("name", allocator.ENV_NAMES)
def test_a_user_setting_with_it_is_kept(cuda, name):
    cuda.setenv(name, "max_split_size_mb:512, expandable_segments:True")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert allocator.use_expandable_segments() == "already"

    assert os.environ[name] == "max_split_size_mb:512, expandable_segments:True"


@pytest.mark.parametrize("conf", ["max_split_size_mb:512", "expandable_segments:False"])
def test_a_user_setting_without_it_is_kept_with_a_warning(cuda, conf):
    cuda.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    with pytest.warns(UserWarning, match="leaves the CUDA allocator's expandable segments off"):
        assert allocator.use_expandable_segments() == "user"

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == conf


def test_an_initialized_allocator_is_changed_in_place(cuda):
    applied = []
    cuda.setattr(torch.cuda, "is_initialized", lambda: True)
    cuda.setattr(torch.cuda.memory, "_set_allocator_settings", applied.append)
    assert allocator.use_expandable_segments() == "set"
    assert applied == ["expandable_segments:True"]


def test_nothing_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert allocator.use_expandable_segments() == "no cuda"

    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_the_launch_paths_call_it():
    """arctic.initialize, the Trainer and examples/train_fsdp.py each call it before they
    build anything (checked in their source: a launch path that drops the call fails here)."""
    from helpers import launch_path_sources

    sources = launch_path_sources()
    for where, source in sources.items():
        assert "allocator.use_expandable_segments()" in source, where
