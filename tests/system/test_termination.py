"""SIGTERM during training, or an exception on one rank alone, stops every rank promptly (popen
launcher, lifted executor running).

Each run starts ``sigterm_training.py`` as a user would (the launcher re-runs it for rank 1),
waits until both ranks run the lifted executor, sends SIGTERM at a random moment of a step to
the main process, to rank 1, or to both (as a cluster's scheduler does), and measures how long
until every process has exited. The collective timeout there is 60 s, so a rank stuck in a
collective shows up as a run over the bound (a hang guard: an exit takes a few seconds). `make
test` runs it once, `make test-all` ten times (about 9 s each on two cores), at other moments and
targets.
"""

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "sigterm_training.py"
EXIT_BOUND_S = 30.0
TARGETS = ("main", "rank1", "both")


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphaned rank may never be reaped here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_for_markers(folder: Path, main: subprocess.Popen, log: Path) -> dict[str, int]:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        markers = {p.name: p.read_text() for p in folder.glob("rank*")}
        if len(markers) == 2 and all(markers.values()):
            return {name: int(pid) for name, pid in markers.items()}
        assert main.poll() is None, f"training ended before the lifted executor ran:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"the lifted executor did not run within 300 s:\n{log.read_text()[-3000:]}")


def _time_to_exit(run: int, target: str, tmp_path: Path, data_cache: Path) -> float:
    """Seconds from SIGTERM until the main process and rank 1 have exited (inf: not within the bound)."""
    markers = tmp_path / f"markers{run}"
    markers.mkdir()
    log = tmp_path / f"run{run}.log"
    with log.open("w") as out:
        # its own session: the cleanup below can end every process of the run, stuck or not
        main = subprocess.Popen([sys.executable, str(SCRIPT), str(data_cache), str(markers)], cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        pids = _wait_for_markers(markers, main, log)
        time.sleep(random.Random(run).uniform(0.0, 0.5))  # somewhere in a step
        targets = {"main": [main.pid], "rank1": [pids["rank1"]], "both": [main.pid, pids["rank1"]]}[target]
        start = time.monotonic()
        for pid in targets:
            os.kill(pid, signal.SIGTERM)
        while time.monotonic() - start < EXIT_BOUND_S:
            if main.poll() is not None and not _running(pids["rank1"]):
                return time.monotonic() - start
            time.sleep(0.05)
        return float("inf")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(main.pid, signal.SIGKILL)  # the run's session, stuck ranks included
        main.wait()


@pytest.mark.parametrize("runs", [pytest.param(10, marks=pytest.mark.slow, id="ten"), pytest.param(1, id="once")])
def test_sigterm_stops_every_rank_promptly(runs, tmp_path, data_cache):
    times = {}
    for run in range(runs):
        target = TARGETS[run % len(TARGETS)]
        times[f"{run}:{target}"] = _time_to_exit(run, target, tmp_path, data_cache)
    slow = {run: t for run, t in times.items() if t > EXIT_BOUND_S}
    report = ", ".join(f"{run} {t:.1f}s" for run, t in times.items())
    assert not slow, f"{len(slow)} of {runs} run(s) took over {EXIT_BOUND_S:.0f} s to exit after SIGTERM: {report}"
    print(f"time to exit after SIGTERM: {report}")


@pytest.mark.parametrize("rank", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_a_rank_raising_alone_stops_every_rank_promptly(rank, tmp_path, data_cache):
    # (the other rank is then inside the next step's collectives, or waiting for the in-flight ones)
    log = tmp_path / "run.log"
    with log.open("w") as out:
        main = subprocess.Popen([sys.executable, str(SCRIPT), str(data_cache), str(tmp_path), str(rank)], cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        returncode = main.wait(timeout=300)
        other = int((tmp_path / "rank1").read_text())  # (the main process is rank 0)
        while _running(other) and time.monotonic() < float((tmp_path / "raised").read_text()) + 120:
            time.sleep(0.05)
        exited = time.monotonic()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(main.pid, signal.SIGKILL)
        main.wait()
    text = log.read_text()
    assert (tmp_path / "raised").exists(), text[-3000:]
    took = exited - float((tmp_path / "raised").read_text())
    assert returncode != 0 and f"user code failed on rank {rank} alone" in text, text[-3000:]
    assert took < EXIT_BOUND_S, f"every rank exited {took:.1f} s after rank {rank} raised"
    print(f"exited {took:.1f} s after rank {rank} raised")
