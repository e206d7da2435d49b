"""Teardown: a 2-rank gloo program that ends right after training must not abort.

The cause of the abort ("terminate called without an active exception", SIGABRT at
exit) is gloo's exit race, explained in ``tagc/teardown.py``: a gloo worker thread
lets go of a finished collective's Python-owned tensors after the interpreter began
finalizing.  ``tests/teardown_repro.py`` shows it with plain ``torch.distributed``
and a window widened by many small tensors; ``tests/teardown_worker.py`` is what a
user's FSDP script does at its end (train, save, destroy the group, no barrier).

Fast tests: the drain's pieces, and the repro with its tensors dropped while the
collective runs (``--drop before``): its undrained control must abort at least once
(so the test can see a broken drain) and every drained run must end cleanly.
The stress (opt-in; the race is rare in real programs) runs every case ``N`` times
and fails when a run with the drain (TAGC registers it; ``+drain`` cases install it
on plain runs) aborts; plain runs without it are the control, reported, not judged::

    TAGC_STRESS_RUNS=N pytest -m slow tests/test_teardown.py
    python tests/test_teardown.py --runs 20 --load 8     # counts per case, CPU burners
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from tagc import teardown

HERE = Path(__file__).resolve().parent
# case name -> (worker script, its arguments, its undrained control).  A case with a
# control has the drain installed and is judged; the controls are reported only.
CASES: Dict[str, Tuple[str, List[str], Optional[str]]] = {
    "fsdp1 plain": ("teardown_worker.py", ["--fsdp", "fsdp1"], None),
    "fsdp2 plain": ("teardown_worker.py", ["--fsdp", "fsdp2"], None),
    "fsdp1 plain+drain": ("teardown_worker.py", ["--fsdp", "fsdp1", "--drain"], "fsdp1 plain"),
    "fsdp2 plain+drain": ("teardown_worker.py", ["--fsdp", "fsdp2", "--drain"], "fsdp2 plain"),
    "fsdp1 exact": ("teardown_worker.py", ["--fsdp", "fsdp1", "--tagc", "exact"], "fsdp1 plain"),
    "fsdp2 exact": ("teardown_worker.py", ["--fsdp", "fsdp2", "--tagc", "exact"], "fsdp2 plain"),
    "fsdp1 quant": ("teardown_worker.py", ["--fsdp", "fsdp1", "--tagc", "quant"], "fsdp1 plain"),
    "fsdp2 quant": ("teardown_worker.py", ["--fsdp", "fsdp2", "--tagc", "quant"], "fsdp2 plain"),
    "repro global": ("teardown_repro.py", ["--hold", "global"], None),
    "repro cycle": ("teardown_repro.py", ["--hold", "cycle"], None),
    "repro global+drain": ("teardown_repro.py", ["--hold", "global", "--drain"], "repro global"),
    "repro cycle+drain": ("teardown_repro.py", ["--hold", "cycle", "--drain"], "repro cycle"),
    "repro early global": ("teardown_repro.py", ["--hold", "global", "--drop", "before"], None),
    "repro early cycle": ("teardown_repro.py", ["--hold", "cycle", "--drop", "before"], None),
    "repro early global+drain": ("teardown_repro.py",
                                 ["--hold", "global", "--drop", "before", "--drain"],
                                 "repro early global"),
    "repro early cycle+drain": ("teardown_repro.py",
                                ["--hold", "cycle", "--drop", "before", "--drain"],
                                "repro early cycle"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(case: str, timeout: float = 120.0) -> Tuple[bool, str]:
    """One 2-rank run of a case's worker script.

    Args:
        case: a key of :data:`CASES`.
        timeout: seconds before both ranks are killed (counted as a failure).
    Returns:
        ``(ok, detail)``: ok when both ranks exit 0 and neither prints
        "terminate called"; detail names each rank's exit code and the message.
    """
    script, extra, _ = CASES[case]
    port = _free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
            args = extra + (["--out", out] if script == "teardown_worker.py" else [])
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / script), *args],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + timeout
        results = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
                err += "\n(timeout)"
            results.append((p.returncode, err))
    ok = all(rc == 0 and "terminate called" not in err for rc, err in results)
    detail = "; ".join(f"rank {r}: rc={rc}" + (" terminate-called" if "terminate called" in err
                                                else "") + ("" if rc == 0 else f" {err[-300:]!r}")
                       for r, (rc, err) in enumerate(results))
    return ok, detail


def test_drain_refuses_bad_arguments() -> None:
    for kw in ({"timeout": 0}, {"interval": -1.0}, {"quiet_rounds": 0}):
        with pytest.raises(ValueError, match="drain"):
            teardown.drain(**kw)


def test_install_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: List[object] = []
    monkeypatch.setattr(teardown, "_installed", False)
    monkeypatch.setattr(teardown.atexit, "register", registered.append)
    teardown.install()
    teardown.install()
    assert registered == [teardown.drain]


_ONE_RANK = """
import os, tempfile, time, torch, torch.distributed as dist
from tagc import teardown
assert teardown.gloo_workers() == {}
assert teardown.drain()                        # nothing to wait for
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0,
                        world_size=1)
t = torch.ones(8); dist.all_reduce(t)
deadline = time.monotonic() + 10.0             # a worker names itself once it runs:
while len(teardown.gloo_workers()) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)                           # one may not have yet (seen: 1 in ~20)
w = teardown.gloo_workers()
assert len(w) == 2, w                          # ProcessGroupGloo's two workers
assert all(state in "RSD" and sw >= 0 for state, sw in w.values()), w
assert teardown.drain(timeout=30.0)            # idle workers are seen parked
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.dist
def test_drain_sees_gloo_workers_and_finds_them_parked() -> None:
    """In a fresh process: no workers before a group, two after, idle ones parked."""
    p = subprocess.run([sys.executable, "-c", _ONE_RANK], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"))
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


# Runs of the fast test below.  Without the drain ``--drop before`` aborted in 11 of 12
# runs per holding pattern on an idle 2-core machine and in 17 of 20 under two busy-loop
# burners (the waited-for repro, ``--drop after``: 11 of 20 there); with it, 0 of 12.
# At an abort rate of 0.7 or more per run, a drain that does nothing passes all
# DRAINED_RUNS with probability <= 0.3^8 = 7e-5, and the control ends cleanly in all
# CONTROL_RUNS (a false failure) with the same bound.  No deterministic abort was
# found: with the worker's last references certainly after the Python objects died
# and the GIL held to the end, some runs still end cleanly, the workers seen parked
# during finalization (a sleep there, the GIL released, did not change that).
CONTROL_RUNS = 8
DRAINED_RUNS = 8


@pytest.mark.dist
def test_drain_ends_cleanly_where_its_control_aborts() -> None:
    """The undrained ``--drop before`` repro aborts at least once in CONTROL_RUNS runs
    (stopping at the first abort): the race is there to be seen on this machine and
    torch, so the drained runs below can fail; then DRAINED_RUNS drained runs, both
    holding patterns in turn, all end cleanly.  A drain that does nothing fails here
    with probability >= 1 - 1e-4 (the rates above)."""
    control: List[str] = []
    for _ in range(CONTROL_RUNS):
        ok, detail = run_once("repro early global")
        control.append(detail)
        if not ok:
            break
    else:
        raise AssertionError(
            f"the undrained control 'repro early global' ended cleanly in all {CONTROL_RUNS} "
            f"runs, so this test cannot tell a working drain from a broken one (did torch "
            f"fix gloo's exit race?): {control}")
    for i in range(DRAINED_RUNS):
        case = ("repro early global+drain", "repro early cycle+drain")[i % 2]
        ok, detail = run_once(case)
        assert ok, f"{case}, run {i + 1} of {DRAINED_RUNS}: {detail}"


RUNS = int(os.environ.get("TAGC_STRESS_RUNS", "0"))


@pytest.mark.slow
@pytest.mark.skipif(RUNS <= 0, reason="teardown stress is opt-in: set TAGC_STRESS_RUNS=N")
@pytest.mark.parametrize("case", [c for c, (_, _, control) in CASES.items() if control])
def test_ends_without_barrier(case: str) -> None:
    """``RUNS`` runs of a drained case end cleanly; on a failure its plain control runs
    as often, so the message says whether the undrained program fails here too."""
    failures = [d for ok, d in (run_once(case) for _ in range(RUNS)) if not ok]
    if failures:
        control = CASES[case][2]
        bad = [d for ok, d in (run_once(control) for _ in range(RUNS)) if not ok]
        failures.append(f"control {control!r}: {len(bad)}/{RUNS} failed {bad}")
    assert not failures, failures


def _burners(n: int) -> List[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    """The full stress: ``--runs`` runs of every case under ``--load`` CPU burners."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--load", type=int, default=0, help="busy-loop processes beside the runs")
    ap.add_argument("--cases", default=",".join(CASES), help="comma list of case names")
    args = ap.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {list(CASES)}")
    burn = _burners(args.load)
    counts: Dict[str, int] = {c: 0 for c in cases}
    try:
        for i in range(args.runs):
            for case in cases:  # interleaved, so load drifts hit every case alike
                ok, detail = run_once(case)
                if not ok:
                    counts[case] += 1
                    print(f"run {i} {case}: FAILED {detail}", flush=True)
    finally:
        for p in burn:
            p.kill()
    print(f"load burners {args.load}, load average now {os.getloadavg()[0]:.1f}")
    for case, n in counts.items():
        print(f"{case:20s} failed {n}/{args.runs}")


if __name__ == "__main__":
    main()
