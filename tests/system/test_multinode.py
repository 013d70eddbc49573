"""Several nodes: two ``torchrun`` "nodes" on the loopback interface train the own-model example
together, and the strategy takes ranks and world size from Lightning's cluster environments
(torchrun's TorchElastic variables, SLURM's ``srun`` variables)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from helpers import EXIT_ABORT, FULL, LIFTED, assert_calibration_finished, free_port
import lightning_sparselift  # noqa: F401  (registers the strategy names)
from lightning_sparselift import SparseLiftStrategy

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["sparselift", "sparselift_fork", "sparselift_spawn"]

TORCHELASTIC = ["TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT"]
SLURM = ["SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
         "SLURM_JOB_NAME", "SLURM_JOB_ID", "SLURM_NODELIST"]


def _environment(monkeypatch, values: dict[str, str]) -> None:
    """Exactly these launcher variables (of torchrun's and SLURM's); the others unset and restored
    afterwards, also when Lightning sets them (it writes MASTER_ADDR / MASTER_PORT)."""
    for key in TORCHELASTIC + SLURM:
        monkeypatch.setenv(key, "x")  # recorded, so the test's end restores the variable as it was
        monkeypatch.delenv(key)
    for key, value in values.items():
        monkeypatch.setenv(key, value)


def _torchelastic(rank: int, local_rank: int, node_rank: int, world_size: int, local_world_size: int) -> dict:
    return {"TORCHELASTIC_RUN_ID": "test", "WORLD_SIZE": str(world_size), "RANK": str(rank),
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(node_rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


# what srun sets for task 3 of `sbatch --nodes=2 --ntasks-per-node=2`: the second task on the second node
SRUN_TASK_3 = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_PROCID": "3",
               "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "812345",
               "SLURM_NODELIST": "node[07-08]"}


def _check_ranks(trainer: L.Trainer, environment: type, world_size: int, rank: int, local_rank: int,
                 node_rank: int) -> None:
    strategy = trainer.strategy
    assert isinstance(strategy, SparseLiftStrategy)
    assert type(strategy.cluster_environment) is environment
    assert strategy.cluster_environment.creates_processes_externally
    assert type(strategy.launcher) is _SubprocessScriptLauncher  # starts no process: they exist already
    assert (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank) == \
        (world_size, rank, local_rank, node_rank)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": world_size, "rank": rank}
    # what the launcher checks before the training function runs
    strategy.cluster_environment.validate_settings(num_devices=strategy.num_processes, num_nodes=strategy.num_nodes)


@pytest.mark.parametrize("name", NAMES)
def test_torchrun_environment_gives_ranks(name, monkeypatch):
    # torchrun --nnodes=2 --nproc-per-node=2: the second process of the second node
    _environment(monkeypatch, _torchelastic(rank=3, local_rank=1, node_rank=1, world_size=4, local_world_size=2))
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, num_nodes=2, logger=False)
    _check_ranks(trainer, TorchElasticEnvironment, world_size=4, rank=3, local_rank=1, node_rank=1)
    assert trainer.strategy.cluster_environment.main_address == "127.0.0.1"


def test_torchrun_world_size_must_match_num_nodes_times_devices(monkeypatch):
    _environment(monkeypatch, _torchelastic(rank=0, local_rank=0, node_rank=0, world_size=4, local_world_size=2))
    strategy = L.Trainer(strategy="sparselift", accelerator="cpu", devices=2, num_nodes=1, logger=False).strategy
    with pytest.raises(ValueError, match="does not match the world size"):
        strategy.cluster_environment.validate_settings(num_devices=strategy.num_processes,
                                                       num_nodes=strategy.num_nodes)


@pytest.mark.parametrize("name", NAMES)
def test_slurm_environment_gives_ranks(name, monkeypatch):
    _environment(monkeypatch, SRUN_TASK_3)
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, num_nodes=2, logger=False)
    _check_ranks(trainer, SLURMEnvironment, world_size=4, rank=3, local_rank=1, node_rank=1)
    environment = trainer.strategy.cluster_environment
    assert environment.main_address == "node07"  # the first node of the allocation
    assert environment.main_port == 15000 + 2345  # from the job id: the same on every node


def test_slurm_environment_without_auto_requeue(monkeypatch):
    # what docs/multinode.md recommends: no checkpoint saved from inside Lightning's SIGUSR1 handler
    _environment(monkeypatch, SRUN_TASK_3)
    trainer = L.Trainer(strategy="sparselift", accelerator="cpu", devices=2, num_nodes=2, logger=False,
                        plugins=[SLURMEnvironment(auto_requeue=False)])
    _check_ranks(trainer, SLURMEnvironment, world_size=4, rank=3, local_rank=1, node_rank=1)
    assert not trainer.strategy.cluster_environment.auto_requeue


def test_slurm_settings_must_match_the_allocation(monkeypatch):
    _environment(monkeypatch, SRUN_TASK_3)
    strategy = L.Trainer(strategy="sparselift", accelerator="cpu", devices=1, num_nodes=2, logger=False).strategy
    with pytest.raises(ValueError, match="ntasks-per-node=2"):
        strategy.cluster_environment.validate_settings(num_devices=strategy.num_processes,
                                                       num_nodes=strategy.num_nodes)


def test_torchrun_inside_a_slurm_allocation_is_torchrun(monkeypatch):
    # torchrun started by an sbatch script: Lightning prefers TorchElastic (torchrun made the processes)
    _environment(monkeypatch, {**SRUN_TASK_3, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1",
                               **_torchelastic(rank=1, local_rank=0, node_rank=1, world_size=2, local_world_size=1)})
    trainer = L.Trainer(strategy="sparselift", accelerator="cpu", devices=1, num_nodes=2, logger=False)
    _check_ranks(trainer, TorchElasticEnvironment, world_size=2, rank=1, local_rank=0, node_rank=1)


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (torchrun starts each worker in a session of its own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                # the parent pid is the 2nd field after the command name (which may hold spaces)
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _stop(run: subprocess.Popen) -> None:
    """End a torchrun that is still running and its workers (both in their own process groups)."""
    if run.poll() is not None:
        return
    workers = _children(run.pid)
    run.send_signal(signal.SIGTERM)  # torchrun stops its workers
    with contextlib.suppress(subprocess.TimeoutExpired):
        run.wait(timeout=15)
    for group in [run.pid, *workers]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    run.wait()


# the example's full length (its default calibration finishes: helpers.FULL), and a short run:
# every rank on the lifted executor, one plan for the job
LENGTHS = [pytest.param(FULL, marks=pytest.mark.slow, id="full"), pytest.param(120, id="short")]
HANG_GUARD_S = 1800  # a run that takes longer is stuck (3,700 steps took 140-450 s on 2-core machines)


@pytest.mark.parametrize("steps", LENGTHS)
def test_two_torchrun_nodes_train_the_own_model_example(steps, tmp_path):
    # two "nodes" of one process each, meeting at 127.0.0.1 (torchrun's static rendezvous): each
    # torchrun is what one would start on one machine of a two-machine job
    port, results = free_port(), tmp_path / "results"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    runs, logs = [], []
    for node in (0, 1):
        logs.append(tmp_path / f"node{node}.log")
        command = [torchrun, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}", "--master-addr=127.0.0.1",
                   f"--master-port={port}", str(ROOT / "examples/own_model.py"), "--num-nodes=2", "--devices=1",
                   f"--steps={steps}", f"--result-dir={results}"]
        with logs[-1].open("w") as log:
            runs.append(subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True))
    deadline = time.monotonic() + HANG_GUARD_S

    def aborted_after_training() -> bool:
        """Both nodes wrote their results and a worker aborted at interpreter exit (the other
        node's torchrun then waits for it until its own timeout)."""
        return (any(EXIT_ABORT in log.read_text() for log in logs)
                and all((results / f"rank{rank}.json").exists() for rank in (0, 1)))

    try:
        while any(run.poll() is None for run in runs) and time.monotonic() < deadline:
            if any(run.poll() not in (None, 0) for run in runs) and aborted_after_training():
                break
            time.sleep(1.0)
    finally:
        for run in runs:
            _stop(run)
    tails = "\n".join(f"--- node {n}:\n{log.read_text()[-2500:]}" for n, log in enumerate(logs))
    aborted = aborted_after_training()
    if not aborted:
        assert [run.returncode for run in runs] == [0, 0], tails
    assert f"executor: sparselift on 2 process(es), {steps} steps" in logs[0].read_text(), tails
    reports = [json.loads((results / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert (report["rank"], report["node_rank"], report["world_size"]) == (rank, rank, 2)
        assert report["cluster_environment"] == "TorchElasticEnvironment"
        assert report["executor"] in LIFTED and report["steps"] == steps
        if steps == FULL:
            assert_calibration_finished(report["decisions"])
    # one plan for the job, and the data-parallel dense weights agree across the nodes
    assert reports[0]["decisions"] == reports[1]["decisions"]
    assert reports[0]["dense_checksum"] == reports[1]["dense_checksum"]
    if aborted:
        pytest.xfail(f"both nodes trained as asserted, then a worker aborted at interpreter exit ({EXIT_ABORT!r}): "
                     f"the known, intermittent exit-time abort of gloo workers, not diagnosed yet")
