"""Lightning integration: registry names, YAML class_path, the CLI."""

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_sparselift
from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.launcher import DenseOnlyMultiProcessingLauncher

ROOT = Path(__file__).resolve().parents[1]


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


@pytest.mark.parametrize("config", ["tiny.yaml", "dlrm_synthetic.yaml", "dlrmv2_multihot.yaml"])
def test_configs_parse(config):
    from lightning_sparselift.cli import SparseLiftCLI
    from lightning_sparselift.data import CriteoDataModule
    from lightning_sparselift.model import DLRMModule

    cli = SparseLiftCLI(DLRMModule, CriteoDataModule, run=False,
                        args=["--config", str(ROOT / "configs" / config), "--trainer.logger=false"])
    assert isinstance(cli.trainer.strategy, SparseLiftStrategy)
    assert cli.model.hparams.num_embeddings_per_feature == cli.datamodule.table_sizes


def test_spawn_launcher_is_ours():
    strategy = SparseLiftStrategy(start_method="spawn")
    L.Trainer(strategy=strategy, accelerator="cpu", devices=2)
    assert isinstance(strategy.launcher, DenseOnlyMultiProcessingLauncher)
    assert lightning_sparselift.__version__
