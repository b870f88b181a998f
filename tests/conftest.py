"""The suite's shared fixtures and its --full-depth option.

    pytest tests/test_rehearsal_shapes.py --full-depth   # also the tests marked full_depth

Tests marked full_depth (rehearsals at the models' real depth, minutes each on a CPU) are
skipped unless --full-depth is given.
"""

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--full-depth",
        action="store_true",
        default=False,
        help="also run the tests marked full_depth (rehearsals at the real depth, minutes each)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full-depth"):
        return
    skip = pytest.mark.skip(
        reason="full depth takes minutes on a CPU: pytest tests/test_rehearsal_shapes.py "
        "--full-depth"
    )
    for item in items:
        if "full_depth" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Tiny shapes: threads only add overhead (10x on a busy 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
