"""The bench's step clock (process-free)."""

import sys

import pytest
import torch

from lightning_sparselift.bench.measure import StepClock


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page faults are counted per thread on Linux")
def test_the_step_clock_counts_the_fresh_memory_a_step_touches_as_page_faults():
    clock, threads = StepClock(), torch.get_num_threads()
    torch.set_num_threads(1)  # (the clock counts its own thread's: the fill stays on it)
    try:
        with clock.time():
            pass
        with clock.time():
            torch.ones(16 * 1024 * 1024)  # 64 MB, mapped fresh: a page fault per 4 kB page touched
    finally:
        torch.set_num_threads(threads)
    quiet, touched = clock.page_faults
    assert touched >= 64 * 1024 * 1024 // 4096 * 0.9 and quiet < 100
    assert len(clock.wall_ms) == len(clock.thread_cpu_ms) == 2 and clock.thread_cpu_ms[1] > 0
