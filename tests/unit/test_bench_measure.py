"""The bench's step clock and its workers' allocator setting (process-free but for a subprocess
that sets glibc's thresholds)."""

import json
import subprocess
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


_ALLOCATE_SIX_TIMES = """
import resource, sys, torch
from lightning_sparselift.bench.runner import retain_freed_memory
if sys.argv[1] == "retain":
    retain_freed_memory()
torch.set_num_threads(1)
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    del_me = torch.ones(7 * 1024 * 1024)  # 28 MB
    del del_me
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
print(faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, page faults counted per thread")
@pytest.mark.parametrize("how", ["default", "retain"])
def test_retained_freed_memory_is_reused_without_page_faults(how):
    out = subprocess.run([sys.executable, "-c", _ALLOCATE_SIX_TIMES, how], capture_output=True, text=True, check=True)
    faults = json.loads(out.stdout.strip().splitlines()[-1])
    pages = 7 * 1024 * 1024 * 4 // 4096
    assert faults[0] > pages // 2  # fresh memory either way
    if how == "retain":  # what was freed is reused: from the third allocation on, no page is mapped again
        assert sum(faults[2:]) < 100, faults
    else:  # glibc gives freed blocks back to the OS by thresholds that move with what was freed last
        assert sum(faults[1:]) > pages // 2, faults
