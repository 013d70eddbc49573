"""Raw Criteo TSV files through Trainer.fit on two ranks (conversion, cache and batches:
tests/unit/test_criteo_files.py)."""

import torch

from criteo_rows import SIZES, make_rows, write_tsv
from lightning_sparselift.data import CriteoDataModule


def test_fit_on_tsv_files_two_ranks(tmp_path):
    import lightning.pytorch as L

    from helpers import tiny_model, trainer

    days = [write_tsv(tmp_path / f"day_{d}", make_rows(n, seed=10 + d)) for d, n in enumerate((96, 64))]
    cache = tmp_path / "cache"
    dm = CriteoDataModule(batch_size=16, criteo_tsv=[str(p) for p in days], rows_per_feature=SIZES,
                          cache_dir=str(cache))

    class Record(L.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            if trainer.global_rank == 0:
                metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
                torch.save({"step": trainer.global_step, "metrics": metrics}, tmp_path / "record.pt")

    t = trainer(2, max_epochs=1, callbacks=[Record()])
    t.fit(tiny_model(dm), dm)
    record = torch.load(tmp_path / "record.pt")
    assert record["step"] == 96 // 16 // 2  # day_0 on 2 ranks
    assert any("auc" in k for k in record["metrics"]), record  # validated on the first half of day_1
    assert len(list(cache.rglob("source.json"))) == 2  # each file converted once, read by both ranks
