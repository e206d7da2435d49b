"""CPU tests of the sync-free pieces of the hook's CUDA path (issue 6, item 3).

No GPU here: the CUDA branches of the hook only run on a GPU
(tests/test_cuda_hook.py), but the pure tensor logic they are built from is
device-agnostic and is checked here on CPU tensors: the flag gate, the
non-finite poisoning, device-counter accumulation read only by stats(), and
the collective wrapper's CPU behaviour.
"""
from __future__ import annotations

import math

import pytest
import torch

from tagc.device import Exec, Scratch, gate, poison_nonfinite
from tagc.stats import UnitStats


def test_gate_selects_without_leaking_nonfinite() -> None:
    v = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    torch.testing.assert_close(gate(v, torch.tensor([True])), v, equal_nan=True)
    # A product v * ok would turn NaN/Inf into NaN; where() gives exact zeros.
    got = gate(v, torch.tensor([False]))
    assert torch.equal(got, torch.zeros(4))
    per_elem = gate(v, torch.tensor([True, False, False, True]))
    assert torch.equal(per_elem, torch.tensor([1.0, 0.0, 0.0, -2.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_poison_nonfinite(dtype: torch.dtype) -> None:
    g = torch.randn(3, 5).to(dtype)
    before = g.clone()
    poison_nonfinite(g, torch.tensor([False]))
    assert torch.equal(g, before)  # flag clear: bit-identical
    poison_nonfinite(g, torch.tensor([True]))
    assert torch.isnan(g[:, 0]).all()  # every shard now fails sparsify's finiteness check
    assert torch.equal(g[:, 1:], before[:, 1:])  # nothing else touched


def test_poison_makes_every_shard_nonfinite_for_the_codec() -> None:
    # The CUDA sparsify treats a shard like the C op's NONFINITE case; on CPU
    # the C op raises, which shows each poisoned shard is non-finite to it.
    _tagc = pytest.importorskip("_tagc")
    n, s, k = 3, 64, 4
    g = torch.randn(n, s)
    poison_nonfinite(g, torch.tensor([True]))
    res = torch.zeros(s)
    for r in range(n):
        with pytest.raises(_tagc.NonFiniteError):
            _tagc.sparsify(torch.empty(k, dtype=torch.int32), torch.empty(k),
                           torch.empty((s + 7) // 8, dtype=torch.uint8), res, g[r], k)
    assert torch.equal(res, torch.zeros(s))


def test_device_counters_accumulate_gated_and_read_in_stats() -> None:
    st = UnitStats()
    st.add("shard_slots", 10)  # host numbers go straight to the host counters
    st.add("union_size", torch.tensor([3], dtype=torch.int64))
    no = torch.tensor([False])  # a non-finite call: its device counts are dropped
    st.add("union_size", torch.tensor([100], dtype=torch.int64), no)
    st.add("collision_dropped_l1", torch.tensor(float("nan")), no)
    yes = torch.tensor([True])
    st.add("union_size", torch.tensor([4], dtype=torch.int64), yes)
    st.add("collision_dropped_l1", torch.tensor(0.25, dtype=torch.float64), yes)
    d = st.as_dict()
    assert d["union_size"] == 7 and isinstance(d["union_size"], int)
    assert d["shard_slots"] == 10
    assert d["density"] == pytest.approx(0.7)
    assert d["collision_dropped_l1"] == pytest.approx(0.25)
    assert not math.isnan(d["collision_dropped_l1"])
    st.reset()
    assert st.as_dict()["union_size"] == 0


def test_nonfinite_flag_counts_on_device() -> None:
    # The CUDA branch of UnitReducer._agree_finite: fallbacks += bad, compressed_calls += ok.
    st = UnitStats()
    for bad in (False, True, False):
        b = torch.tensor([bad])
        st.add("nonfinite_fallbacks", b)
        st.add("compressed_calls", ~b)
    d = st.as_dict()
    assert (d["compressed_calls"], d["nonfinite_fallbacks"]) == (2, 1)


def test_keep_gates_state_updates() -> None:
    dev = Exec(torch.zeros(1))
    new, old = torch.tensor([1.0, float("nan")]), torch.tensor([5.0, 6.0])
    assert dev.keep(new, old) is new  # CPU: a non-finite call never gets this far
    dev.ok = torch.tensor([False])
    assert torch.equal(dev.keep(new, old), old)
    dev.ok = torch.tensor([True])
    assert torch.equal(dev.keep(new, old)[:1], new[:1])


def test_issue_on_cpu_passes_async_op_through() -> None:
    seen = []

    def fake(*args, async_op: bool, **kw):  # type: ignore[no-untyped-def]
        seen.append((args, async_op, kw))
        return "work" if async_op else None

    dev = Exec(torch.zeros(1))
    assert not dev.cuda and dev.kw == {}
    assert dev.issue(True, fake, 1, group=None) == "work"
    assert dev.issue(False, fake, 2) is None
    assert seen == [((1,), True, {"group": None}), ((2,), False, {})]


def test_issue_on_cuda_is_async_and_waits_on_the_work() -> None:
    # The CUDA branch: always async_op=True; a synchronous caller gets
    # work.wait() (a stream wait under NCCL), an async caller the work.
    waited = []

    class Work:
        def wait(self) -> None:
            waited.append(True)

    def fake(*args, async_op: bool, **kw):  # type: ignore[no-untyped-def]
        assert async_op is True
        return Work()

    dev = Exec(torch.zeros(1))
    dev.cuda = True  # the branch's logic, without a GPU
    assert dev.issue(False, fake) is None and waited == [True]
    assert isinstance(dev.issue(True, fake), Work) and waited == [True]


def test_scratch_reuses_one_buffer_per_name_and_dtype() -> None:
    """A name's buffer is faulted in once: later requests of the same or a smaller
    size view the same memory; a larger one grows it; names and dtypes are apart."""
    sc = Scratch()
    a = sc.empty("acc", (3, 5), torch.float32, torch.device("cpu"))
    assert a.shape == (3, 5) and a.dtype == torch.float32 and a.is_contiguous()
    assert sc.empty("acc", (15,), torch.float32, "cpu").data_ptr() == a.data_ptr()
    assert sc.empty("acc", (4,), torch.float32, "cpu").data_ptr() == a.data_ptr()
    assert sc.empty("out", (4,), torch.float32, "cpu").data_ptr() != a.data_ptr()
    assert sc.empty("acc", (4,), torch.uint8, "cpu").dtype == torch.uint8
    assert sc.nbytes == 15 * 4 + 4 * 4 + 4
    big = sc.empty("acc", (100,), torch.float32, "cpu")
    assert big.numel() == 100 and sc.nbytes == 100 * 4 + 4 * 4 + 4
    assert sc.empty("acc", (0,), torch.float32, "cpu").numel() == 0
    t = torch.zeros(2)
    assert Exec(t).scratch is None  # a call without a pool gets torch.empty
    dev = Exec(t, sc)
    assert dev.empty("acc", (7,), torch.float32, t.device).data_ptr() == big.data_ptr()
