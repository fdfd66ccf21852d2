"""Shared fixtures only; tiny configs and models come from `builders`."""

from __future__ import annotations

import pytest
import torch
from builders import VOCAB


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread, and do not slow down when the machine is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def token_batch() -> torch.Tensor:
    return torch.randint(1, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
