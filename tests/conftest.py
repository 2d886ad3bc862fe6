import os
import sys


CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []  # the run's, before pinning


def _pin_worker() -> None:
    """A pytest-xdist worker runs on its own share of the CPUs (worker i of n: every n-th CPU from the i-th), set
    before torch loads: its torch threads, llama.cpp's threads and the processes it starts (which inherit the
    mask) stay there instead of spinning against the other workers' threads on every core. Only where each worker
    gets a CPU of its own."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and count.isdigit() and 1 < int(count) <= len(CPUS):
        n = int(count)  # a worker restarted after a crash is numbered past n: it takes the share its number maps to
        os.sched_setaffinity(0, CPUS[int(worker[2:]) % n :: n])


_pin_worker()

import pytest  # noqa: E402
import torch  # noqa: E402

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
    costs ~10x more when another process holds the other core. Tests on real models get every core their worker
    has."""
    torch.set_num_threads(ALL_THREADS if request.node.get_closest_marker("integration") else 1)
    yield
    torch.set_num_threads(ALL_THREADS)


@pytest.fixture
def every_cpu():
    """The test's own thread on every CPU of the run, not its worker's share, while it runs: for tests whose child
    processes (which inherit that mask) must run several threads."""
    if not CPUS:
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, CPUS)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)
