"""The GPU tests: correctness and no host synchronisation on a CUDA device, run with `python -m pytest -m gpu`.

Every module here is marked `gpu` (its `pytestmark`). Where torch sees no CUDA device each test in this folder is
skipped at collection, with the reason, as transformers' `require_torch_accelerator` skips: a CPU run collects them,
builds nothing and takes no time. What they build and how they bound an error: `gpu_models.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False): on a GPU machine, python -m pytest -m gpu"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda")
