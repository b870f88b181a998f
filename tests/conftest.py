"""The suite's shared fixtures, its --full-depth option, and how it runs in parallel.

    python3 -m pytest -q -n 2                             # the suite, two workers (pytest-xdist)
    pytest tests/test_rehearsal_shapes.py --full-depth   # also the tests marked full_depth

Tests marked full_depth (rehearsals at the models' real depth, minutes each on a CPU) are
skipped unless --full-depth is given.

With -n N (pytest-xdist), N worker processes share the machine's cores: each worker's torch, and
every process a test starts from it, gets cores / N threads (at least 1), so that 2 workers on 2
cores run 2 threads in all, not 4 fighting for 2. pytest.ini hands out whole files
(--dist loadfile): many files build a model or a run once for all their tests (module fixtures,
minutes for the memory matrix), and a file split over two workers would build it twice. The
files with a test marked slow (multi-process runs, minutes for the longest) are sent out first,
so that the last minute is not one long file on one worker while the other sits idle; a serial
run keeps the files' own order.
"""

import os

import pytest
import torch


def _workers() -> int:
    """How many pytest-xdist workers this run has (1 without -n)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def pytest_configure(config):
    if _workers() > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) // _workers())
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the processes tests start inherit it
        torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption(
        "--full-depth",
        action="store_true",
        default=False,
        help="also run the tests marked full_depth (rehearsals at the real depth, minutes each)",
    )


def pytest_collection_modifyitems(config, items):
    if _workers() > 1:  # files with a slow test first; a stable sort keeps the order within
        slow_files = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow_files)
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
