"""Shared fixtures: the tutorials are imported as modules (not run as __main__), so tests exercise the
very kernels the pages teach."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tutorials"


def load_tutorial(stem):
    """Import tutorials/<stem>.py once; importing runs no benchmark."""
    name = "tutorial_" + stem.replace("-", "_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TUTORIALS / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def softmax_lesson():
    return load_tutorial("01-fused-softmax")


@pytest.fixture(scope="session")
def long_softmax_lesson():
    return load_tutorial("02-long-softmax")


@pytest.fixture
def rng():
    """A fresh, unseeded generator per test: every run draws new inputs."""
    import torch

    generator = torch.Generator()
    generator.seed()
    return generator
