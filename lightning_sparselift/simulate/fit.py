"""A hardware profile of the machine a run measured (``sparselift simulate fit-profile``): fitted
from what the run recorded for its step-time model (the all-to-all's alpha-beta, the copy
bandwidth, the cores per rank, the captured step and the collectives' backend CPU), and the
config's counted dense FLOPs, so that the simulator at the run's world size and batch gives the
run's captured step back.

The run is a plan file (``plan_path``: its graph is the plan's, its model's identity prediction
recorded) or a recorded bench run (``benchmarks/step_model_error.py``: the identity graph itself).
One all-to-all measured at one world size cannot separate the per-peer latency from the fixed one:
``per_peer_us`` is 0 and the fixed latency is the measured alpha; the ranks of a CPU run share the
host's memory, so the intra- and inter-node links are the same link.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning_sparselift.cost.step_model import StepModel
from lightning_sparselift.cost.step_record import StepModelInputs
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.simulate.profile import Device, HardwareProfile, Link
from lightning_sparselift.simulate.simulator import dense_step
from lightning_sparselift.simulate.workload import Workload
from lightning_sparselift.typed_json import decode


def read_run(path: Path) -> tuple[StepModelInputs, SparseGraph, float]:
    """(the model's inputs, a graph of the run, the identity plan's sparse ms) of a plan file or a
    recorded bench run."""
    data = json.loads(path.read_text())
    if "step_model" in data:  # a plan file
        from lightning_sparselift.plan.types import ExecutionPlan

        plan = ExecutionPlan.from_dict(data)
        if plan.step_model is None:
            raise ValueError(f"{path}: the plan recorded no step-time model (it was not calibrated)")
        return plan.step_model.inputs, plan.graph, plan.step_model.identity.sparse_ms
    if "inputs" in data and "identity" in data:  # a recorded run
        inputs = decode(StepModelInputs, data["inputs"], "inputs")
        identity = SparseGraph.from_dict(data["identity"])
        return inputs, identity, StepModel(inputs, identity).predict(identity).sparse_ms
    raise ValueError(f"{path}: neither a plan file nor a recorded bench run")


def fit_profile(run: Path, workload: Workload, name: str) -> HardwareProfile:
    inputs, graph, sparse_ms = read_run(run)
    world = graph.world_size
    if world < 2 or not inputs.links:
        raise ValueError(f"{run}: a run of {world} rank(s) measured no all-to-all; fit from a run of 2 or more ranks")
    batch = max(max(m.batch_size_per_rank) for m in graph.modules)
    link = inputs.links[0]
    # beta over the bytes a member puts in: (world - 1) / world of them leave it
    gb_per_s = (world - 1) / world / max(link.beta_ms_per_byte, 1e-15) / 1e6
    shared = Link(alpha_us=link.alpha_ms * 1e3, per_peer_us=0.0, gb_per_s=gb_per_s)
    backend = StepModel(inputs, graph).backend_ms_per_byte * 1e6
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / world
    profile = HardwareProfile(
        name=name, description=f"this machine as measured by a {world}-rank run of {workload.source}",
        device=Device(kind="cpu", dense_tflops=1.0, memory_gb_per_s=inputs.bandwidth_bytes_per_ms / 1e6,
                      launch_us=0.0, concurrent_lookups=inputs.cores_per_rank, memory_gib=round(memory, 1)),
        ranks_per_node=world, intra_node=shared, inter_node=shared, backend_cpu_ms_per_mb=backend,
        sources=[f"fitted by `sparselift simulate fit-profile --run {run}` on {workload.source}"])
    # the simulator's step is dense + max(all-reduce - dense backward, 0) + optimizer + sparse: solved
    # for the dense compute (the backward: its share of the counted FLOPs)
    rest_of_step = dense_step(workload, graph, profile, batch)
    step = max(inputs.timings.step_ms)
    rest = step - sparse_ms - rest_of_step.optimizer
    all_reduce = rest_of_step.all_reduce
    backward = workload.backward_flops / max(workload.forward_flops + workload.backward_flops, 1.0)
    dense = rest if all_reduce <= backward * rest else (rest - all_reduce) / (1 - backward)
    if dense <= 0:
        raise ValueError(f"{run}: the captured step ({step:.2f} ms) is not longer than the modelled sparse path "
                         f"({sparse_ms:.2f} ms) and the rest of the step; no dense throughput to fit")
    profile.device.dense_tflops = (workload.forward_flops + workload.backward_flops) * batch / dense / 1e9
    profile.measured = {"run": str(run), "workload": workload.source, "world_size": world, "batch_per_rank": batch,
                        "captured_step_ms": step, "modelled_sparse_ms": sparse_ms, "dense_ms": dense}
    return profile
