"""Property tests (Hypothesis) of `_tagc`'s argument checks.

For random sizes, capacities, parameters, dtypes and layouts, each call must
succeed exactly when the documented preconditions (docs/module-api.md) hold,
raise ValueError/TypeError otherwise, and never write anything when it raises.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_tagc = pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = pytest.mark.codec

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

small = st.integers(min_value=0, max_value=70)
maybe_neg = st.integers(min_value=-3, max_value=70)
FLOATS = [torch.float32, torch.bfloat16]
ANY_DTYPE = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8,
             torch.int8, torch.int32, torch.int64]


def filled(n: int, dtype: torch.dtype, value: float = 3) -> torch.Tensor:
    """A tensor whose every element is `value`, to detect writes."""
    return torch.full((n,), value, dtype=dtype)


def untouched(*ts: torch.Tensor) -> bool:
    """Every element still holds the fill value of `filled`."""
    return all(bool((t == 3).all()) for t in ts)


def expect(ok: bool, call, *outputs: torch.Tensor) -> None:
    """call() succeeds iff ok; when it raises, it raises ValueError and writes nothing."""
    if ok:
        call()
    else:
        with pytest.raises(ValueError):
            call()
        assert untouched(*outputs)


@SETTINGS
@given(n=small, k=maybe_neg, di=small, dv=small, db=small, res=st.sampled_from(["none", "ok", "bad"]),
       gd=st.sampled_from(FLOATS), vd=st.sampled_from(FLOATS), rd=st.sampled_from(FLOATS))
def test_sparsify_checks(n, k, di, dv, db, res, gd, vd, rd):
    grad = torch.randn(n).to(gd)
    idx, val, bm = filled(di, torch.int32), filled(dv, vd), filled(db, torch.uint8)
    r = None if res == "none" else filled(n if res == "ok" else n + 1, rd)
    ok = 0 <= k <= n and di >= k and dv >= k and db >= math.ceil(n / 8) and res != "bad"
    outs = (idx, val, bm) + (() if r is None else (r,))
    expect(ok, lambda: _tagc.sparsify(idx, val, bm, r, grad, k), *outs)


@SETTINGS
@given(n=maybe_neg, bits=st.integers(min_value=-1, max_value=9), dl=small, db=small,
       unpack=st.booleans())
def test_lanes_checks(n, bits, dl, db, unpack):
    lanes, bm = filled(dl, torch.uint8), filled(db, torch.uint8)
    ok = (bits in (1, 2, 4, 8) and n >= 0 and db >= math.ceil(n / 8)
          and dl >= math.ceil(n * bits / 8))
    if unpack:
        expect(ok, lambda: _tagc.lanes_unpack(bm, lanes, n, bits), bm)
    else:
        expect(ok, lambda: _tagc.lanes_pack(lanes, bm, n, bits), lanes)


@SETTINGS
@given(dst=small, src=small, count=maybe_neg)
def test_bitmap_or_checks(dst, src, count):
    d, s = filled(dst, torch.uint8), filled(src, torch.uint8)
    ok = count >= 1 and src % count == 0 and dst >= src // count
    expect(ok, lambda: _tagc.bitmap_or(d, s, count), d)


@SETTINGS
@given(sk=small, k=small, dv=small, n=maybe_neg, t=st.integers(min_value=-1, max_value=30),
       seed=st.integers(min_value=-2, max_value=2**64), hi=st.integers(min_value=0, max_value=80),
       sd=st.sampled_from(FLOATS), vd=st.sampled_from(FLOATS))
def test_sketch_encode_checks(sk, k, dv, n, t, seed, hi, sd, vd):
    idx = torch.randint(-1, hi + 1, (k,), dtype=torch.int32) if k else torch.zeros(0, dtype=torch.int32)
    s = filled(sk, sd)
    val = filled(dv, vd)
    in_range = bool(((idx >= 0) & (idx < max(n, 0))).all())
    ok = (n >= 0 and 1 <= t and 0 <= seed < 2**64 and dv == k and sk >= 3 * t and in_range)
    expect(ok, lambda: _tagc.sketch_encode(s, idx, val, n, t, seed), s)


@SETTINGS
@given(do=small, sk=small, db=small, n=maybe_neg, t=st.integers(min_value=-1, max_value=30),
       du=st.one_of(st.none(), small), sd=st.sampled_from(FLOATS), est=st.booleans(),
       data=st.data())
def test_peel_decode_checks(do, sk, db, n, t, du, sd, est, data):
    out = filled(do, torch.float32)
    s = torch.randn(sk).to(sd)
    bm = torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=db, max_size=db)),
                      dtype=torch.uint8)
    unp = None if du is None else filled(du, torch.int32)
    ok = n >= 0 and t >= 1 and do >= n and sk >= 3 * t and db >= math.ceil(n / 8)
    if not ok:
        expect(False, lambda: _tagc.peel_decode(out, s, bm, n, t, 1, unpeeled=unp, estimate=est),
               out, *(() if unp is None else (unp,)))
        return
    left = _tagc.peel_decode(out, s, bm, n, t, 1, unpeeled=unp, estimate=est)
    union = int(np.unpackbits(bm.numpy(), bitorder="little")[:n].sum())
    assert 0 <= left <= union
    assert (out[n:] == 3).all()
    if unp is not None:
        w = min(left, du)
        assert ((unp[:w] >= 0) & (unp[:w] < n)).all() and (unp[w:] == 3).all()


@SETTINGS
@given(n=small, k=maybe_neg, extra=st.integers(min_value=-2, max_value=2),
       vd=st.sampled_from(FLOATS), data=st.data())
def test_sparse_unpack_checks(n, k, extra, vd, data):
    es = 4 if vd == torch.float32 else 2
    kk = max(k, 0)
    offs = data.draw(st.lists(st.integers(-2, n + 2), min_size=kk, max_size=kk))
    buf = torch.zeros(kk * (4 + es), dtype=torch.uint8)
    if kk:
        _tagc.sparse_pack(buf, torch.tensor(offs, dtype=torch.int32), torch.ones(kk, dtype=vd))
    if extra > 0:
        buf = torch.cat([buf, torch.zeros(extra, dtype=torch.uint8)])
    elif extra < 0 and buf.numel() >= -extra:
        buf = buf[: buf.numel() + extra]
    out = filled(n, torch.float32)
    ok = k >= 0 and buf.numel() == k * (4 + es) and all(0 <= o < n for o in offs)
    expect(ok, lambda: _tagc.sparse_unpack(out, buf, k, vd), out)


@SETTINGS
@given(segs=st.lists(st.integers(-2, 40), max_size=6), extra_n=st.integers(-1, 1),
       extra_b=st.integers(-1, 1), fmt=st.sampled_from(["int8", "int4", "sign", "ternary"]),
       block=st.integers(-1, 9), dtype=st.sampled_from(FLOATS), as_tensor=st.booleans(),
       decode=st.booleans())
def test_wq_checks(segs, extra_n, extra_b, fmt, block, dtype, as_tensor, decode):
    """wq_encode / wq_decode: valid segments summing to the data's numel, an
    int8/int4 format, block >= 1 and a buf of exactly wq_bytes."""
    valid_table = all(v >= 0 for v in segs)
    valid_fmt = fmt in ("int8", "int4") and block >= 1
    n = max(sum(v for v in segs if v > 0) + extra_n, 0)
    size = _tagc.wq_bytes(segs, fmt, block) if valid_table and valid_fmt else 16
    buf = filled(max(size + extra_b, 0), torch.uint8)
    table = torch.tensor(segs, dtype=torch.int64) if as_tensor else segs
    ok = (valid_table and valid_fmt and n == sum(segs) and buf.numel() == size)
    if decode:
        if ok:  # a valid message to decode
            _tagc.wq_encode(buf, torch.randn(n).to(dtype), table, fmt, block)
        out = filled(n, dtype)
        expect(ok, lambda: _tagc.wq_decode(out, buf, table, fmt, block), out)
    else:
        expect(ok, lambda: _tagc.wq_encode(buf, torch.randn(n).to(dtype), table, fmt, block),
               buf)


@SETTINGS
@given(xd=st.sampled_from(ANY_DTYPE), idd=st.sampled_from(ANY_DTYPE), bd=st.sampled_from(ANY_DTYPE))
def test_dtype_checks(xd, idd, bd):
    """Wrong dtypes raise TypeError naming the argument, and nothing is written."""
    grad = torch.ones(16, dtype=xd)
    idx, bm = torch.full((4,), 3, dtype=idd), torch.full((2,), 3, dtype=bd)
    val = filled(4, torch.float32)
    bad = [name for name, d, allowed in (("idx", idd, [torch.int32]), ("bitmap", bd, [torch.uint8]),
                                          ("grad", xd, FLOATS)) if d not in allowed]
    if not bad:
        _tagc.sparsify(idx, val, bm, None, grad, 4)
        return
    with pytest.raises(TypeError, match="'%s'" % bad[0]):
        _tagc.sparsify(idx, val, bm, None, grad, 4)
    assert (val == 3).all() and (idx == 3).all()


@SETTINGS
@given(rows=st.integers(1, 6), cols=st.integers(1, 6), step=st.integers(1, 3),
       transpose=st.booleans(), offset=st.integers(0, 2))
def test_layout_checks(rows, cols, step, transpose, offset):
    """Views: contiguous ones (any storage offset) work, strided ones raise TypeError."""
    base = torch.arange(rows * cols * step + offset, dtype=torch.float32)
    x = base[offset:offset + rows * cols * step].view(rows, cols * step)[:, ::step]
    if transpose:
        x = x.t()
    if x.is_contiguous():
        assert _tagc.select_kth(x, 1) == x.abs().max().item()
    else:
        with pytest.raises(TypeError, match="contiguous"):
            _tagc.select_kth(x, 1)


@SETTINGS
@given(v=st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=False), st.booleans(),
                   st.text(max_size=3), st.none()))
def test_scalar_checks(v):
    """Seeds: ints in [0, 2**64) only; anything else is a TypeError/ValueError."""
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64:
        assert 0 <= _tagc.seed_derive(v, 0, 0) < 2**64
    elif isinstance(v, int) and not isinstance(v, bool):
        with pytest.raises(ValueError, match="'seed'"):
            _tagc.seed_derive(v, 0, 0)
    else:
        with pytest.raises(TypeError, match="'seed'"):
            _tagc.seed_derive(v, 0, 0)


def test_every_function_has_a_text_signature() -> None:
    """inspect.signature works on every function of _tagc (the "--" docstrings)."""
    import inspect

    funcs = [getattr(_tagc, n) for n in dir(_tagc)
             if not n.startswith("_") and callable(getattr(_tagc, n))
             and not isinstance(getattr(_tagc, n), type)]
    assert len(funcs) >= 19
    for fn in funcs:
        params = inspect.signature(fn).parameters  # raises ValueError without one
        assert fn.__doc__ and not fn.__doc__.startswith(fn.__name__ + "(")
        if "stream" in params:
            assert params["stream"].kind is inspect.Parameter.KEYWORD_ONLY


def test_size_rules_match_the_layouts() -> None:
    """The exported size rules, against the layouts they describe."""
    for n in (0, 1, 7, 8, 9, 1001):
        assert _tagc.bitmap_bytes(n) == (n + 7) // 8
        for bits in (1, 2, 4, 8):
            assert _tagc.lanes_bytes(n, bits) == (n * bits + 7) // 8
    assert _tagc.sketch_buckets(7) == 3 * 7 == 3 * _tagc.TABLES * 7 // 3
    assert _tagc.sparse_bytes(5, torch.float32) == 40
    assert _tagc.sparse_bytes(5, torch.bfloat16) == 30
    assert _tagc.wq_bytes([5, 0, 3], "int8", 4) == (4 + 4) + (4 + 1) + (4 + 3)
    assert _tagc.wq_bytes([5, 0, 3], "int4", 4) == (4 + 2) + (4 + 1) + (4 + 2)
    for bad in (lambda: _tagc.bitmap_bytes(-1), lambda: _tagc.lanes_bytes(8, 3),
                lambda: _tagc.sketch_buckets(0), lambda: _tagc.sparse_bytes(-1, torch.float32),
                lambda: _tagc.sparse_bytes(1, torch.float16),
                lambda: _tagc.wq_bytes([-1], "int8", 4), lambda: _tagc.wq_bytes([1], "int8", 0),
                lambda: _tagc.wq_bytes([1], "sign", 4)):
        with pytest.raises((ValueError, TypeError)):
            bad()
