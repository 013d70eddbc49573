"""Lightning integration: registry names, YAML class_path, the CLI."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from helpers import EXIT_ABORT
import lightning_sparselift
from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.lightning.launcher import DenseOnlyMultiProcessingLauncher

ROOT = Path(__file__).resolve().parents[2]


def test_import_registers_names():
    for name in ("sparselift", "sparselift_spawn", "sparselift_fork"):
        assert name in StrategyRegistry


@pytest.mark.parametrize("name, launcher", [("sparselift", "_SubprocessScriptLauncher"),
                                            ("sparselift_fork", "DenseOnlyMultiProcessingLauncher"),
                                            ("sparselift_spawn", "DenseOnlyMultiProcessingLauncher")])
def test_trainer_constructs_from_name(name, launcher):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, SparseLiftStrategy)
    assert type(trainer.strategy.launcher).__name__ == launcher
    assert trainer.strategy.is_distributed
    assert trainer.world_size == 2


def test_instance_and_fresh_interpreter():
    L.Trainer(strategy=SparseLiftStrategy(sharding_types={"t": "row_wise"}), accelerator="cpu", devices=2)
    code = ("import lightning_sparselift, lightning.pytorch as L; "
            "L.Trainer(strategy='sparselift', accelerator='cpu', devices=2)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_runs_tiny_config(tmp_path, data_cache):
    # the default launcher re-runs the command once per rank, like a user's `sparselift fit`
    out = subprocess.run(
        [str(Path(sys.executable).with_name("sparselift")), "fit", "--config", str(ROOT / "configs/tiny.yaml"),
         f"--data.cache_dir={data_cache}", f"--trainer.logger.init_args.save_dir={tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "throughput:" in out.stderr + out.stdout
    assert "val/auc=" in out.stderr + out.stdout
    metrics = next(tmp_path.rglob("metrics.csv")).read_text()
    assert "val/auc" in metrics and "val/logloss" in metrics


@pytest.mark.parametrize("config, family", [("tiny.yaml", "DLRMModule"), ("dlrm_synthetic.yaml", "DLRMModule"),
                                            ("dlrmv2_multihot.yaml", "DLRMModule"),
                                            ("sequence_synthetic.yaml", "SequenceRankingModule")])
def test_configs_parse(config, family):
    from lightning_sparselift.cli import SparseLiftCLI

    cli = SparseLiftCLI(run=False, args=["--config", str(ROOT / "configs" / config), "--trainer.logger=false"])
    assert isinstance(cli.trainer.strategy, SparseLiftStrategy)
    assert type(cli.model).__name__ == family  # a config without class_path means DLRMModule
    assert cli.model.hparams.num_embeddings_per_feature == cli.datamodule.table_sizes
    assert cli.model.hparams.feature_names == cli.datamodule.feature_names


def test_spawn_launcher_is_ours():
    strategy = SparseLiftStrategy(start_method="spawn")
    L.Trainer(strategy=strategy, accelerator="cpu", devices=2)
    assert isinstance(strategy.launcher, DenseOnlyMultiProcessingLauncher)
    assert lightning_sparselift.__version__


TORCHRUN_SCRIPT = """
import os, sys
from pathlib import Path
tests, data_cache, workers, strategy = sys.argv[1:5]
(Path(workers) / str(os.getpid())).touch()  # torchrun starts each worker in its own process group
sys.path.insert(0, tests)
import lightning.pytorch as L
import lightning_sparselift
from helpers import tiny_data, tiny_model

dm = tiny_data(Path(data_cache))
trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=6, limit_val_batches=0,
                    num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(tiny_model(dm), dm)
print(f"TRAINED rank={trainer.global_rank} world={trainer.world_size} steps={trainer.global_step} "
      f"executor={trainer.strategy.executor_in_use} pid={os.getpid()}", flush=True)
"""


@pytest.mark.parametrize("name", ["sparselift_fork", "sparselift_spawn"])
def test_fork_and_spawn_adopt_external_processes(name, monkeypatch):
    # torchrun's variables: TorchElasticEnvironment is detected, the processes exist already
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                       "TORCHELASTIC_RUN_ID": "test", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.cluster_environment.creates_processes_externally
    assert type(trainer.strategy.launcher) is _SubprocessScriptLauncher  # starts no process there


def test_fork_launcher_under_torchrun_trains_once_per_rank(tmp_path, data_cache):
    script, workers, log = tmp_path / "train.py", tmp_path / "workers", tmp_path / "torchrun.log"
    script.write_text(TORCHRUN_SCRIPT)
    workers.mkdir()
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node=2", str(script),
               str(ROOT / "tests"), str(data_cache), str(workers), "sparselift_fork"]
    with log.open("w") as out:
        run = subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        run.wait(timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"torchrun with sparselift_fork did not finish within 120 s:\n{log.read_text()[-3000:]}")
    finally:
        # torchrun's group and each worker's (with the processes a worker forked, if any)
        for group in [run.pid, *(int(worker.name) for worker in workers.iterdir())]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        run.wait()
    out = log.read_text()
    trained = sorted(line.split()[1:5] for line in out.splitlines() if line.startswith("TRAINED"))
    assert trained == [[f"rank={r}", "world=2", "steps=6", "executor=sparselift"] for r in (0, 1)], out[-3000:]
    if run.returncode != 0 and EXIT_ABORT in out:
        pytest.xfail(f"both ranks trained, then a worker aborted at interpreter exit ({EXIT_ABORT!r}): a known, "
                     f"intermittent exit-time abort of gloo workers, not diagnosed yet")
    assert run.returncode == 0, out[-3000:]
