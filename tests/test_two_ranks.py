"""Two ranks sharing one GPU (``tagc_bench.two_ranks``, issue 57 item 3), on the CPU: the
reducers' CUDA branch with the kernels' own code emulated, a real gloo peer, and each
exchange staged as one all-to-all (``Comm.staged``), against the CPU path on the same
gradients, bit for bit, on the unit path and the general one; the parameter gathers of
``tagc-full`` and ``tagc-full4``; HSDP's all-reduce in both forms (the GPU run is part f of
``scripts/gpu_check.sh``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("_tagc", reason="the _tagc codec is not built (pip install -e .)")
pytestmark = [pytest.mark.codec, pytest.mark.dist, pytest.mark.slow]

from tagc_bench import two_ranks


def test_staged_exchange_on_the_cuda_branch_equals_the_cpu_path(cuda_emu_library: Path,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "two.json"
    assert two_ranks.main(["--device", "emu", "--emu-lib", str(cuda_emu_library),
                           "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ok"] and len(res["cases"]) == 8
    for case in res["cases"]:
        assert not case["failures"], case
    reduce = res["cases"][:4]
    for case in reduce:
        assert case["collectives"] == ["all_reduce", "all_to_all_single"]
        assert all(case["unit_path_taken"]) == (case["path"] == "unit")
    assert [c["path"] for c in res["cases"][4:]] == ["gather", "gather delta",
                                                     "HSDP two-phase", "HSDP gather"]
