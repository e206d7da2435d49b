"""tagc/overlap.py without a process group: when a unit may be deferred, the worker's
order, the backward waiting for it, the work a handed-over job returns.  Its failures
and timeouts are tests/test_failures.py; the distributed checks (overlapped HSDP
equals the blocking hook bit for bit, accumulation blocks, a failing unit) are cases
of tests/test_hsdp.py."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, List

import pytest
import torch

from tagc.fsdp2 import deferrable
from tagc.overlap import Overlap


def _fp(grad: Any = None, offload: bool = False, dtype: torch.dtype = torch.float32,
        hooks: Any = None) -> Any:
    p = SimpleNamespace(grad=grad)
    if hooks is not None:
        p._post_accumulate_grad_hooks = hooks
    return SimpleNamespace(sharded_param=p, offload_to_cpu=offload, orig_dtype=dtype)


def _in_backward(fn: Any) -> Any:
    """Call ``fn()`` from inside a backward (a tensor hook); return what it returned."""
    out: List[Any] = []
    x = torch.ones(3, requires_grad=True)

    def hook(g: torch.Tensor) -> None:
        out.append(fn())

    x.register_hook(hook)
    (x * 2).sum().backward()
    return out[0]


def test_deferrable_only_inside_a_backward_and_when_fsdp_leaves_the_tensor_alone() -> None:
    t = torch.zeros(8)
    assert not deferrable(t, [_fp()])  # outside a backward: nothing would wait
    assert _in_backward(lambda: deferrable(t, [_fp(), _fp()]))
    assert _in_backward(lambda: deferrable(t, []))
    for bad in (_fp(grad=torch.zeros(8)),          # accumulates right after the hook
                _fp(offload=True),                 # copied to the host right after
                _fp(dtype=torch.bfloat16),         # cast into a new tensor right after
                _fp(hooks={0: lambda p: None})):   # user code reads .grad
        assert not _in_backward(lambda bad=bad: deferrable(t, [_fp(), bad]))
    assert _in_backward(lambda: deferrable(t, [_fp(hooks={})]))  # an empty dict: none


def test_jobs_run_in_order_and_the_backward_waits_for_them() -> None:
    ov = Overlap()
    done: List[int] = []
    x = torch.ones(4, requires_grad=True)

    def hook(g: torch.Tensor) -> None:
        for i in range(5):
            # later jobs are faster: only a FIFO worker keeps the order
            ov.submit(lambda i=i: (time.sleep(0.02 * (5 - i)), done.append(i)))

    x.register_hook(hook)
    (x * 3).sum().backward()
    assert done == [0, 1, 2, 3, 4]  # all of them, before backward() returned
    assert ov.pending == 0 and ov.deferred == 5
    ov.close()
    ov.close()  # idempotent


def test_each_backward_gets_its_own_wait() -> None:
    """A backward that follows another queues its own final callback (the first one's
    was used up), so its jobs are waited for too."""
    ov = Overlap()
    release = threading.Event()
    done: List[int] = []
    for k in range(2):
        x = torch.ones(2, requires_grad=True)
        x.register_hook(lambda g, k=k: ov.submit(
            lambda: (release.wait(5), done.append(k))))
        threading.Timer(0.05, release.set).start()
        (x * 2).sum().backward()
        assert done == list(range(k + 1))
        release.clear()
    ov.close()


def test_submit_outside_a_backward_is_refused() -> None:
    with pytest.raises(RuntimeError, match="outside a backward"):
        Overlap().submit(lambda: None)


def test_run_hands_back_a_work_that_waits_for_its_job_in_order() -> None:
    """``run`` (the gathers of ``fsdp_overlap``) queues behind the deferred jobs and
    returns a ``torch.distributed.Work`` that FSDP2 accepts and waits on, the way FSDP
    does (torch's ``timedelta(0)``: no bound of the call's own) or with none."""
    import datetime

    import torch.distributed as dist

    ov = Overlap("FSDP2 reduce-scatter")
    done: List[str] = []
    x = torch.ones(2, requires_grad=True)
    works: List[Any] = []

    def hook(g: torch.Tensor) -> None:
        ov.submit(lambda: (time.sleep(0.05), done.append("deferred")))
        works.append(ov.run(lambda: done.append("gather"), "parameter all-gather"))

    x.register_hook(hook)
    (x * 3).sum().backward()
    assert done == ["deferred", "gather"] and ov.handed == 1 and ov.deferred == 1
    assert all(isinstance(w, dist.Work) and w.is_completed() for w in works)
    assert works[0].wait() and works[0].wait(datetime.timedelta(0))  # idempotent
    w = ov.run(lambda: done.append("outside"), "parameter all-gather")  # no backward needed
    assert w.wait() and done[-1] == "outside"
    ov.wait()
    ov.close()



def test_close_does_not_hang_on_a_stuck_unit(caplog: Any) -> None:
    """A unit stuck (say, in a collective whose peer is gone) must not hold the exit:
    close() gives up after its timeout, with a warning."""
    ov = Overlap()
    release, started = threading.Event(), threading.Event()
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: ov.submit(lambda: (started.set(), release.wait(30))))
    # the backward waits for its unit: run it beside the test
    bwd = threading.Thread(target=lambda: (x * 2).sum().backward())
    bwd.start()
    assert started.wait(10)
    t0 = time.perf_counter()
    with caplog.at_level("WARNING", logger="tagc.overlap"):
        ov.close(timeout=0.2)
    assert time.perf_counter() - t0 < 5
    assert "still running" in caplog.text and ov.pending == 1
    release.set()
    bwd.join(10)
    assert not bwd.is_alive() and ov.pending == 0
