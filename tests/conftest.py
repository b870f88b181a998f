import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny shapes: threads only add overhead (10x on a busy 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
