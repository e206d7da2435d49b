"""TAGCConfig's knob groups: every knob documented once in its field's metadata, each
group validated by its own check, and docs/USAGE.md's knob reference generated from it."""

from __future__ import annotations

import dataclasses
import os
import textwrap

import pytest
import torch

import tagc.config as config
from tagc.config import GROUPS, TAGCConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USAGE = os.path.join(ROOT, "docs", "USAGE.md")
FIELDS = dataclasses.fields(TAGCConfig)


def test_every_knob_names_a_group_and_its_doc_fits_five_lines() -> None:
    """Each knob carries what it does, its values and its readers, in at most five lines
    of 88 columns (the docs' width), and every group holds at least one knob."""
    for f in FIELDS:
        m = f.metadata
        assert m.get("group") in config.CHECKS, f.name
        assert m["doc"] and m["values"] and m["reads"], f.name
        assert len(textwrap.wrap(m["doc"], 88)) <= 5, f.name
    assert {g for g, _, _ in GROUPS} == {f.metadata["group"] for f in FIELDS}
    assert list(config.CHECKS) == [g for g, _, _ in GROUPS]


def test_derived_knobs_are_those_whose_default_follows_others() -> None:
    """DERIVED comes from the metadata: the knobs to_dict() writes as None when not given."""
    assert set(config.DERIVED) == {"theta", "ratio", "ef21", "ef21_damping", "residual_code",
                                   "residual_factor"}
    d = TAGCConfig().to_dict()
    assert all(d[n] is None for n in config.DERIVED)
    assert all(f.default is None for f in FIELDS if f.name in config.DERIVED)


def test_help_and_describe_show_every_knob_under_its_group() -> None:
    """The class docstring (what help() prints) lists each knob once, under its group's
    title, with its default."""
    doc = TAGCConfig.__doc__
    assert doc is not None and TAGCConfig.describe() in doc
    titles = [doc.index(f"\n{title}: ") for _, title, _ in GROUPS]
    assert titles == sorted(titles)
    for f in FIELDS:
        at = [i for i, line in enumerate(doc.splitlines())
              if line.startswith(f"    {f.name} (default ")]
        assert len(at) == 1, f.name
        group = next(i for i, (g, _, _) in enumerate(GROUPS) if g == f.metadata["group"])
        assert titles[group] < doc.index(f"\n    {f.name} (default "), f.name
        assert group + 1 == len(titles) or doc.index(f"\n    {f.name} (default ") < \
            titles[group + 1], f.name
    assert "    quant_block (default 64;" in doc and "    mode (default 'quant';" in doc
    assert "    ef21 (default derived: False;" in doc


def test_usage_knob_reference_is_the_generated_one(tmp_path) -> None:
    """docs/USAGE.md holds describe(markdown=True) between its markers, and
    write_knobs_doc() restores it after an edit by hand."""
    assert config.write_knobs_doc(USAGE, check=True), \
        "docs/USAGE.md's knob reference differs from tagc/config.py: run " \
        "python -c 'import tagc.config as c; c.write_knobs_doc()'"
    with open(USAGE) as fh:
        text = fh.read()
    stale = tmp_path / "USAGE.md"
    stale.write_text(text.replace("`quant_block` (default 64;", "`quant_block` (default 512;"))
    assert not config.write_knobs_doc(str(stale), check=True)
    assert "default 512" in stale.read_text()  # check=True writes nothing
    assert not config.write_knobs_doc(str(stale))
    assert stale.read_text() == text
    (tmp_path / "none.md").write_text("# no markers\n")
    with pytest.raises(ValueError, match="needs the lines"):
        config.write_knobs_doc(str(tmp_path / "none.md"))


@pytest.mark.parametrize("group, kw, knob", [
    ("codec", dict(quant_block=0), "quant_block"),
    ("selection", dict(min_numel=-1), "min_numel"),
    ("feedback", dict(guard_ratio=-1.0), "guard_ratio"),
    ("schedule", dict(bypass_every=1), "bypass_every"),
    ("gather", dict(gather="int2"), "gather"),
    ("overlap", dict(hsdp_overlap=1), "hsdp_overlap"),
    ("hsdp", dict(hsdp_out_format="int2"), "hsdp_out_format"),
    ("local", dict(outer_lr=0.0), "outer_lr"),
])
def test_each_group_check_refuses_its_own_knobs(group, kw, knob) -> None:
    """A bad knob is refused by its group's check, the message naming the knob, and the
    same value passes every other group's check."""
    good = TAGCConfig()
    cfg = object.__new__(TAGCConfig)  # the bad value in place, no check run yet
    cfg.__dict__.update({**{f.name: getattr(good, f.name) for f in FIELDS}, **kw})
    with pytest.raises(ValueError, match=f"^{knob}"):
        config.CHECKS[group](cfg)
    for other, check in config.CHECKS.items():
        if other != group:
            check(cfg)
    with pytest.raises(ValueError, match=f"^{knob}"):
        TAGCConfig(**kw)


def test_replace_keeps_working_through_the_groups() -> None:
    """dataclasses.replace and cfg.replace rebuild through every group's check: derived
    knobs re-resolve, a bad value still raises."""
    cfg = TAGCConfig()
    assert (cfg.replace(mode="exact").theta, cfg.replace(mode="exact").residual_code) == \
        (0.9875, "none")
    assert dataclasses.replace(cfg, quant_format="int8").quant_format == "int8"
    assert TAGCConfig(value_dtype="bf16").value_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="^outer_overlap"):
        cfg.replace(outer_every=4, outer_fragments=2, outer_overlap=2)
