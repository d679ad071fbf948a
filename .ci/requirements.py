"""Print what ``pip install -e ".[test]"`` asks for (setup.py's install_requires and its test
extra), one argument each, for .ci/run's newest-torch environment: it installs them while
the first job's tests run, and the project itself (``--no-deps -e .``) once that job is done."""

from __future__ import annotations

import runpy
from pathlib import Path

import setuptools


def requirements(setup_py: Path) -> list[str]:
    got: dict = {}
    real = setuptools.setup
    setuptools.setup = lambda **kwargs: got.update(kwargs)
    try:
        runpy.run_path(str(setup_py), run_name="__main__")
    finally:
        setuptools.setup = real
    return [*got["install_requires"], *got["extras_require"]["test"]]


if __name__ == "__main__":
    import os

    os.chdir(Path(__file__).resolve().parent.parent)  # setup.py reads README.md beside it
    print(" ".join(requirements(Path("setup.py"))))
