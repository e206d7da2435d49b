"""Failures surface, nothing hangs silently (tagc/overlap.py and the training script).

Without a process group: the worker's first failure, a deferred gradient exchange or
a gather nobody waits for, is raised on the training thread by the next submit, run or
wait, chained to the original, and no later job runs; the waits' bounds (torch's
``timedelta`` and seconds, the default bound counted from the worker's last progress).
With gloo: a real collective failing on the worker (a peer that never joins it) stops
the worker the same way; and a peer stopped with SIGSTOP under the real training
script makes the other rank exit with an error naming the timeout, within
``--timeout`` and a margin.
"""
from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch

from tagc.overlap import STALL_TIMEOUTS, JobWork, Overlap, group_timeout

REPO = Path(__file__).resolve().parent.parent

GATHER = "parameter all-gather"


def _boom() -> None:
    raise ValueError("injected")


def _backward_with(hook: Callable[[], None]) -> None:
    """One backward whose tensor hook calls ``hook`` (where FSDP calls TAGC's comms)."""
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: hook())
    (x * 3).sum().backward()


def _raises_chained(fn: Callable[[], Any], match: str, cause: type) -> RuntimeError:
    """Call ``fn``, which must raise a RuntimeError matching ``match`` whose chain of
    causes holds a ``cause``; returns it."""
    with pytest.raises(RuntimeError, match=match) as e:
        fn()
    chain, err = [], e.value.__cause__
    while err is not None:
        chain.append(err)
        err = err.__cause__
    assert any(isinstance(c, cause) for c in chain), chain
    return e.value


def _settle(ov: Overlap, timeout: float = 5.0) -> None:
    """Until the worker has taken every job (run or skipped)."""
    deadline = time.monotonic() + timeout
    while ov.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ov.pending == 0


# --------------------------------------------------------------------------- first failure

def test_a_failed_deferred_exchange_fails_the_backward_and_stops_the_worker() -> None:
    """The backward raises, the exchanges queued behind the failed one never run, and
    every later call raises again, chained to the first error."""
    ov = Overlap()
    gate = threading.Event()
    done: List[str] = []

    def hook() -> None:
        # all three queued before the failure: the worker itself must skip the last
        ov.submit(lambda: (gate.wait(5), done.append("first")))
        ov.submit(_boom)
        ov.submit(lambda: done.append("after"))
        gate.set()

    _raises_chained(lambda: _backward_with(hook), "overlapped HSDP all-reduce failed: injected",
                    ValueError)
    assert ov.pending == 0  # the jobs behind the failure were marked not run at once
    assert done == ["first"] and ov.failed
    _raises_chained(ov.wait, "overlapped HSDP all-reduce failed", ValueError)
    _raises_chained(lambda: ov.run(lambda: done.append("run"), GATHER),
                    "overlapped HSDP all-reduce failed", ValueError)
    _raises_chained(lambda: _backward_with(lambda: ov.submit(lambda: done.append("next"))),
                    "overlapped HSDP all-reduce failed", ValueError)
    time.sleep(0.05)
    assert done == ["first"] and ov.pending == 0
    ov.close()


def test_a_failed_gather_nobody_waits_for_is_raised_by_the_next_call() -> None:
    """An owned job's failure is not its work's alone: dropped, it still stops the
    worker, and the next run, submit or wait raises it; a job queued behind it fails
    as not run."""
    ov = Overlap("FSDP2 reduce-scatter")
    gate = threading.Event()
    done: List[str] = []
    first = ov.run(lambda: (gate.wait(5), done.append("first")), GATHER)
    dropped = ov.run(_boom, GATHER)  # FSDP never waits on it (say, a prefetch)
    later = ov.run(lambda: done.append("later"), GATHER)
    gate.set()
    _settle(ov)
    assert first.wait()  # it ran before the failure: its output is good
    err = _raises_chained(later.wait, f"not run: an earlier overlapped {GATHER} failed: "
                          "injected", ValueError)
    assert f"overlapped {GATHER} failed" in str(err)
    for call in (lambda: ov.run(lambda: done.append("run"), GATHER), ov.wait,
                 lambda: _backward_with(lambda: ov.submit(lambda: done.append("submit")))):
        _raises_chained(call, f"overlapped {GATHER} failed: injected", ValueError)
    _raises_chained(dropped.wait, f"overlapped {GATHER} failed: injected", ValueError)
    _settle(ov)
    assert done == ["first"]
    ov.close()

    ov = Overlap("FSDP2 reduce-scatter")  # the failure alone, nothing queued behind it
    ov.run(_boom, GATHER)
    _settle(ov)
    _raises_chained(lambda: ov.run(lambda: None, GATHER), "all-gather failed: injected",
                    ValueError)
    ov.close()


# --------------------------------------------------------------------------- timeouts

def _stuck(ov: Overlap) -> "tuple[threading.Event, JobWork, JobWork, List[str]]":
    """A job stuck until released, a job behind it, and what ran."""
    release, done = threading.Event(), []
    stuck = ov.run(lambda: (release.wait(10), done.append("stuck")), GATHER)
    behind = ov.run(lambda: done.append("behind"), GATHER)
    return release, stuck, behind, done


@pytest.mark.parametrize("bound", [datetime.timedelta(seconds=0.3), 0.3])
def test_a_work_wait_honours_its_timeout_and_stops_the_worker(bound: Any) -> None:
    """``JobWork.wait(timeout)`` (a timedelta as torch's ``Work.wait`` takes, or
    seconds) raises naming the job and the timeout; the job behind is not run even
    once the stuck one returns (this rank gave up: its peers did not)."""
    ov = Overlap(timeout=60)
    release, stuck, behind, done = _stuck(ov)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"timed out waiting for an overlapped {GATHER}: "
                                           "the wait's timeout of 0.3 s"):
        stuck.wait(bound)
    assert 0.25 < time.monotonic() - t0 < 3
    release.set()
    _settle(ov)
    _raises_chained(behind.wait, "not run: an earlier overlapped", RuntimeError)
    assert done == ["stuck"] and ov.failed
    ov.close()


def test_the_default_bound_counts_from_the_workers_last_progress() -> None:
    """Without a bound of its own (None, or torch's ``timedelta(0)``), a wait gives up
    once the worker finished no job for ``Overlap.timeout``; a slow queue that keeps
    finishing jobs is not stuck, however long it takes in all."""
    ov = Overlap(timeout=0.5)
    done: List[int] = []
    for i in range(6):  # 1.2 s in all, 0.2 s each
        ov.run(lambda i=i: (time.sleep(0.2), done.append(i)), GATHER)
    ov.wait()
    assert done == list(range(6))
    for wait in (lambda w: w.wait(), lambda w: w.wait(datetime.timedelta(0)),
                 lambda w: ov.wait()):
        ov = Overlap(timeout=0.5)
        release, stuck, behind, _ = _stuck(ov)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"timed out .* finished no job for 0.5 s"):
            wait(stuck)
        assert 0.45 < time.monotonic() - t0 < 3
        release.set()
        _settle(ov)
        _raises_chained(behind.wait, "not run", RuntimeError)
        ov.close()
    ov = Overlap(timeout=60)
    release, stuck, _, _ = _stuck(ov)
    with pytest.raises(RuntimeError, match="timed out .* wait's timeout of 0.2 s"):
        ov.wait(timeout=0.2)
    release.set()
    ov.close()


def test_the_default_bound_follows_the_process_group_timeout() -> None:
    assert Overlap().timeout == STALL_TIMEOUTS * group_timeout()
    assert Overlap(timeout=7).timeout == 7
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Overlap(timeout=0)


# --------------------------------------------------------------------------- gloo

def _absent_peer(rank: int, world: int) -> Dict[str, Any]:
    """Rank 1 never joins rank 0's second all-reduce: gloo fails it on rank 0 after the
    group's timeout, the worker stops, the job behind it never issues its collective,
    and rank 0's next run raises gloo's error."""
    import torch.distributed as dist

    group = dist.new_group(timeout=datetime.timedelta(seconds=2))
    ov = Overlap("FSDP2 reduce-scatter")
    out: Dict[str, Any] = {"bound": ov.timeout}
    t = torch.ones(4)
    assert ov.run(lambda: dist.all_reduce(t, group=group), GATHER).wait()
    out["sum"] = t.tolist()
    ran: List[str] = []
    if rank == 0:
        t0 = time.monotonic()
        failed = ov.run(lambda: dist.all_reduce(t, group=group), GATHER)
        behind = ov.run(lambda: (ran.append("behind"), dist.all_reduce(t, group=group)),
                        GATHER)
        try:
            behind.wait()
        except RuntimeError as e:
            out["behind"] = str(e)
        out["seconds"] = time.monotonic() - t0
        try:
            ov.run(lambda: ran.append("next"), GATHER)
        except RuntimeError as e:
            out["next"] = f"{e} <- {e.__cause__!r}"
        del failed  # never waited for
    out["ran"] = ran
    dist.barrier()  # the world group: rank 1 waits here until rank 0 is done
    ov.close()
    return out


@pytest.mark.dist
def test_a_collective_failing_on_the_worker_stops_it() -> None:
    from dist_helpers import run_dist

    res = run_dist(_absent_peer, 2, timeout=90)
    assert res[0]["sum"] == [2.0] * 4 and res[1]["ran"] == []
    assert res[0]["bound"] == STALL_TIMEOUTS * 60  # run_dist's group: 60 s
    assert res[0]["ran"] == [], "a job ran after the failure"
    assert "not run: an earlier overlapped parameter all-gather failed" in res[0]["behind"]
    assert 1.5 < res[0]["seconds"] < 20, res[0]["seconds"]
    assert "overlapped parameter all-gather failed" in res[0]["next"]
    assert "timed out" in res[0]["next"].lower(), res[0]["next"]  # gloo's own error


# --------------------------------------------------------------------------- the script

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TIMEOUT_S = 10.0
# startup past the timeout: the error's way out (tracebacks, atexit's bounded joins)
EXIT_MARGIN_S = 20.0


@pytest.mark.dist
@pytest.mark.codec
def test_a_stopped_peer_ends_the_run_with_a_timeout_error(tmp_path: Path) -> None:
    """Two ranks of ``python -m tagc.train`` (the environment torchrun sets), FSDP2 with
    a compressing preset (the exchanges on the overlap worker), ``--timeout 10``; after
    two steps rank 1 is stopped (SIGSTOP): rank 0 exits non-zero within the timeout
    and a margin, its output naming the timeout."""
    import tagc.train.data as token_data

    cache = tmp_path / "cache"
    token_data.prepare(token_data.get_source("stdlib"), token_data.byte_tokenizer(), cache)
    args = [sys.executable, "-m", "tagc.train", "--fsdp=2",
            "--tagc", str(REPO / "configs" / "tagc-2x-4bit.yaml"),
            f"--timeout={TIMEOUT_S:g}", f"--out_dir={tmp_path / 'out'}",
            f"--cache_dir={cache}", "--progress=false", "--tokenizer=byte",
            "--batch_size=2", "--block_size=32", "--eval_iters=1", "--eval_interval=100000",
            "--log_interval=1", "--warmup_iters=0", "--max_iters=100000",
            "--save_checkpoint=false", "--threads=1"]
    port, logs, procs = _free_port(), [tmp_path / f"rank{r}.log" for r in range(2)], []
    try:
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
            with open(logs[rank], "w") as f:
                procs.append(subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT,
                                              env=env, cwd=tmp_path))

        def log(rank: int) -> str:
            return logs[rank].read_text(errors="replace")

        deadline = time.monotonic() + 90
        while "\niter 2:" not in log(0):
            assert procs[0].poll() is None and procs[1].poll() is None, log(0) + log(1)
            assert time.monotonic() < deadline, "no step 2 in 90 s:\n" + log(0)
            time.sleep(0.1)
        seen = len(log(0))
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            rc = procs[0].wait(timeout=TIMEOUT_S + EXIT_MARGIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank 0 still running {TIMEOUT_S + EXIT_MARGIN_S:g} s "
                                 f"after its peer stopped:\n{log(0)[-3000:]}") from None
        took, after = time.monotonic() - t0, log(0)[seen:]
        assert rc != 0, after[-3000:]
        # gloo words it "timed out" or, when the pair closes first, "Application
        # timeout caused pair closure"
        assert re.search(r"timed out|timeout", after, re.IGNORECASE), after[-3000:]
        assert took > TIMEOUT_S * 0.8, (took, after[-3000:])  # the timeout ended it
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
            p.wait(10)


def _mesh_timeouts(rank: int, world: int) -> List[float]:
    from tagc.train.config import parse_config
    from tagc.train.sharding import device_mesh
    mesh = device_mesh(parse_config(["--fsdp=2", "--replicas=2", "--timeout=42"]),
                       torch.device("cpu"))
    return [mesh.get_group(d)._get_backend(torch.device("cpu")).options._timeout
            .total_seconds() for d in ("replicate", "shard")]


@pytest.mark.dist
def test_hsdp_mesh_groups_take_the_run_timeout() -> None:
    """--timeout reaches the HSDP mesh's own groups (new groups keep torch's 30
    minutes unless told), not only the default group."""
    from dist_helpers import run_dist
    assert run_dist(_mesh_timeouts, 4, timeout=120) == [[42.0, 42.0]] * 4
