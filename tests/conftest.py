"""Shared test setup: the repo root on sys.path, the `cuda` marker, a tiny data file."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (run by make gpu-check; skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine (make gpu-check runs these on a GPU)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
