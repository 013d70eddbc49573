import os

import pytest
import torch

# Triton decides at import whether its kernels (and its own library's) are interpreted: without
# a GPU the generated Triton kernels run interpreted on CPU tensors (tests/test_triton_lookup.py)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """Generated datasets are cached per session (the generator is deterministic by spec)."""
    return tmp_path_factory.mktemp("data")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))
