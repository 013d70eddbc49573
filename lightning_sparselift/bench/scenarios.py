"""Named benchmark scenarios (``configs/bench/<name>.yaml``): model shape, tables, data, optimizers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from lightning_sparselift.data import CRITEO_KAGGLE_CARDINALITIES, DLRMV2_POOLING_FACTORS, table_sizes

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "configs" / "bench"


@dataclass
class Scenario:
    name: str
    description: str
    rows: list[int]
    dims: list[int]
    pooling: list[float]
    model: dict[str, Any]
    batch_size: int
    length_distribution: str = "fixed"
    zipf_exponent: float = 1.05
    optimizer: dict[str, Any] = field(default_factory=dict)

    @property
    def num_features(self) -> int:
        return len(self.rows)

    @property
    def feature_names(self) -> list[str]:
        return [f"cat_{i}" for i in range(self.num_features)]

    def module_kwargs(self) -> dict[str, Any]:
        """Arguments of :class:`~lightning_sparselift.model.DLRMModule` for this scenario."""
        uniform = len(set(self.dims)) == 1
        kwargs = dict(self.model)
        kwargs.update(num_embeddings_per_feature=self.rows, embedding_dim=self.dims[0], feature_names=self.feature_names,
                      embedding_dims=None if uniform else self.dims,
                      dense_optimizer=self.optimizer.get("dense", "sgd"), dense_lr=self.optimizer.get("dense_lr", 0.1))
        return kwargs

    def embedding_optimizer(self) -> dict[str, Any]:
        return {"name": self.optimizer.get("embedding", "sgd"), "lr": self.optimizer.get("embedding_lr", 0.1)}


def available() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def _cycle(values: list, n: int) -> list:
    return list(itertools.islice(itertools.cycle(values), n))


def load(name_or_path: str) -> Scenario:
    path = Path(name_or_path)
    if not path.suffix:
        path = SCENARIO_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ValueError(f"unknown scenario {name_or_path!r}; available: {available()} (or a path to a YAML file)")
    spec = yaml.safe_load(path.read_text())
    tables = spec.pop("tables")
    if tables.get("criteo"):
        rows = table_sizes(CRITEO_KAGGLE_CARDINALITIES, tables.get("max_rows"))
    else:
        rows = _cycle(tables["rows"], int(tables.get("num_features", len(tables["rows"]))))
    pooling: Optional[Any] = tables.get("pooling", [1])
    pooling = list(DLRMV2_POOLING_FACTORS) if pooling == "dlrmv2" else pooling
    return Scenario(rows=rows, dims=_cycle(tables.get("dims", [64]), len(rows)),
                    pooling=[float(p) for p in _cycle(pooling, len(rows))],
                    length_distribution=tables.get("length_distribution", "fixed"), **spec)
