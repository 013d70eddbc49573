"""A collective's latency inside a step (``sparselift simulate fit-profile`` measures it on as many
processes as the run had ranks): an all-to-all issued after compute, as a step issues it."""

import math

from lightning_sparselift.simulate.fit import measure_step_latency_here


def test_a_collective_after_compute_is_timed_over_two_processes():
    latency = measure_step_latency_here(2)
    assert math.isfinite(latency) and 0.0 < latency < 50.0
