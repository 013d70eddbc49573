"""SparseLift for PyTorch Lightning: ``Trainer(strategy="sparselift")`` trains TorchRec-sharded
recommendation models. Importing this package registers the strategy names ``sparselift``,
``sparselift_spawn`` and ``sparselift_fork``; torchrec itself is imported only when needed."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_sparselift._version import __version__
from lightning_sparselift.lightning.strategy import SparseLiftStrategy

SparseLiftStrategy.register_strategies(StrategyRegistry)

_LAZY = {
    "CriteoDataModule": "lightning_sparselift.data",
    "EvenDistributedSampler": "lightning_sparselift.data",
    "RecBatch": "lightning_sparselift.data",
    "DLRMModule": "lightning_sparselift.models",
    "RecModule": "lightning_sparselift.models",
    "SequenceRankingModule": "lightning_sparselift.models",
    "SequenceDataModule": "lightning_sparselift.data",
    "EmbeddingOptimizer": "lightning_sparselift.embedding_optimizer",
    "export_checkpoint": "lightning_sparselift.checkpoint.export",
    "load_from_checkpoint": "lightning_sparselift.checkpoint.export",
}

__all__ = ["SparseLiftStrategy", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_sparselift' has no attribute {name!r}")
