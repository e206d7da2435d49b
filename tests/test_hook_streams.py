"""CPU tests of the sync-free pieces of the hook's CUDA path (issue 6, item 3).

No GPU here: the CUDA branches of ``tagc_hook`` only run on a GPU
(tests/test_cuda_hook.py), but the pure tensor logic they are built from is
device-agnostic and is checked here on CPU tensors: the flag gate, the
non-finite poisoning, device-counter accumulation read only by stats(), and
the collective wrapper's CPU behaviour.
"""
from __future__ import annotations

import math

import pytest
import torch

tagc = pytest.importorskip("tagc_hook")


def test_gate_selects_without_leaking_nonfinite() -> None:
    v = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    torch.testing.assert_close(tagc._gate(v, torch.tensor([True])), v, equal_nan=True)
    # A product v * ok would turn NaN/Inf into NaN; where() gives exact zeros.
    got = tagc._gate(v, torch.tensor([False]))
    assert torch.equal(got, torch.zeros(4))
    per_elem = tagc._gate(v, torch.tensor([True, False, False, True]))
    assert torch.equal(per_elem, torch.tensor([1.0, 0.0, 0.0, -2.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_poison_nonfinite(dtype: torch.dtype) -> None:
    g = torch.randn(3, 5).to(dtype)
    before = g.clone()
    tagc._poison_nonfinite(g, torch.tensor([False]))
    assert torch.equal(g, before)  # flag clear: bit-identical
    tagc._poison_nonfinite(g, torch.tensor([True]))
    assert torch.isnan(g[:, 0]).all()  # every shard now fails sparsify's finiteness check
    assert torch.equal(g[:, 1:], before[:, 1:])  # nothing else touched


def test_poison_makes_every_shard_nonfinite_for_the_codec() -> None:
    # The CUDA sparsify treats a shard like the C op's NONFINITE case; on CPU
    # the C op raises, which shows each poisoned shard is non-finite to it.
    _tagc = pytest.importorskip("_tagc")
    n, s, k = 3, 64, 4
    g = torch.randn(n, s)
    tagc._poison_nonfinite(g, torch.tensor([True]))
    res = torch.zeros(s)
    for r in range(n):
        with pytest.raises(_tagc.NonFiniteError):
            _tagc.sparsify(torch.empty(k, dtype=torch.int32), torch.empty(k),
                           torch.empty((s + 7) // 8, dtype=torch.uint8), res, g[r], k)
    assert torch.equal(res, torch.zeros(s))


def _unit() -> "tagc._Unit":
    state = tagc.TAGCState(tagc.TAGCConfig(), "fsdp2")
    return tagc._Unit(state, "u", 0, 100, 100, 100, True, None, 1.0, 1.0, torch.device("cpu"))


def test_device_counters_accumulate_gated_and_read_in_stats() -> None:
    u = _unit()
    u.add("shard_slots", 10)  # host numbers go straight to the host counters
    u.add("union_size", torch.tensor([3], dtype=torch.int64))
    u.ok = torch.tensor([False])  # a non-finite call: its device counts are dropped
    u.add("union_size", torch.tensor([100], dtype=torch.int64))
    u.add("collision_dropped_l1", torch.tensor(float("nan")))
    u.ok = torch.tensor([True])
    u.add("union_size", torch.tensor([4], dtype=torch.int64))
    u.add("collision_dropped_l1", torch.tensor(0.25, dtype=torch.float64))
    u.ok = None
    st = u.stats()
    assert st["union_size"] == 7 and isinstance(st["union_size"], int)
    assert st["shard_slots"] == 10
    assert st["density"] == pytest.approx(0.7)
    assert st["collision_dropped_l1"] == pytest.approx(0.25)
    assert not math.isnan(st["collision_dropped_l1"])
    u.reset_stats()
    assert u.stats()["union_size"] == 0


def test_nonfinite_flag_counts_on_device() -> None:
    # The CUDA branch of _run_body: fallbacks += bad, compressed_calls += ok.
    u = _unit()
    for bad in (False, True, False):
        b = torch.tensor([bad])
        u.add("nonfinite_fallbacks", b)
        u.ok = ~b
        u.add("compressed_calls", u.ok)
        u.ok = None
    st = u.stats()
    assert (st["compressed_calls"], st["nonfinite_fallbacks"]) == (2, 1)


def test_issue_on_cpu_passes_async_op_through() -> None:
    seen = []

    def fake(*args, async_op: bool, **kw):  # type: ignore[no-untyped-def]
        seen.append((args, async_op, kw))
        return "work" if async_op else None

    assert tagc._issue(False, True, fake, 1, group=None) == "work"
    assert tagc._issue(False, False, fake, 2) is None
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

    assert tagc._issue(True, False, fake) is None and waited == [True]
    assert isinstance(tagc._issue(True, True, fake), Work) and waited == [True]
