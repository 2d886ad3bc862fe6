"""OpenMP's worker threads, and the thread that runs the models.

llama.cpp (ggml) and PyTorch on the CPU run each pass on a team of OpenMP threads that belongs to the thread that
started it; a team's threads wait between passes. libgomp counts every team's threads, and once they outnumber the
cores it stops spinning at a pass's barriers and puts threads to sleep at each one, which makes every pass slower
(measured: a llama.cpp token of the 1.5B 40% slower). So a program that loads its models on one thread and runs them
on another (the server: the main thread loads, the worker decodes) frees the first thread's team when it hands the
models over.
"""

from __future__ import annotations

import ctypes

OMP_PAUSE_HARD = 2  # OpenMP 5.0's omp_pause_hard: the threads are freed, not only put to sleep


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP worker threads (libgomp's omp_pause_resource_all); they are made again if it
    runs a parallel pass later. False where there is no libgomp to ask (another OpenMP runtime, or none)."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1")  # the copy already loaded (PyTorch's or llama.cpp's), found by name
    except OSError:
        return False
    pause = getattr(gomp, "omp_pause_resource_all", None)
    return pause is not None and pause(OMP_PAUSE_HARD) == 0
