"""A hardware profile of the machine a run measured (``sparselift simulate fit-profile``): fitted
from what the run recorded for its step-time model (the all-to-all's bandwidth, the copy
bandwidth, the cores per rank, the collectives' backend CPU) and a collective's latency inside a
step measured here (the links' alpha: a step's exchanges follow compute, and on shared cores that
costs several times the alpha the run probed after a barrier); the dense step and TorchRec's step
at one rank are timed on this machine per workload (``dense: timed``: one throughput does not carry
from one model's layers to another's, nor one lookup rate from one table set to another), so the
profile is this machine's only.

The run is a plan file (``plan_path``: its graph is the plan's, its model's identity prediction
recorded) or a recorded bench run (``benchmarks/step_model_error.py``: the identity graph itself).
One all-to-all measured at one world size cannot separate the per-peer latency from the fixed one:
``per_peer_us`` is 0 and the fixed latency is the measured one; the ranks of a CPU run share the
host's memory, so the intra- and inter-node links are the same link.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_sparselift.cost.priors import measure_step_latency
from lightning_sparselift.cost.step_model import StepModel
from lightning_sparselift.cost.step_record import StepModelInputs
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.simulate.profile import Device, HardwareProfile, Link
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


def fit_profile(run: Path, workload: Workload, name: str, step_latency_ms: Optional[float] = None
                ) -> HardwareProfile:
    """``step_latency_ms``: a collective's latency inside a step on this machine
    (:func:`measure_step_latency_here`), the links' alpha; None: the run's probed alpha (after a
    barrier), which leaves the ranks' synchronisation in a step to the per-MB term."""
    inputs, graph, sparse_ms = read_run(run)
    world = graph.world_size
    if world < 2 or not inputs.links:
        raise ValueError(f"{run}: a run of {world} rank(s) measured no all-to-all; fit from a run of 2 or more ranks")
    batch = max(max(m.batch_size_per_rank) for m in graph.modules)
    link = inputs.links[0]
    # beta over the bytes a member puts in: (world - 1) / world of them leave it
    gb_per_s = (world - 1) / world / max(link.beta_ms_per_byte, 1e-15) / 1e6
    alpha_ms = link.alpha_ms if step_latency_ms is None else step_latency_ms
    shared = Link(alpha_us=alpha_ms * 1e3, per_peer_us=0.0, gb_per_s=gb_per_s)
    backend = StepModel(inputs, graph).backend_ms_per_byte * 1e6
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / world
    profile = HardwareProfile(
        name=name, description=f"this machine as measured by a {world}-rank run of {workload.source}",
        device=Device(kind="cpu", dense_tflops=1.0, memory_gb_per_s=inputs.bandwidth_bytes_per_ms / 1e6,
                      launch_us=0.0, concurrent_lookups=inputs.cores_per_rank, memory_gib=round(memory, 1),
                      dense="timed"),
        ranks_per_node=world, intra_node=shared, inter_node=shared, backend_cpu_ms_per_mb=backend,
        sources=[f"fitted by `sparselift simulate fit-profile --run {run}` on {workload.source}"])
    timed = workload.timed
    if timed is None:
        raise ValueError("fit-profile needs the workload's dense step timed on this machine (probe it with threads)")
    dense = timed.forward_ms + timed.backward_ms
    # (what the dense layers reached here: the profile also prices by FLOPs if its dense is set so)
    profile.device.dense_tflops = (workload.forward_flops + workload.backward_flops) * workload.batch_size / dense / 1e9
    captured = max(inputs.timings.step_ms)
    simulated, per_step_mb = _simulated(workload, world, batch, profile)
    # What the run's step took beyond the simulated one, per MB through its collectives, is what a
    # MB costs a rank's step beyond the link's alpha-beta and the backend's CPU: where the ranks
    # share the cores, the backend's threads and the other ranks take the training thread's core
    # while bytes move. It joins the backend's rate, the model's per-byte term of a collective on
    # the training thread.
    profile.backend_cpu_ms_per_mb += max(captured - simulated, 0.0) / per_step_mb if per_step_mb > 0 else 0.0
    profile.measured = {"run": str(run), "workload": workload.source, "world_size": world, "batch_per_rank": batch,
                        "captured_step_ms": captured, "modelled_sparse_ms": sparse_ms, "timed_dense_ms": dense,
                        "timed_one_rank_step_ms": workload.one_rank.step_ms, "timed_on_threads": timed.threads,
                        "backend_cpu_ms_per_mb": backend, "probed_alpha_us": link.alpha_ms * 1e3,
                        "step_latency_us": None if step_latency_ms is None else step_latency_ms * 1e3,
                        "simulated_step_ms_before_fit": simulated,
                        "collectives_mb_per_step": per_step_mb}
    return profile


def _simulated(workload: Workload, world: int, batch: int, profile: HardwareProfile) -> tuple[float, float]:
    """(the identity step the simulator predicts for the run on ``profile``, the MB a rank puts
    through the collectives per step: the sparse path's, the busiest rank's, and DDP's all-reduce)."""
    from lightning_sparselift.simulate.scaling import scaled_graph
    from lightning_sparselift.simulate.simulator import all_reduce_bytes, simulate_world

    graph = scaled_graph(workload, world, batch, profile)
    nodes = [n for n in graph.collectives() if n.issue != "ddp_backward"]  # (DDP's: all_reduce_bytes)
    sparse = max(sum(n.bytes_per_member[r] for n in nodes) for r in range(world))
    per_step_mb = (sparse + all_reduce_bytes(workload, graph)) / 1e6
    return simulate_world(workload, world, batch, profile).identity.step, per_step_mb


def measure_step_latency_here(world: int) -> float:
    """:func:`~lightning_sparselift.cost.priors.measure_step_latency` over ``world`` processes of
    this machine (ms; a few seconds)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "latency"
        mp.start_processes(_latency_rank, args=(world, str(Path(folder) / "store"), str(out)), nprocs=world,
                           start_method="spawn")
        return float(out.read_text())


def _latency_rank(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)  # (the profile's ranks: one training thread each)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        latency = measure_step_latency(dist.group.WORLD)
        if rank == 0:
            Path(out).write_text(repr(latency))
    finally:
        dist.destroy_process_group()
