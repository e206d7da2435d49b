"""``scripts/gpu_check.sh``, the first command on a borrowed GPU (issue 39), known to work
before a GPU is at hand: its ``--dry-run`` end to end (the build, the tests, the op table
under the CUDA emulation, the hook's CPU path, the benchmarks' calls), and its pieces:
the architecture from ``nvidia-smi``, the junit summary, the report, the op table's
harness and the emulation's coverage of every CUDA op."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tagc_bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]
# every _tagc function with a CUDA form (a ``stream=`` keyword): docs/module-api.md
CUDA_OPS = {"select_kth", "sparsify", "lanes_pack", "lanes_unpack", "bitmap_or", "popcount",
            "sketch_encode", "peel_decode", "sparse_pack", "sparse_unpack", "quant_encode",
            "quant_decode_add", "pairs_pack", "pairs_unpack_add", "wq_encode", "wq_decode",
            "wq_delta_encode", "wq_delta_decode", "tls_encode", "tls_decode_add"}


@pytest.mark.slow
@pytest.mark.codec
def test_dry_run_passes_and_reports_every_part(tmp_path: Path) -> None:
    """60-100 s on the 2-core machine (the sm_80/sm_90 build is half of it): slow tier."""
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    text = (tmp_path / "gpu_report.md").read_text()
    for heading in ("## Environment", "## Parts", "## a. build", "## b. cuda-marked tests",
                    "## c. every CUDA codec op", "## d. the hook's CUDA path",
                    "## e. each kernel against", "## e. one bf16 GPT-2 124M step",
                    "## f. two ranks sharing the GPU"):
        assert heading in text, heading
    parts = re.findall(r"^\| ([a-f]) \| [^|]+ \| (\w+) \|", text, re.M)
    assert [p for p, _ in parts] == list("abcdeef") and all(s == "ok" for _, s in parts), parts
    assert "**failed**" not in text and "FAILED" not in text
    assert "dry run" in text and "**passed**" in text
    # each part says what it ran instead of the GPU
    assert "TAGC_CUDA_TEST_DEVICE=cpu" in text
    assert "under the CUDA emulation" in text and "not a measurement" in text.lower()
    assert "skipped | no GPU (dry run)" in text  # the hook's GPU-only checks
    ops = {row.split("|")[1].strip().split()[0] for row in text.splitlines()
           if re.match(r"\| [a-z_]+( [\w-]+)? \| \d+ \| (float32|bfloat16|u8) \|", row)}
    assert ops == CUDA_OPS
    assert "NCCL refuses two ranks" in text  # what stays unrun
    assert not gpu_check.MACHINE_PATH.search(text)
    # part f: 2 presets x 2 paths of the reduce-scatter, 2 gathers, 2 HSDP forms
    assert text.count("bit-equal to the CPU path") == 8
    for line in ("part a (build): ok", "part d (hook): ok", "part f (two_ranks): ok",
                 "0 of 7 parts failed"):
        assert line in out


def test_archs_from_nvidia_smi_or_torch() -> None:
    assert gpu_check.cuda_archs([{"compute_cap": "9.0"}], None) == "90"
    assert gpu_check.cuda_archs([{"compute_cap": "9.0"}, {"compute_cap": "8.0"},
                                 {"compute_cap": "9.0"}], "7.5") == "80;90"
    assert gpu_check.cuda_archs([], "8.6") == "86"
    assert gpu_check.cuda_archs([{"compute_cap": "[N/A]"}], None) == ""


def test_junit_summary_counts_and_reasons(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="t" name="a"/>'
        '<testcase classname="t" name="b"><skipped message="needs a GPU"/></testcase>'
        '<testcase classname="t" name="c"><skipped message="needs a GPU"/></testcase>'
        '<testcase classname="t" name="d"><failure message="assert 1 == 2">tb</failure></testcase>'
        '<testcase classname="t" name="e"><error message="boom"/></testcase>'
        '</testsuite></testsuites>')
    s = gpu_check.junit_summary(xml)
    assert (s["tests"], s["passed"], s["failed"], s["skipped"]) == (5, 1, 2, 2)
    assert s["skip_reasons"] == {"needs a GPU": 2}
    assert s["failures"] == ["t::d: assert 1 == 2", "t::e: boom"]


def test_report_of_a_failed_part(tmp_path: Path) -> None:
    log = tmp_path / "log"
    elsewhere = "/" + "home/someone/x.py"  # a folder of another machine (not in this file)
    log.write_text(f"line 1\nTraceback: {elsewhere}\n")
    parts = [gpu_check.Part("a", "build", "build", "ok", seconds=3.0, body="built"),
             gpu_check.Part("b", "tests", "tests", "failed", "2 failed", 4.0, "t", log),
             gpu_check.Part("c", "ops", "ops", "skipped", "not selected (--parts)")]
    text = gpu_check.report(parts, {"torch": {"torch": "2.11.0", "python": "3.12.3"},
                                    "commit": "abc"}, False, ["--parts", "a"], 0.0, 7.0)
    assert "**FAILED**: 1 parts ok, 1 failed, 1 skipped" in text and "exit status 1" in text
    assert "| b | tests | **failed** | 4 | 2 failed |" in text
    assert "Traceback" in text  # the failed part's log tail
    scrubbed = gpu_check.scrub(text, tmp_path)
    assert elsewhere not in scrubbed and "<path>" in scrubbed


def test_no_gpu_without_dry_run_says_so(capsys: pytest.CaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu_check.main([]) == 2
    assert "--dry-run" in capsys.readouterr().err


@pytest.mark.codec
def test_op_table_harness_against_the_c_ops_themselves() -> None:
    """The table's harness with the C ops on both sides (what TAGC_CUDA_TEST_DEVICE=cpu is
    to the tests): every op of the CUDA API has rows, all equal."""
    from tagc_bench import cuda_ops
    from tagc.codec import _tagc

    rows = cuda_ops.run_all(cuda_ops.Side(_tagc, "cpu"), (0, 1, 1001))
    assert {r.op.split()[0] for r in rows} == CUDA_OPS
    bad = [r for r in rows if not (r.ok and r.equal)]
    assert not bad, bad
    assert {r.dtype for r in rows} == {"float32", "bfloat16", "u8"}


def test_the_emulation_wraps_every_cuda_op() -> None:
    from tagc_bench.cuda_emu import EmuOps

    assert CUDA_OPS <= set(vars(EmuOps))


def _ev(cat: str, name: str, ts: float, dur: float = 1, stream: int = None,
        corr: int = None, tid: int = 1) -> dict:
    args = {k: v for k, v in (("stream", stream), ("correlation", corr)) if v is not None}
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _trace(hook_kernel: dict, *extra: dict) -> list:
    """marker (stream 7), the hook's kernel, marker: a profiler trace as stream_order reads
    it, NCCL's watchdog thread (tid 9) querying and synchronizing meanwhile."""
    return [_ev("cuda_runtime", "cudaLaunchKernel", 0, corr=1),
            _ev("cuda_runtime", "cudaStreamWaitEvent", 2),
            _ev("cuda_runtime", "cudaLaunchKernel", 3, corr=2),
            _ev("cuda_runtime", "cudaEventQuery", 4, tid=9),
            _ev("cuda_runtime", "cudaStreamSynchronize", 4.5, tid=9),
            _ev("cuda_runtime", "cudaStreamWaitEvent", 5),
            _ev("cuda_runtime", "cudaLaunchKernel", 6, corr=3),
            _ev("cuda_runtime", "cudaDeviceSynchronize", 30),
            _ev("kernel", "void at::native::vectorized_elementwise_kernel<mul>", 10, 2,
                stream=7, corr=1),
            hook_kernel,
            _ev("kernel", "void at::native::vectorized_elementwise_kernel<add>", 16, 1,
                stream=7, corr=3), *extra]


def test_stream_order_reads_a_profiler_trace() -> None:
    """The GPU-only stream-order check's reading of a trace, on made-up traces."""
    from tagc_bench.cuda_hook import read_trace

    good = read_trace(_trace(_ev("kernel", "quant_encode_kernel", 12.5, 2, stream=20, corr=2)),
                      side=True)
    assert good["ok"] and good["codec_kernels"] == 1 and good["streams"] == ["20"]
    assert good["sync_calls"] == [] and good["stream_waits"] == 2
    early = read_trace(_trace(_ev("kernel", "quant_encode_kernel", 11, 2, stream=20, corr=2)),
                       side=True)
    assert early["ok"] is False and "NOT all after" in early["detail"]
    on_r = read_trace(_trace(_ev("kernel", "wq_encode_kernel", 12.5, 2, stream=7, corr=2)),
                      side=True)
    assert on_r["ok"] is False and "caller's stream" in on_r["detail"]
    assert read_trace(_trace(_ev("kernel", "wq_encode_kernel", 12.5, 2, stream=7, corr=2)),
                      side=False)["ok"]
    synced = read_trace(_trace(_ev("kernel", "quant_decode_kernel", 12.5, 2, stream=20, corr=2),
                               _ev("cuda_runtime", "cudaMemcpy", 4)), side=True)
    assert synced["ok"] is False and synced["sync_calls"] == ["cudaMemcpy"]
    assert read_trace([], side=True)["ok"] is None
