import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the shared helpers (tiny.py, ...) and the test modules of every layer's folder import by module name
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE] + sorted(os.path.join(HERE, d) for d in os.listdir(HERE)
                               if os.path.isdir(os.path.join(HERE, d)) and d.isidentifier() and not d.startswith("_"))

ALL_THREADS = torch.get_num_threads()


def pytest_configure(config):
    """A run of the unit tests alone (`-m "not integration"`, as `make test-fast` runs them, a worker per core): the
    processes its tests start (servers on the tiny models) run one OpenMP thread each, as the tests' own models do
    (`_threads`)."""
    if "not integration" in (config.option.markexpr or ""):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny in-process models run on one thread: their kernels are smaller than OpenMP's fork-join, which
    costs ~10x more when another process holds the other core. Tests on real models get every core."""
    torch.set_num_threads(ALL_THREADS if request.node.get_closest_marker("integration") else 1)
    yield
    torch.set_num_threads(ALL_THREADS)
