"""Shared by the three tiers (tests/README.md): ``unit/`` (one process, seconds), ``ranks/``
(multi-process CPU/gloo runs: the parity harness, the strategy's features), ``system/`` (the
examples, torchrun, SIGTERM, notebooks and the CLI as a user runs them). Every test is marked
with its tier; ``slow`` ones (full-length runs, and the whole ``system/`` tier: each of its tests
starts the processes a user's command would) are left out of ``make test``, and ``make test-all``
(CI) runs everything."""

import os
from pathlib import Path

import pytest
import torch

# Triton decides at import whether its kernels (and its own library's) are interpreted: without
# a GPU the generated Triton kernels run interpreted on CPU tensors (tests/unit/test_triton_lookup.py)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TIERS = ("unit", "ranks", "system")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """Generated datasets are cached per session (the generator is deterministic by spec)."""
    return tmp_path_factory.mktemp("data")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    root = Path(__file__).parent
    for item in items:
        tier = Path(str(item.fspath)).relative_to(root).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "system":
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))
