"""Model tests run tiny tensors: intra-op threads only add overhead (and contention on a busy machine)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
