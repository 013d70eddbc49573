"""The non-finite guard on every schedule: a non-finite dense value, label or KJT weight on one of
two ranks, on TorchRec's path, the identity plan and each forced-pass variant of the parity
harness (the consumer layout's gradient bypasses the module's output values), under both
policies: nothing changes on any rank (raise), or the run ends as one without those batches (skip)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.multiprocessing as mp

import non_finite_parity as nf
from helpers import free_port

WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("non_finite")
    mp.start_processes(nf.worker, args=(WORLD, free_port(), str(out)), nprocs=WORLD, start_method="spawn")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r in ranks:
        assert "error" not in r, r.get("error")
    return ranks


@pytest.mark.parametrize("what", list(nf.CORRUPTIONS))
@pytest.mark.parametrize("executor", list(nf.EXECUTORS))
def test_raise_leaves_every_tensor_on_every_rank_as_it_was(results, executor, what):
    sample = results[nf.CORRUPTIONS[what][0]][executor, "raise", what]["sample"]
    named = nf.CORRUPTIONS[what][1].format(sample=sample)
    for rank, result in enumerate(results):
        run = result[executor, "raise", what]
        assert re.search(f"non-finite values in training batch {nf.BAD_AT} .*{named}", run.get("error", "")), \
            f"rank {rank}: {run.get('error', 'no error')}"
        assert "No update of this step was applied" in run["error"]
        assert run["changed"] == [], f"rank {rank}: changed {run['changed']}"


@pytest.mark.parametrize("executor", list(nf.EXECUTORS))
def test_skip_ends_as_a_run_without_the_bad_batches(results, executor):
    for rank, result in enumerate(results):
        run, reference = result[executor, "skip"], result["without_bad"]
        assert run["skipped"] == len(nf.CORRUPTIONS) and reference["skipped"] == 0
        assert run["final"].keys() == reference["final"].keys()
        differ = [k for k in run["final"] if not torch.equal(run["final"][k], reference["final"][k])]
        assert differ == [], f"rank {rank}: {differ}"


def test_the_consumer_layout_ran(results):
    """The forced code generation wrote the module's output into the model's concatenation: the
    schedule whose gradient never passes the output values was exercised."""
    for result in results:
        assert result["generated", "skip"]["concatenated_steps"] > 0
        assert result["all_passes", "skip"]["concatenated_steps"] > 0
