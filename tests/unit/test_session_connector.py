"""The strategy's connector logs the calibration's progress every PROGRESS_EVERY training steps, not
at every step (a LightningModule.log costs ~1 ms a call on this machine: a tenth of a small model's
calibration step)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from lightning_sparselift.lightning.session_connector import PROGRESS_EVERY, SessionConnector
from lightning_sparselift.options import SessionOptions


class _Session:
    """What the connector reads of a session that calibrates for as long as the test runs."""

    def __init__(self) -> None:
        self.steps, self.torchrec_path_steps = 0, 0
        self.events, self.warnings, self.metrics = [], [], {}
        self.progress_reads = 0

    def end_step(self) -> bool:
        self.steps += 1
        return False

    @property
    def calibration_progress(self) -> tuple[int, int]:
        self.progress_reads += 1
        return self.steps, 200


class _Module:
    def __init__(self) -> None:
        self.trainer = SimpleNamespace(barebones=False)
        self.logged: list[tuple[dict, bool]] = []

    def log_dict(self, metrics: dict, prog_bar: bool = False, rank_zero_only: bool = False) -> None:
        self.logged.append((metrics, prog_bar))


def test_the_calibration_progress_is_logged_every_progress_every_steps():
    connector, module = SessionConnector(), _Module()
    connector.session = session = _Session()
    for _ in range(3 * PROGRESS_EVERY):
        connector.end_step(module)
    assert module.logged == [({"sparselift/calibration_step": float(k * PROGRESS_EVERY)}, True) for k in (1, 2, 3)]
    assert session.progress_reads == 3  # (computing it costs too: it is read only when logged)


def test_a_session_opened_learns_the_training_steps_left_and_its_rounds_calibrate_a_third_of_them():
    module = nn.Linear(1, 1)
    module.trainer = SimpleNamespace(estimated_stepping_batches=300, global_step=120)  # (resumed at step 120)
    connector = SessionConnector()
    connector.open(module, None, [], torch.device("cpu"), SessionOptions(), None, lambda: None)
    session = connector.session
    assert session.run_end == 180 and session._round_rule().max_steps == 60
    assert session.events == ["calibration budget: 60 steps (33% of the 180 training steps left)"]
    session.steps = 90  # (a round that starts later, e.g. on drift, has less left)
    assert session._round_rule().max_steps == 30
    module.trainer = SimpleNamespace(estimated_stepping_batches=float("inf"), global_step=0)
    connector.open(module, None, [], torch.device("cpu"), SessionOptions(), None, lambda: None)
    assert connector.session._round_rule().max_steps == 240  # (the run's length not known: the rule's)
