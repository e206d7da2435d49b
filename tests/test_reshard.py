"""Feedback state across cluster shapes (tagc/positions.py, tagc/checkpoint.py ``remap``):
exact on small tensors against a plain placement written here.

A unit of ``weight`` (5 x 3) and ``bias`` (5,) is laid out as FSDP1 flattens it (weight,
bias, zeros up to N shards) and as FSDP2 cuts it (N rows, each parameter's dim 0 padded
to a multiple of N; FSDP2 registers the weight first), for N in 1, 2, 4, and under TAGC's
two-phase HSDP.  A residual written in one layout and mapped onto another must owe the
averaged gradient exactly what it owed before: each new rank holds the mean of the old
ranks' residuals (same reduction weight), placed where the new layout puts each element.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import pytest
import torch

pytest.importorskip("_tagc")

from tagc import checkpoint, positions  # noqa: E402
from tagc.config import TAGCConfig  # noqa: E402
from tagc.device import CodecStreams  # noqa: E402
from tagc.hsdp import TwoPhaseReducer  # noqa: E402
from tagc.reducer import UnitReducer  # noqa: E402
from tagc.selection import UnitSpec  # noqa: E402

pytestmark = pytest.mark.codec

SHAPES = {"u.weight": (5, 3), "u.bias": (5,)}
NUMEL = 20


def canon_order() -> List[str]:
    return sorted(SHAPES)


def fsdp1_layout(world: int) -> Dict:
    length = math.ceil(NUMEL / world) * world
    return {"form": "flat", "world": world, "length": length,
            "segments": [["u.weight", 15], ["u.bias", 5]]}


def fsdp2_layout(world: int) -> Dict:
    rows = math.ceil(5 / world)
    return {"form": "rows", "world": world,
            "params": [["u.weight", 5, 3, rows], ["u.bias", 5, 1, rows]]}


def place(layout: Dict, values: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The flat buffer of ``layout`` holding ``values`` (by name), zeros as padding:
    written from FSDP's rules directly, not through positions.py."""
    if layout["form"] == "flat":
        parts = [values[n].reshape(-1) for n, _ in layout["segments"]]
        flat = torch.cat(parts)
        return torch.cat([flat, torch.zeros(layout["length"] - flat.numel())])
    world, out = layout["world"], []
    for r in range(world):
        for name, dim0, width, rows in layout["params"]:
            t = values[name].reshape(dim0, width)
            padded = torch.zeros(rows * world, width)
            padded[:dim0] = t
            out.append(padded[r * rows:(r + 1) * rows].reshape(-1))
    return torch.cat(out)


def reducer(cfg: TAGCConfig, layout: Dict, world: int, rank: int) -> UnitReducer:
    flat = len(positions.canonical_index(layout))
    spec = UnitSpec("u", 0, NUMEL, flat, NUMEL, torch.device("cpu"))
    u = UnitReducer(cfg, spec, None, rank, world, 1.0, float(world), CodecStreams())
    u.layout = layout
    return u


def random_values(seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def saved_record(units: List[UnitReducer], kind: str, world: int) -> Dict:
    return {"layout": checkpoint.layout_record(units, kind, world),
            "units": {"u": {"step": 7, "has_residual": True}}}


CFG = TAGCConfig(residual_code="none", min_numel=1)


@pytest.mark.parametrize("src,dst", [
    (("fsdp1", 2), ("fsdp2", 2)), (("fsdp2", 2), ("fsdp1", 2)),
    (("fsdp2", 2), ("fsdp2", 1)), (("fsdp2", 1), ("fsdp2", 2)),
    (("fsdp2", 4), ("fsdp2", 2)), (("fsdp1", 4), ("fsdp2", 1)),
])
def test_residual_keeps_the_mean_across_fsdp_versions_and_world_sizes(src, dst) -> None:
    make = {"fsdp1": fsdp1_layout, "fsdp2": fsdp2_layout}
    (k0, n0), (k1, n1) = src, dst
    old_layout, new_layout = make[k0](n0), make[k1](n1)
    vals = [random_values(r) for r in range(n0)]
    held = torch.stack([place(old_layout, v) for v in vals])
    old_units = [reducer(CFG, old_layout, n0, 0)]
    saved = saved_record(old_units, k0, n0)
    mean = {n: (sum(v[n].double() for v in vals) / n0).float() for n in SHAPES}
    want = place(new_layout, mean)
    for r in range(n1):
        new = [reducer(CFG, new_layout, n1, r)]
        rows = checkpoint.remap(saved, {("u", "residual"): held}, new, CFG, k1, n1, r)
        assert torch.equal(rows["u", "residual"], want), (r, rows["u", "residual"], want)


def test_the_two_layouts_differ_where_a_bias_is() -> None:
    """The reason for all this: FSDP1 and FSDP2 put a unit's elements in other places."""
    a = positions.canonical_index(fsdp1_layout(2))
    b = positions.canonical_index(fsdp2_layout(2))
    assert (a.numel(), b.numel()) == (20, 24)  # FSDP2 pads dim 0 of both to 6 rows
    assert (a != b[:20]).sum() > 0
    for idx in (a, b):
        assert sorted(idx[idx >= 0].tolist()) == list(range(NUMEL))


def hsdp_reducer(cfg: TAGCConfig, replicas: int, shards: int, q: int, s: int
                 ) -> TwoPhaseReducer:
    layout = fsdp2_layout(shards)
    shard = len(positions.canonical_index(layout)) // shards
    chunk = math.ceil(shard / replicas)
    spec = UnitSpec("u", 0, NUMEL, replicas * chunk, NUMEL, torch.device("cpu"))
    u = TwoPhaseReducer(cfg, spec, None, q, replicas, CodecStreams(), shard)
    u.divide = float(replicas * shards)
    u.layout = layout
    u.grid = [[qq * shards + ss for ss in range(shards)] for qq in range(replicas)]
    return u


def test_hsdp_owner_residuals_fold_into_the_new_residual() -> None:
    """Two-phase HSDP, 2 replicas x 2 shards -> FSDP2 on 2 ranks: what both phases owe
    the average (to-the-owner residuals and the owners' ``residual_out``) is carried
    whole into the new residuals."""
    cfg = CFG
    old = [hsdp_reducer(cfg, 2, 2, q, s) for q in range(2) for s in range(2)]
    assert old[0].out_state == "residual_out"
    layout = fsdp2_layout(2)
    whole = positions.canonical_index(layout)
    shard_len = whole.numel() // 2
    chunk = math.ceil(shard_len / 2)
    g = torch.Generator().manual_seed(3)
    res = torch.randn(4, 2 * chunk, generator=g)
    out = torch.randn(4, chunk, generator=g)
    # what they owe the average, in the canonical order, written out by hand
    owed = torch.zeros(NUMEL, dtype=torch.float64)
    for grank in range(4):
        q, s = divmod(grank, 2)
        idx = torch.cat([whole[s * shard_len:(s + 1) * shard_len],
                         torch.full((2 * chunk - shard_len,), -1)])
        for buf, vals in ((idx, res[grank]), (idx[q * chunk:(q + 1) * chunk], out[grank])):
            keep = buf >= 0
            owed.index_add_(0, buf[keep], vals[keep].double() / 4)  # weight 1/(R*S)
    saved = {"layout": checkpoint.layout_record(old, "fsdp2-hsdp", 4),
             "units": {"u": {"step": 3, "has_residual": True, "has_residual_out": True}}}
    for r in range(2):
        new = [reducer(cfg, layout, 2, r)]
        rows = checkpoint.remap(saved, {("u", "residual"): res, ("u", "residual_out"): out},
                                new, cfg, "fsdp2", 2, r)
        # each of the 2 new ranks owes half, at weight 1/2: the owed sum itself
        per_rank = (owed * 2 / 2).float()
        off, _ = positions.canonical_offsets(layout)
        want = place(layout, {n: per_rank[off[n]:off[n] + math.prod(s)].reshape(s)
                              for n, s in SHAPES.items()})
        assert torch.allclose(rows["u", "residual"], want, atol=1e-6, rtol=0)


def test_coded_residual_maps_within_its_code() -> None:
    """int4 codes: decoded, mapped, coded again; the mean survives to the code's step."""
    cfg = TAGCConfig(residual_code="int4", quant_block=8, min_numel=1)
    old_layout, new_layout = fsdp1_layout(2), fsdp2_layout(1)
    from tagc import codec
    vals = [random_values(10 + r) for r in range(2)]
    held = []
    for v in vals:
        flat = place(old_layout, v).contiguous()
        codes = torch.zeros(codec._tagc.quant_bytes(flat.numel(), "int4", 8), dtype=torch.uint8)
        codec._tagc.quant_encode(codes, None, flat, "int4", 8)
        dec = torch.zeros_like(flat)
        codec._tagc.quant_decode_add(dec, codes, "int4", 8)
        held.append((codes, dec))
    old_units = [reducer(cfg, old_layout, 2, 0)]
    saved = saved_record(old_units, "fsdp1", 2)
    new = [reducer(cfg, new_layout, 1, 0)]
    rows = checkpoint.remap(saved, {("u", "residual"): torch.stack([c for c, _ in held])},
                            new, cfg, "fsdp2", 1, 0)
    got = torch.zeros(len(positions.canonical_index(new_layout)))
    codec._tagc.quant_decode_add(got, rows["u", "residual"], "int4", 8)
    # the decoded old rows' mean, placed in the new layout: what the codes approximate
    idx_old = positions.canonical_index(old_layout)
    mean = torch.zeros(NUMEL)
    for _, dec in held:
        mean[idx_old[idx_old >= 0]] += dec[idx_old >= 0] / 2
    idx_new = positions.canonical_index(new_layout)
    want = torch.zeros(idx_new.numel())
    want[idx_new >= 0] = mean[idx_new[idx_new >= 0]]
    step = want.abs().max() / 7  # one int4 step of the largest block
    assert (got - want).abs().max() <= step / 2 + 1e-6


def test_ef21_estimates_are_refused_on_another_shape() -> None:
    cfg = TAGCConfig(ef21=True, residual_code="none", min_numel=1)
    old = [reducer(cfg, fsdp2_layout(2), 2, 0)]
    saved = {"format": checkpoint.FORMAT, "kind": "fsdp2", "world_size": 2,
             "config": cfg.resolved_dict(),
             "units": {"u": {"has_residual": True, "has_estimate": True,
                             "numel": NUMEL, "flat_numel": old[0].flat_numel, "index": 0}},
             "layout": checkpoint.layout_record(old, "fsdp2", 2)}
    new = [reducer(cfg, fsdp2_layout(1), 1, 0)]
    with pytest.raises(ValueError, match="EF21"):
        checkpoint.check_saved(saved, new, cfg, "fsdp2", 1)
    assert checkpoint.check_saved(saved, old, cfg, "fsdp2", 2) is True


def test_a_preset_change_names_the_knob() -> None:
    cfg = TAGCConfig(residual_code="none", min_numel=1)
    units = [reducer(cfg, fsdp2_layout(2), 2, 0)]
    other = TAGCConfig(residual_code="int4", min_numel=1)
    saved = {"format": checkpoint.FORMAT, "kind": "fsdp2", "world_size": 2,
             "config": other.resolved_dict(), "units": {"u": {}},
             "layout": checkpoint.layout_record(units, "fsdp2", 2)}
    with pytest.raises(ValueError, match=r"residual_code: saved 'int4', now 'none'"):
        checkpoint.check_saved(saved, units, cfg, "fsdp2", 2)


def test_codes_of_another_codec_format_are_refused() -> None:
    cfg = TAGCConfig(residual_code="int4", min_numel=1)
    units = [reducer(cfg, fsdp2_layout(2), 2, 0)]
    layout = checkpoint.layout_record(units, "fsdp2", 2)
    saved = {"format": checkpoint.FORMAT, "kind": "fsdp2", "world_size": 2,
             "config": cfg.resolved_dict(), "units": {"u": {}}, "layout": layout}
    assert checkpoint.check_saved(saved, units, cfg, "fsdp2", 2) is True
    saved["layout"] = {**layout, "codec_format": layout["codec_format"] + 1}
    with pytest.raises(ValueError, match="codec format"):
        checkpoint.check_saved(saved, units, cfg, "fsdp2", 2)


def test_another_unit_layout_is_refused_naming_the_units() -> None:
    """Units wrapped otherwise (another --wrap, another model) cannot be mapped: the
    error names both unit lists; a unit holding other parameters is named too."""
    cfg = TAGCConfig(residual_code="none", min_numel=1)
    units = [reducer(cfg, fsdp2_layout(2), 2, 0)]
    layout = checkpoint.layout_record(units, "fsdp2", 2)
    saved = {"format": checkpoint.FORMAT, "kind": "fsdp2", "world_size": 2,
             "config": cfg.resolved_dict(), "units": {"v": {}}, "layout": layout}
    with pytest.raises(ValueError, match=r"unit layout differs: saved \['v'\], current \['u'\]"):
        checkpoint.check_saved(saved, units, cfg, "fsdp2", 2)
    other = {"form": "rows", "world": 2, "params": [["u.weight", 5, 4, 3]]}
    saved["units"] = {"u": {"has_residual": True}}
    saved["layout"] = checkpoint.layout_record([reducer(cfg, other, 2, 0)], "fsdp2", 2)
    with pytest.raises(ValueError, match="holds other parameters"):
        checkpoint.check_saved(saved, [reducer(cfg, fsdp2_layout(1), 1, 0)], cfg, "fsdp2", 1)
