"""The contraction each quant format guarantees, as a property of the real codec.

EF21's argument needs ``||C(x) - x||^2 <= (1 - alpha) ||x||^2`` on every block ``x``
the codec codes, with ``alpha > 0`` fixed (docs/DESIGN.md section 5, "When feedback
drifts", derives the bounds).  For a block of ``n`` values:

* int8: ``alpha >= 4*127^2 / (4*127^2 + n - 1)`` (0.996 at n = 256);
* int4: ``alpha >= 196 / (195 + n)`` (0.43 at n = 256);
* ternary: ``alpha >= 1/n`` (a lone outlier: ``5/n - 6.25/n^2``);
* sign: ``alpha = (sum |x|)^2 / (n ||x||^2) >= 1/n``.

Hypothesis draws adversarial shards (one outlier, all equal, zeros, subnormals, geometric
ladders, mixed signs, normal blocks with outliers, partial last blocks, bf16 input) and
the test codes each through ``_tagc.quant_encode`` / ``quant_decode_add`` and checks the
bound block by block.  Slack: fp32 rounding of ``q * s`` (relative 1e-6 of ``||x||^2``)
and the one documented exception, a block whose scale would be subnormal, which is
sent as zero: its energy is below ``n^3 (127 FLT_MIN)^2`` (about 1e-69), the absolute
slack.
"""
from __future__ import annotations

import math
from typing import List

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_tagc = pytest.importorskip("_tagc")

FORMATS = ("int8", "int4", "ternary", "sign")
FLT_MIN = float(np.finfo(np.float32).tiny)
FLT_MAX = float(np.finfo(np.float32).max)


def alpha_bound(fmt: str, n: int) -> float:
    """The documented worst-case contraction of a block of ``n`` values."""
    if fmt == "int8":
        return 4 * 127 ** 2 / (4 * 127 ** 2 + n - 1)
    if fmt == "int4":
        return 196 / (195 + n)
    return 1.0 / n  # ternary, sign


def coded(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """C(x) through the codec: encode with no feedback, decode into zeros (fp32)."""
    buf = torch.empty(_tagc.quant_bytes(x.numel(), fmt, block), dtype=torch.uint8)
    _tagc.quant_encode(buf, None, x, fmt, block)
    out = torch.zeros(x.numel(), dtype=torch.float32)
    _tagc.quant_decode_add(out, buf, fmt, block)
    return out


def check_blocks(x: torch.Tensor, fmt: str, block: int) -> List[float]:
    """Assert the bound on every block of ``x``; returns each block's alpha."""
    c = coded(x, fmt, block).double().numpy()
    v = x.float().double().numpy()
    alphas = []
    for o in range(0, v.size, block):
        xb, cb = v[o:o + block], c[o:o + block]
        n = xb.size
        energy = float(np.dot(xb, xb))
        err = float(np.dot(cb - xb, cb - xb))
        slack = 1e-6 * energy + n ** 3 * (127 * FLT_MIN) ** 2
        assert err <= (1 - alpha_bound(fmt, n)) * energy + slack, \
            (fmt, block, o, n, err, energy, alpha_bound(fmt, n))
        if energy > 0:
            alphas.append(1 - err / energy)
    return alphas


# --------------------------------------------------------------------------- shards
magnitudes = st.floats(min_value=float(np.float32(1e-30)), max_value=float(np.float32(1e30)),
                       allow_nan=False, allow_infinity=False, width=32)


@st.composite
def shards(draw: st.DrawFn) -> np.ndarray:
    """One adversarial shard (1..700 fp32 values)."""
    n = draw(st.integers(1, 700))
    kind = draw(st.sampled_from(["outlier", "equal", "zeros", "subnormal", "ladder",
                                 "normal_outliers", "any", "huge"]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    if kind == "outlier":  # one value M among values at most M * ratio
        ratio = draw(st.floats(0.0, 1.0))
        x = rng.random(n) * ratio * sign
        x[draw(st.integers(0, n - 1))] = draw(magnitudes) * draw(st.sampled_from([-1, 1]))
    elif kind == "equal":
        x = np.full(n, draw(magnitudes)) * (sign if draw(st.booleans()) else 1.0)
    elif kind == "zeros":
        x = np.zeros(n)
    elif kind == "subnormal":
        x = rng.integers(0, 2 ** 23, n) * float(np.float32(2.0 ** -149)) * sign
    elif kind == "ladder":  # geometric: every value a fixed factor below the previous
        q = draw(st.floats(0.05, 0.999))
        x = draw(magnitudes) * q ** np.arange(n) * sign
    elif kind == "normal_outliers":
        x = rng.standard_normal(n)
        k = draw(st.integers(0, min(n, 8)))
        x[rng.choice(n, k, replace=False)] *= draw(st.floats(1.0, 1e4))
    elif kind == "huge":  # near FLT_MAX: the scale is nudged so q * s stays finite
        x = rng.random(n) * FLT_MAX * sign
    else:
        x = np.array(draw(st.lists(st.floats(float(np.float32(-1e30)), float(np.float32(1e30)),
                                             allow_nan=False, width=32),
                                   min_size=n, max_size=n)))
    return np.clip(x, -FLT_MAX, FLT_MAX).astype(np.float32)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(x=shards(), fmt=st.sampled_from(FORMATS), block=st.sampled_from([1, 2, 7, 64, 256]))
def test_every_block_contracts_by_its_documented_alpha(x: np.ndarray, fmt: str,
                                                        block: int) -> None:
    check_blocks(torch.from_numpy(x), fmt, block)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(x=shards(), fmt=st.sampled_from(FORMATS))
def test_bf16_gradients_contract_too(x: np.ndarray, fmt: str) -> None:
    g = torch.from_numpy(x).clamp(-3e38, 3e38).to(torch.bfloat16)
    if not bool(torch.isfinite(g).all()):  # fp32 values near FLT_MAX round to bf16 inf
        return
    check_blocks(g, fmt, 256)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_bounds_are_tight_where_documented(fmt: str) -> None:
    """A lone outlier among zeros: int4/int8 send it exactly (alpha 1); ternary keeps
    s = 2.5 M / n and reaches its documented 5/n - 6.25/n^2; sign reaches 1/n."""
    n = 256
    x = torch.zeros(n)
    x[17] = 3.0
    (a,) = check_blocks(x, fmt, n)
    want = {"int8": 1.0, "int4": 1.0, "ternary": 5 / n - 6.25 / n ** 2, "sign": 1 / n}[fmt]
    assert a == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_alpha_bounds_at_the_default_block() -> None:
    """The figures docs/DESIGN.md quotes for n = 256."""
    assert math.isclose(alpha_bound("int4", 256), 0.4346, abs_tol=1e-4)
    assert math.isclose(alpha_bound("int8", 256), 0.9960, abs_tol=1e-4)
    assert alpha_bound("ternary", 256) == alpha_bound("sign", 256) == 1 / 256
