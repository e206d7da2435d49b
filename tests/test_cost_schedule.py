"""The cost model's FSDP2 step with TAGC's worker thread (tagc/cost/schedule.py):
hand-timed schedules, its bounds, and how predict() uses it."""
from __future__ import annotations

import pytest

from tagc import cost as cm
from tagc.cost.schedule import FORWARD_SHARE, UnitJobs, worker_step_s


def _units(gathers, grads, shares):
    return [UnitJobs(i == 0, s, g, r) for i, (g, r, s) in enumerate(zip(gathers, grads, shares))]


def test_no_communication_is_the_compute() -> None:
    units = _units([0, 0, 0], [0, 0, 0], [0.2, 0.5, 0.3])
    assert worker_step_s(units, 3.0) == pytest.approx(3.0)


def test_a_hand_timed_step() -> None:
    """Root + two blocks, compute 3 s (forward 1 s: root 0.2, blocks 0.4 each; backward
    twice that), every gather 0.5 s and every exchange 0.3 s, traced by hand."""
    units = _units([0.5, 0.5, 0.5], [0.3, 0.3, 0.3], [0.2, 0.4, 0.4])
    # forward: G0 0-0.5 (waited), G1 0.5-1.0 (waited), G2 1.0-1.5 submitted at 1.0;
    # block 1 computes 1.0-1.4, waits G2 to 1.5, computes 1.5-1.9, root 1.9-2.1
    # backward: G0 2.1-2.6 (waited), G2 2.6-3.1 (prefetch); root 2.6-3.0; wait G2 ->
    # 3.1, G1 3.1-3.6 (prefetch), block 2 3.1-3.9, RS2 3.9-4.2; wait G1 (3.6), block 1
    # 3.9-4.7, RS1 4.7-5.0; root RS 5.0-5.3
    assert worker_step_s(units, 3.0) == pytest.approx(5.3)
    # gathered once: no backward gathers; the root's backward 2.1-2.5, block 2 2.5-3.3,
    # RS2 3.3-3.6, block 1 3.3-4.1, RS1 4.1-4.4, root RS 4.4-4.7
    assert worker_step_s(units, 3.0, reshard=False) == pytest.approx(4.7)
    # each exchange waited for at once (a bf16 reduce dtype): block 1 starts after RS2
    assert worker_step_s(units, 3.0, deferred=False) == pytest.approx(5.6)


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("deferred", [True, False])
@pytest.mark.parametrize("comm", [0.01, 0.3, 5.0])
def test_bounded_by_blocking_and_by_each_thread(reshard: bool, deferred: bool,
                                                comm: float) -> None:
    """Never longer than everything one after another, never shorter than the compute
    or than the worker's jobs, and the root's gather and last exchange are never hidden."""
    n = 12
    shares = [0.3] + [0.7 / (n - 1)] * (n - 1)
    units = _units([comm * (1 + i % 3) for i in range(n)], [comm / 2] * n, shares)
    compute = 4.0
    got = worker_step_s(units, compute, reshard, deferred)
    calls = 2 if reshard else 1
    jobs = sum(calls * u.gather_s + u.grad_s for u in units)
    assert got <= compute + jobs + 1e-12
    assert got >= max(compute, jobs) - 1e-12
    assert got >= compute + units[0].gather_s + units[0].grad_s - 1e-12


def test_bad_units_raise() -> None:
    with pytest.raises(ValueError, match="root"):
        worker_step_s([], 1.0)
    with pytest.raises(ValueError, match="root"):
        worker_step_s(_units([0, 0], [0, 0], [0.5, 0.5])[::-1], 1.0)
    with pytest.raises(ValueError, match="gather_s"):
        UnitJobs(True, 0.5, -1.0, 0.0)
    assert 0 < FORWARD_SHARE < 0.5


def _gpt2_cluster(worker: bool) -> cm.Cluster:
    return cm.Cluster(1, 2, 10.0, 0.2, backend="gloo", worker=worker)


def test_predict_schedules_tagcs_fsdp2_rows_only() -> None:
    """With Cluster.worker, TAGC's FULL_SHARD rows on FSDP2 are scheduled (their bytes,
    collective and codec totals unchanged); plain FSDP, FSDP1 and HSDP are not."""
    model = cm.gpt2_124m()
    full = cm.row_config("full")
    blocking = cm.predict(model, _gpt2_cluster(False), full, 4.0)
    beside = cm.predict(model, _gpt2_cluster(True), full, 4.0)
    assert blocking.scheduled_s is None and beside.scheduled_s is not None
    assert (beside.ideal, beside.comm_s, beside.codec_s) == \
        (blocking.ideal, blocking.comm_s, blocking.codec_s)
    assert max(4.0, beside.comm_s + beside.codec_s) <= beside.step_s < blocking.step_s
    assert blocking.step_s == pytest.approx(4.0 + blocking.comm_s + blocking.codec_s)
    for cfg in (cm.row_config("fsdp"), cm.row_config("balanced", fsdp=1)):
        assert cm.predict(model, _gpt2_cluster(True), cfg, 4.0).scheduled_s is None
    hsdp = cm.Cluster(1, 2, 10.0, 0.2, backend="gloo", worker=True)
    assert cm.predict(model, hsdp, cm.make_config("hsdp+balanced"), 4.0).scheduled_s is None


def test_predict_waits_each_exchange_under_a_bf16_reduce_dtype(monkeypatch) -> None:
    """FSDP2 casts a bf16 reduce output at once (tagc.fsdp2.deferrable): not deferred;
    the units go root first, in the layout's order, with their compute shares."""
    import importlib

    predict_mod = importlib.import_module("tagc.cost.predict")
    seen = []
    monkeypatch.setattr(predict_mod, "worker_step_s",
                        lambda units, compute, reshard, deferred: seen.append(
                            (units, compute, reshard, deferred)) or 1.0)
    model = cm.gpt2_124m()
    for row in ("full", "full-bf16", "full-noreshard"):
        cm.predict(model, _gpt2_cluster(True), cm.row_config(row), 4.0)
    assert [(c, r, d) for _, c, r, d in seen] == [(4.0, True, True), (4.0, True, False),
                                                 (4.0, False, True)]
    units = seen[0][0]
    assert [u.root for u in units] == [u.root for u in model.units]
    assert sum(u.share for u in units) == pytest.approx(1.0)
    assert units[0].share == pytest.approx(model.units[0].numel / model.params)
