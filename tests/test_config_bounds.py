"""Block codes that do not pay are refused or warned about, by the codec's own sizes.

Every (format, block) pair a TAGCConfig accepts, for each knob pair that puts a block
code to use (``quant_format``/``quant_block``, ``hsdp_out_format``/``quant_block``,
``residual_code``/``quant_block``, ``gather``/``gather_block``), is classified here by
``_tagc.quant_bytes`` / ``_tagc.wq_bytes`` over a long shard of full blocks:
at least 32 bits per value (fp32's) is a ValueError, at least 16 (bf16's) a warning
once per process, less is accepted silently.  Every shipped preset is accepted
without a warning.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List

import pytest
import torch

import tagc.config
from tagc import presets
from tagc.codec import OWN_PERIOD
from tagc.config import GATHER_FORMATS, QUANT_FORMATS, RESIDUAL_CODES, TAGCConfig

pytestmark = pytest.mark.codec
_tagc = pytest.importorskip("_tagc")

# every block up to 64 (where the bounds fall) and the powers of two up to the maximum
BLOCKS = sorted(set(range(1, 65)) | {2 ** k for k in range(17)})
# blocks per shard in the reference sizes: many full blocks, as a real unit has
SHARD_BLOCKS = 64


def _bits(fmt: str, block: int, gather: bool = False) -> float:
    """Bits per value of a shard of SHARD_BLOCKS full blocks, by the codec's size rule
    (a format with blocks of its own, tls: SHARD_BLOCKS of its periods, any block)."""
    if fmt in OWN_PERIOD:
        n = SHARD_BLOCKS * OWN_PERIOD[fmt]
        return 8.0 * _tagc.tls_bytes(n) / n
    n = SHARD_BLOCKS * block
    if gather:
        nbytes = _tagc.wq_bytes(torch.tensor([n], dtype=torch.int64), fmt, block)
    else:
        nbytes = _tagc.quant_bytes(n, fmt, block)
    return 8.0 * nbytes / n


def _expected(bits: float) -> str:
    return "refuse" if bits >= 32 else "warn" if bits >= 16 else "accept"


def _outcome(kw: Dict[str, Any]) -> str:
    """What TAGCConfig(**kw) does, as the first config of a process: ``refuse``,
    ``warn`` (exactly one warning) or ``accept`` (no warning)."""
    tagc.config._WARNED_CODES.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            TAGCConfig(**kw)
        except ValueError as exc:
            assert "bits per value" in str(exc), f"{kw}: refused for another reason: {exc}"
            return "refuse"
    mine = [w for w in caught if "bits per value" in str(w.message)]
    assert len(mine) <= 1, f"{kw}: {len(mine)} warnings: {[str(w.message) for w in mine]}"
    return "warn" if mine else "accept"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees every warning again (they come once per process)."""
    monkeypatch.setattr(tagc.config, "_WARNED_CODES", set())


def _walk(cases: List[Dict[str, Any]], bits: List[float]) -> None:
    wrong = [(kw, round(b, 3), _expected(b), got) for kw, b in zip(cases, bits)
             if (got := _outcome(kw)) != _expected(b)]
    assert not wrong, f"(config, bits per value, expected, got): {wrong[:10]}"


def test_the_walk_meets_all_three_outcomes() -> None:
    """The bounds fall inside the blocks walked (else the walks below prove little)."""
    seen = {_expected(_bits(f, b)) for f in QUANT_FORMATS for b in BLOCKS}
    assert seen == {"refuse", "warn", "accept"}


def test_quant_format_and_block() -> None:
    """Gradient codes (owners on the same code, no residual code): each pair by its bits."""
    cases = [dict(mode="quant", quant_format=f, hsdp_out_format=f, quant_block=b,
                  error_feedback=False) for f in QUANT_FORMATS for b in BLOCKS]
    _walk(cases, [_bits(c["quant_format"], c["quant_block"]) for c in cases])


def test_hsdp_out_format_and_block() -> None:
    """Two-phase HSDP's owner code on quant_block: the worse of it and the gradient
    code decides (``auto`` resolves to int4 after sign/ternary)."""
    cases = [dict(mode="quant", quant_format=f, hsdp_out_format=o, quant_block=b,
                  error_feedback=False)
             for f in QUANT_FORMATS for o in ("auto",) + QUANT_FORMATS for b in BLOCKS]
    bits = [max(_bits(c["quant_format"], c["quant_block"]),
                _bits(TAGCConfig(mode="quant", quant_format=c["quant_format"],
                                 hsdp_out_format=c["hsdp_out_format"]).out_format(),
                      c["quant_block"])) for c in cases]
    _walk(cases, bits)


def test_residual_code_and_block() -> None:
    """The residual's codes (memory, against an fp32 residual's 32 bits), in a top-k
    mode where quant_format is not in use."""
    cases = [dict(mode="sparse", residual_code=r, quant_block=b)
             for r in RESIDUAL_CODES if r != "none" for b in BLOCKS]
    _walk(cases, [_bits(c["residual_code"], c["quant_block"]) for c in cases])


def test_gather_and_block() -> None:
    """The parameter gather's uniform codes, sized by wq_bytes."""
    cases = [dict(mode="dense", gather=g, gather_block=b)
             for g in GATHER_FORMATS if g not in ("none", "fp4") for b in BLOCKS]
    _walk(cases, [_bits(c["gather"], c["gather_block"], gather=True) for c in cases])


def test_fp4_gather_takes_its_blocks_and_refuses_others() -> None:
    """fp4 gathers: every power of two from 2 to 256 (8 bits per value at 2, by
    fp4_bytes: accepted silently), any other block refused naming the rule."""
    for b in BLOCKS:
        kw = dict(mode="dense", gather="fp4", gather_block=b)
        if 2 <= b <= 256 and b & (b - 1) == 0:
            assert 8.0 * _tagc.fp4_bytes(SHARD_BLOCKS * b, b) / (SHARD_BLOCKS * b) <= 8
            assert _outcome(kw) == "accept", kw
        else:
            with pytest.raises(ValueError, match="power of two in \\[2, 256\\]"):
                TAGCConfig(**kw)


def test_knobs_not_in_use_are_not_checked() -> None:
    """Block 1 costs nothing where no code uses it: quant_format outside quant mode,
    a residual code without feedback, gather_block without a gather."""
    assert _outcome(dict(mode="sparse", residual_code="none", quant_block=1)) == "accept"
    assert _outcome(dict(mode="dense", quant_block=1)) == "accept"
    assert _outcome(dict(mode="quant", error_feedback=False, gather_block=1)) == "accept"
    assert _outcome(dict(mode="sparse", error_feedback=False, residual_code="int8",
                         quant_block=1)) == "accept"


@pytest.mark.parametrize("fmt", [f for f in QUANT_FORMATS if f not in OWN_PERIOD])
def test_the_refusal_names_the_bound_and_the_smallest_good_block(fmt: str) -> None:
    """quant_block=1 (40 bits everywhere) is refused; the message gives 32 and the
    smallest block whose codes take fewer than 16 bits."""
    with pytest.raises(ValueError) as exc:
        TAGCConfig(mode="quant", quant_format=fmt, hsdp_out_format=fmt, quant_block=1,
                   error_feedback=False)
    smallest = next(b for b in BLOCKS if _bits(fmt, b) < 16)
    assert _bits(fmt, smallest - 1) >= 16
    msg = str(exc.value)
    assert "quant_format" in msg and "32" in msg and "40 bits" in msg, msg
    assert f"quant_block >= {smallest} " in msg, msg
    # the value it names is accepted silently
    assert _outcome(dict(mode="quant", quant_format=fmt, hsdp_out_format=fmt,
                         quant_block=smallest, error_feedback=False)) == "accept"


def test_the_suggestion_covers_every_code_on_the_block() -> None:
    """sign codes pass at block 3, int8 owners need 5: the message asks for 5."""
    with pytest.raises(ValueError, match="quant_block >= 5 "):
        TAGCConfig(mode="quant", quant_format="sign", hsdp_out_format="int8", quant_block=1,
                   error_feedback=False)


def test_a_warning_comes_once_per_process() -> None:
    kw = dict(mode="quant", quant_format="int8", hsdp_out_format="int8", quant_block=4,
              error_feedback=False)
    with pytest.warns(UserWarning, match=r"quant_block=4: int8 codes take 16 bits.*>= 5"):
        TAGCConfig(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TAGCConfig(**kw)
        # the same code through replace (a changed unrelated knob) stays quiet too
        TAGCConfig(**kw).replace(seed=1)
    # another block is another warning
    with pytest.warns(UserWarning, match="quant_block=3"):
        TAGCConfig(**{**kw, "quant_block": 3})


def test_dataclass_replace_is_checked() -> None:
    """The route of a hand-edited config: dataclasses.replace runs the validation."""
    import dataclasses

    with pytest.raises(ValueError, match="quant_block=1"):
        dataclasses.replace(TAGCConfig(), quant_block=1)
    with pytest.warns(UserWarning, match="quant_block=3"):
        dataclasses.replace(TAGCConfig(), quant_block=3)


def test_every_shipped_preset_passes_silently() -> None:
    """No shipped TAGCConfig preset is refused or warned about (the pipeline presets
    are PipelineConfig, the train-* ones run configs)."""
    names = [n for n in presets.names()
             if n.startswith("tagc-") and not n.startswith(presets.PIPELINE_PREFIX)]
    assert len(names) >= 10 and "tagc-balanced" in names and "tagc-full" in names
    used = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in names:
            cfg = TAGCConfig.preset(name)
            used |= {u[0] for u in tagc.config.coded_pairs(cfg)}
    # the presets exercise every checked knob, so passing here means something
    assert used == {"quant_format", "hsdp_out_format", "residual_code", "gather"}, used


def test_tls_takes_no_block() -> None:
    """tls codes have blocks of their own: quant_block 1 costs it nothing (the owners'
    int4 code after it is what a small block refuses)."""
    assert _outcome(dict(mode="quant", quant_format="tls", hsdp_out_format="tls",
                         quant_block=1, error_feedback=False)) == "accept"
    with pytest.raises(ValueError, match="hsdp_out_format"):
        TAGCConfig(mode="quant", quant_format="tls", quant_block=1, error_feedback=False)
