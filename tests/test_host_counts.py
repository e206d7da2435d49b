"""The host work of one unit's reduction on CUDA stays within budget (issue 57 item 1).

GPU time is rare, so the CPU proxy of ``tagc_bench.host_counts`` runs the reducer's CUDA
branch on CPU tensors with the kernels' own code emulated, and counts per call the
extension calls, kernel launches, memsets, launcher workspaces, torch kernels, caching-
allocator allocations and host syncs.  The budgets are those of the unit path for the
recommended presets at two ranks; the general path's counts are the "before".
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = [pytest.mark.codec, pytest.mark.slow]

from tagc_bench import host_counts

# per steady-state call (the first also creates the feedback state)
BUDGET = {"ext_calls": 2, "kernels": 3, "ext_memsets": 0, "workspaces": 0,
          "torch_kernels": 2, "allocs": 3, "memsets": 0, "syncs": 0, "collectives": 2}


@pytest.mark.parametrize("preset", ["balanced", "full"])
def test_unit_path_within_budget(cuda_emu_library: Path, preset: str) -> None:
    calls = host_counts.count_calls(cuda_emu_library, preset, unit_path=True, steps=3)
    for c in calls[1:]:
        over = {k: (c[k], v) for k, v in BUDGET.items() if c[k] > v}
        assert not over, f"{preset}: over budget (count, budget): {over}"
    assert calls[0]["syncs"] == 0  # not even when the state is created


def test_general_path_is_what_the_unit_path_replaces(cuda_emu_library: Path) -> None:
    """The counter sees the general path's work (so the budget test can fail): more
    calls, launches, workspaces and memsets, still no host sync."""
    unit = host_counts.count_calls(cuda_emu_library, "balanced", unit_path=True, steps=2)[-1]
    general = host_counts.count_calls(cuda_emu_library, "balanced", unit_path=False,
                                      steps=2)[-1]
    assert general["syncs"] == 0
    for k in ("ext_calls", "kernels", "workspaces", "torch_kernels", "allocs"):
        assert general[k] > unit[k], (k, general, unit)
    assert general["memsets"] + general["ext_memsets"] > 0


def test_the_table_with_host_time(cuda_emu_library: Path, capsys: pytest.CaptureFixture) -> None:
    """``host_counts.py --time``: the counts and the hook's host microseconds per call
    with no-op kernels, the unit path's below the general path's (it does a third of
    the work in Python and torch)."""
    assert host_counts.main(["--lib", str(cuda_emu_library), "--time", "--presets",
                             "balanced"]) == 0
    rows = [r.split("|") for r in capsys.readouterr().out.splitlines() if "| balanced |" in r]
    us = {r[2].strip(): float(r[-2]) for r in rows}
    assert set(us) == {"general", "unit"} and 0 < us["unit"] < us["general"], us
