"""register() is quiet: one INFO line per model on rank 0, each unit's line at DEBUG,
nothing at INFO on the other ranks (2 gloo ranks, FSDP1 and FSDP2 in one spawn)."""

from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import pytest

from dist_helpers import build_fsdp, run_dist

Record = Tuple[str, int, str]  # logger name, level, message


def _register_records(rank: int, n: int) -> Dict[str, List[Record]]:
    """The tagc log records of one register() per kind, on this rank."""
    import tagc_hook as tagc

    records: List[Record] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.name == "tagc_hook" or record.name.startswith("tagc"):
                records.append((record.name, record.levelno, record.getMessage()))

    grab = Grab(logging.DEBUG)
    root = logging.getLogger()
    loggers = [logging.getLogger("tagc_hook"), logging.getLogger("tagc")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
    root.addHandler(grab)
    out: Dict[str, List[Record]] = {}
    try:
        for kind in ("fsdp1", "fsdp2"):
            # every knob the layout relies on, explicitly (the defaults follow a preset):
            # the MLP weights are selected and their biases (< min_numel) ride along
            cfg = tagc.TAGCConfig(mode="quant", quant_format="int8", layers="all",
                                  min_numel=64, error_feedback=True, ef21=False)
            model = build_fsdp(kind, cfg)
            start = len(records)
            state = tagc.register(model, cfg)
            out[kind] = records[start:] + [("units", -1, str(len(state.units)))]
    finally:
        root.removeHandler(grab)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return out


@pytest.mark.dist
@pytest.mark.codec
def test_register_logs_one_info_line_on_rank_0() -> None:
    per_rank = run_dist(_register_records, 2, timeout=300)
    for kind in ("fsdp1", "fsdp2"):
        *recs, (_, _, units) = per_rank[0][kind]
        infos = [m for _, lv, m in recs if lv == logging.INFO]
        assert len(infos) == 1 and infos[0].startswith("TAGC registered"), (kind, recs)
        assert not [m for _, lv, m in recs if lv > logging.INFO], (kind, recs)
        unit_lines = [m for _, lv, m in recs if lv == logging.DEBUG and m.startswith("TAGC unit")]
        assert len(unit_lines) == int(units), (kind, unit_lines)
        assert any("compressed (" in m and "the rest ride along" in m
                   for m in unit_lines), (kind, unit_lines)
        assert not any("selected; the whole unit" in m for m in unit_lines), unit_lines
        *others, _ = per_rank[1][kind]
        assert not [r for r in others if r[1] >= logging.INFO], (kind, others)
