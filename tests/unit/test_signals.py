"""SLURM's requeue signal: its handler records it; the checkpoint (collectives) is saved between
two training steps, where every rank runs the same code."""

import signal
import types

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

from lightning_sparselift.lightning.signals import SignalConnector


def test_the_requeue_signal_saves_between_steps_not_in_its_handler(tmp_path):
    saved = []
    trainer = types.SimpleNamespace(
        local_rank=0, is_global_zero=False, loggers=[], default_root_dir=str(tmp_path), save_checkpoint=saved.append,
        strategy=types.SimpleNamespace(root_device=torch.device("cpu")),
        _accelerator_connector=types.SimpleNamespace(cluster_environment=SLURMEnvironment(auto_requeue=True)),
        _checkpoint_connector=types.SimpleNamespace(hpc_save_path=lambda folder: f"{folder}/hpc_ckpt_1.ckpt"))
    connector = SignalConnector(trainer)
    connector.register_signal_handlers()
    try:
        connector.requeue_if_signalled()
        assert saved == []  # no signal: no save
        connector._slurm_sigusr_handler_fn(signal.SIGUSR1, None)
        assert saved == []  # the handler saves nothing (a sharded save is collectives)
        connector.requeue_if_signalled()
        assert saved == [f"{tmp_path}/hpc_ckpt_1.ckpt"]  # the next step boundary does
        connector.requeue_if_signalled()
        assert len(saved) == 1
    finally:
        connector.teardown()


def test_without_slurms_auto_requeue_a_step_boundary_costs_nothing():
    trainer = types.SimpleNamespace(
        _accelerator_connector=types.SimpleNamespace(cluster_environment=SLURMEnvironment(auto_requeue=False)))
    connector = SignalConnector(trainer)
    connector.register_signal_handlers()
    try:
        connector.requeue_signal = signal.SIGUSR1
        connector.requeue_if_signalled()  # (no strategy to broadcast with: it would raise if it tried)
    finally:
        connector.teardown()
