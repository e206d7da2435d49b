"""What a session runs first on a borrowed GPU: ``scripts/gpu_check.sh`` (issue 39).

One command, seven parts, each run even when an earlier one failed (each in its own
process, under its own time limit), one report:

a. **build**: ``setup.py build_ext`` of ``_tagc`` with its CUDA kernels for the local GPU
   (``TAGC_CUDA_ARCHS`` from ``nvidia-smi``'s compute capability, else torch's) against
   the torch installed there, into a scratch folder (``--build-lib``/``--build-temp``):
   no download, no build isolation; setup.py runs one nvcc per CPU.  Every later part
   imports that build (``PYTHONPATH=<scratch>/lib:<repo>:<repo>/scripts/bench``,
   ``PYTHONSAFEPATH=1``) and says
   which ``_tagc`` it imported;
b. **tests**: ``pytest -m cuda tests`` (junit summary: passed, failed, skipped with the
   reasons), then ``tests/test_module_args.py tests/test_cuda_build.py``;
c. **ops**: every CUDA codec op against its C twin, bit for bit (``tagc_bench.cuda_ops``:
   sizes 0, 1, odd, 2^24; fp32 and bf16);
d. **hook**: the hook's CUDA path on one rank with each recommended preset
   (``tagc_bench.cuda_hook``);
e. **kernels** and **step**: each CUDA kernel against a device-to-device copy
   (``scripts/bench/bench_kernels_gpu.py --json``) and one bf16 training step of GPT-2
   124M without and with the codec (``tagc_bench.gpu_step``);
f. **two_ranks**: two processes sharing the GPU over gloo, the hook's reduce-scatter with
   a real peer against the CPU path, and NCCL's refusal (``tagc_bench.two_ranks``);

The report: ``$OUT/gpu_report.md`` when ``$OUT`` is set, else
   ``docs/gpu/report-<UTC>.md`` (``--out DIR`` overrides both): the parts' status and
   duration, the tests' summary, the bit-equality table, the timings, the device,
   driver, CUDA, torch and Python versions and the commit.  Exit status 1 when a part
   failed.

``--dry-run`` runs the same script on a machine without a GPU: the build is the
sm_80/sm_90 build of ``scripts/tools/check_cuda.sh`` (CPU-only when nvcc is missing), the
cuda tests run their harness with ``TAGC_CUDA_TEST_DEVICE=cpu``, the op table and the
kernel benchmark run the kernels' own code under the CPU emulation (``cuda/emu``, small
sizes), the hook and the step run their CPU paths with small shapes; what needs a GPU
(host-sync detection, the profiler's stream order, every timing) is reported skipped.
The report then goes to a temporary folder.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[3]
# the folder holding this package (scripts/bench/): on the parts' path beside the checkout
BENCH = Path(__file__).resolve().parents[1]
# the code a report describes (hashed when the checkout has no .git)
CODE_PATHS = ("tagc", "csrc", "cuda", "scripts", "configs", "tests", "setup.py", "tagc_hook.py")
# seconds: each part's own limit; the whole run's budget (GPU: one device call of 8 min)
LIMITS = {"build": 300, "tests": 240, "ops": 180, "hook": 150, "kernels": 90, "step": 150,
          "two_ranks": 120}
GPU_BUDGET, DRY_BUDGET = 450, 900
# a folder of one machine (tests/test_docs_commands.py refuses them in committed files)
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|home|root)/[^\s'\"`),:;]*")


@dataclass
class Part:
    """One part's outcome.

    Attributes:
        key: ``a`` ... ``f``.
        name: ``build``, ``tests``, ``ops``, ``hook``, ``kernels``, ``step``,
            ``two_ranks``.
        title: what it does, for the report.
        status: ``ok``, ``failed`` or ``skipped``.
        reason: why it failed or was skipped (one line).
        seconds: its wall time.
        body: its section of the report (markdown).
        log: its log file.
    """

    key: str
    name: str
    title: str
    status: str = "skipped"
    reason: str = ""
    seconds: float = 0.0
    body: str = ""
    log: Optional[Path] = None
    data: Dict[str, Any] = field(default_factory=dict)


class Runner:
    """Runs the parts as subprocesses against the scratch build.

    Args:
        scratch: the scratch folder (``lib``, ``tmp``, ``logs``, ``emu``, ``out``).
        dry: the dry run.
        python: the interpreter.
        budget: seconds for the whole run.
    """

    def __init__(self, scratch: Path, dry: bool, python: str, budget: float) -> None:
        self.scratch, self.dry, self.python = scratch, dry, python
        self.lib, self.logs, self.out = scratch / "lib", scratch / "logs", scratch / "out"
        for d in (self.lib, self.logs, self.out):
            d.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + budget

    def env(self, **extra: str) -> Dict[str, str]:
        """The parts' environment: the scratch build first, then the checkout and the
        folder of this package (the parts run ``-m tagc_bench...``); no current folder on
        the path (it holds the checkout's own ``_tagc``, if any)."""
        env = dict(os.environ)
        env.update(PYTHONPATH=os.pathsep.join(map(str, (self.lib, REPO, BENCH))),
                   PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1",
                   PIP_NO_INDEX="1")
        env.pop("TAGC_CUDA_TEST_DEVICE", None)
        env.update(extra)
        return env

    def which_tagc(self) -> Dict[str, Any]:
        """The ``_tagc`` the parts import: its file and whether it runs CUDA here."""
        probe = [self.python, "-c", "import json, _tagc; print(json.dumps({'file': "
                 "_tagc.__file__, 'cuda': hasattr(_tagc, 'cuda_available') and "
                 "_tagc.cuda_available()}))"]
        try:
            return json.loads(_cmd(probe, 120, self.env()).splitlines()[-1])
        except (IndexError, ValueError):
            return {}

    def limit(self, name: str, later: int) -> float:
        """The part's time limit: its own, within what the budget leaves after keeping
        20 s for each of the ``later`` parts."""
        return min(LIMITS[name], self.deadline - time.monotonic() - 20 * later)

    def run(self, part: Part, cmd: Sequence[str], timeout: float, env: Dict[str, str],
            tag: str = "") -> Tuple[Optional[int], float]:
        """Run one command of a part, its output appended to the part's log.

        Returns:
            (exit status, or None when it ran past ``timeout`` and was killed; seconds).
        """
        part.log = self.logs / f"{part.key}-{part.name}.log"
        t0 = time.monotonic()
        with open(part.log, "a") as log:
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(list(cmd), cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc: Optional[int] = proc.wait(timeout=max(timeout, 1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
                log.write(f"\n[gpu_check: killed after {timeout:.0f} s{tag}]\n")
        return rc, time.monotonic() - t0


# ----------------------------------------------------------------------------- environment
def _cmd(args: Sequence[str], timeout: float = 30, env: Optional[Dict[str, str]] = None) -> str:
    """A command's stdout, "" when it is missing or fails."""
    try:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def nvidia_smi() -> List[Dict[str, str]]:
    """One dict per GPU (name, compute_cap, driver_version, memory.total), [] without."""
    out = _cmd(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total",
                "--format=csv,noheader"])
    keys = ("name", "compute_cap", "driver_version", "memory.total")
    return [dict(zip(keys, (f.strip() for f in line.split(","))))
            for line in out.splitlines() if line.count(",") >= 3]


def cuda_archs(gpus: List[Dict[str, str]], torch_cc: Optional[str]) -> str:
    """``TAGC_CUDA_ARCHS`` for the local GPUs: ``9.0`` -> ``90``, several -> ``80;90``.

    Args:
        gpus: :func:`nvidia_smi`'s rows.
        torch_cc: torch's ``major.minor`` of device 0, the fallback.
    Returns:
        the list, "" when neither knows.
    """
    caps = [g.get("compute_cap", "") for g in gpus] or [torch_cc or ""]
    archs = sorted({c.replace(".", "") for c in caps if re.fullmatch(r"\d+\.\d+", c or "")},
                   key=int)
    return ";".join(archs)


def torch_info(python: str) -> Dict[str, Any]:
    """torch's view of the machine, from a subprocess (this one never touches CUDA)."""
    code = ("import json, platform, sys, torch\n"
            "d = {'python': platform.python_version(), 'torch': torch.__version__,\n"
            "     'torch_cuda': torch.version.cuda, 'gpu': torch.cuda.is_available()}\n"
            "if d['gpu']:\n"
            "    p = torch.cuda.get_device_properties(0)\n"
            "    d.update(device=p.name, cc=f'{p.major}.{p.minor}', sms=p.multi_processor_count,\n"
            "             memory_gib=round(p.total_memory / 2**30, 1), count=torch.cuda.device_count())\n"
            "print(json.dumps(d))\n")
    out = _cmd([python, "-c", code], timeout=120)
    try:
        return json.loads(out.splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": "torch did not answer"}


def code_hash() -> str:
    """A hash of the code the run executes (:data:`CODE_PATHS`; caches and builds left
    out), for a checkout copied without its .git."""
    h = hashlib.sha256()
    for top in CODE_PATHS:
        p = REPO / top
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
        for f in files:
            if "__pycache__" in f.parts or f.suffix in (".so", ".o", ".pyc"):
                continue
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def commit() -> str:
    """The commit (and whether the tree has uncommitted changes), from git when the
    checkout has its .git, else from ``$TAGC_COMMIT``; with the code's hash."""
    rev = _cmd(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]) \
        if (REPO / ".git").exists() else ""
    if rev:
        dirty = _cmd(["git", "-C", str(REPO), "status", "--porcelain", "--", *CODE_PATHS])
        rev += f" (+ uncommitted changes in {len(dirty.splitlines())} files)" if dirty else ""
    else:
        rev = (os.environ.get("TAGC_COMMIT", "") + " (from $TAGC_COMMIT)") \
            if os.environ.get("TAGC_COMMIT") else "unknown (no .git; set TAGC_COMMIT)"
    return f"{rev}; code hash {code_hash()}"


# ----------------------------------------------------------------------------- the parts
def part_build(r: Runner, part: Part, archs: str, later: int) -> None:
    """a: the extension with its CUDA kernels into the scratch folder."""
    env = r.env(TAGC_BUILD_CUDA="1", TAGC_CUDA_ARCHS=archs)
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                    if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None)
    note = ""
    if nvcc is None and r.dry:
        env["TAGC_BUILD_CUDA"] = "0"
        note = " (no nvcc here: built CPU-only)"
    cmd = [r.python, "setup.py", "build_ext", "--build-lib", str(r.lib),
           "--build-temp", str(r.scratch / "tmp")]
    rc, secs = r.run(part, cmd, r.limit("build", later), env)
    got = r.which_tagc() if rc == 0 else {}
    part.data = {"archs": archs, "cuda": got.get("cuda"), "file": got.get("file")}
    where = got.get("file", "")
    in_scratch = bool(where) and Path(where).resolve().is_relative_to(r.lib.resolve())
    cuda_ok = bool(got.get("cuda")) or r.dry
    if rc is None:
        part.status, part.reason = "failed", f"timed out after {secs:.0f} s"
    elif rc != 0:
        part.status, part.reason = "failed", f"setup.py build_ext exited {rc}"
    elif not in_scratch:
        part.status, part.reason = "failed", "the parts would not import the scratch build"
    elif not cuda_ok:
        part.status, part.reason = "failed", ("_tagc.cuda_available() is False: built without "
                                              "the kernels, or no usable driver (CUDA 13 "
                                              "needs a driver >= 580)")
    else:
        part.status = "ok"
    part.body = (f"`TAGC_BUILD_CUDA={env['TAGC_BUILD_CUDA']} TAGC_CUDA_ARCHS=\"{archs}\" "
                 f"python3 setup.py build_ext --build-lib <scratch>/lib --build-temp "
                 f"<scratch>/tmp`{note}: exit {rc}, {secs:.0f} s; the parts import "
                 f"`{where or 'nothing'}`; `_tagc.cuda_available()`: {got.get('cuda')}"
                 + (" (no GPU: expected False)" if r.dry else ""))


def junit_summary(path: Path) -> Dict[str, Any]:
    """Counts, skip reasons and failures of a pytest junit file."""
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    skipped: Counter = Counter()
    failures: List[str] = []
    passed = 0
    for c in cases:
        sk = c.find("skipped")
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        name = f"{c.get('classname', '')}::{c.get('name', '')}"
        if bad is not None:
            msg = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append(f"{name}: {msg[0][:200] if msg else ''}")
        elif sk is not None:
            skipped[(sk.get("message") or "").removeprefix("Skipped: ")[:200]] += 1
        else:
            passed += 1
    return {"tests": len(cases), "passed": passed, "failed": len(failures),
            "skipped": sum(skipped.values()), "skip_reasons": dict(skipped.most_common()),
            "failures": failures}


def part_tests(r: Runner, part: Part, later: int) -> None:
    """b: every cuda-marked test, then the CPU tests a CUDA build could break."""
    runs = [("cuda-marked tests", ["-m", "cuda", "tests"],
             {"TAGC_CUDA_TEST_DEVICE": "cpu"} if r.dry else {}),
            ("CPU tests of the build", ["tests/test_module_args.py", "tests/test_cuda_build.py"],
             {})]
    lines, failed, problems = [], False, []
    for i, (what, args, extra) in enumerate(runs):
        xml = r.out / f"junit-{i}.xml"
        limit = r.limit("tests", later) * 0.8 if i == 0 else min(60.0, r.limit("tests", later))
        cmd = [r.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
               f"--junitxml={xml}", *args]
        rc, secs = r.run(part, cmd, limit, r.env(**extra))
        s = junit_summary(xml) if xml.exists() else None
        part.data[what] = s
        how = " (TAGC_CUDA_TEST_DEVICE=cpu: the harness on the CPU, a self-check of the " \
              "test code, not of CUDA)" if extra else ""
        if s is None:
            lines.append(f"\n**{what}**{how}: no result (exit {rc}, {secs:.0f} s)")
            failed = True
            problems.append(f"{what}: {'timed out' if rc is None else f'exit {rc}'}")
            continue
        lines.append(f"\n**{what}** `pytest {' '.join(args)}`{how}: {s['tests']} tests, "
                     f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped "
                     f"(exit {rc}, {secs:.0f} s)\n")
        lines += [f"- skipped {n}: {reason}" for reason, n in s["skip_reasons"].items()]
        lines += [f"- FAILED {f}" for f in s["failures"][:30]]
        if rc not in (0, 5) or s["failed"]:
            failed = True
            problems.append(f"{what}: {s['failed']} failed" if s["failed"] else
                            f"{what}: exit {rc}")
        if s["tests"] == 0:
            failed = True
            problems.append(f"{what}: no test ran")
    part.status = "failed" if failed else "ok"
    part.reason = "; ".join(problems)
    part.body = f"The tests import `{r.which_tagc().get('file')}`.\n" + "\n".join(lines)


def _json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_json(r: Runner, part: Part, cmd: Sequence[str], out: Path,
             later: int) -> Tuple[Optional[Dict[str, Any]], float]:
    """Run a part whose program writes its results to ``out`` (JSON).  The part fails when
    the program ran past its limit, wrote nothing or exited non-zero; (results or None,
    seconds)."""
    rc, secs = r.run(part, cmd, r.limit(part.name, later), r.env())
    res = _json(out)
    part.status = "ok" if rc == 0 and res is not None else "failed"
    part.reason = (f"timed out after {secs:.0f} s" if rc is None else
                   f"exited {rc} without a result" if res is None else
                   f"exited {rc}" if rc else "")
    return res, secs


def part_ops(r: Runner, part: Part, later: int) -> None:
    """c: the bit-equality table."""
    out = r.out / "ops.json"
    if r.dry:
        args = ["--target", "emu", "--emu-build", str(r.scratch / "emu")]
    else:
        args = ["--target", "cuda"]
    res, secs = run_json(r, part, [r.python, "-m", "tagc_bench.cuda_ops", *args, "--json",
                                   str(out)], out, later)
    if res is None:
        return
    from tagc_bench.cuda_ops import Row, markdown

    rows = [Row(**row) for row in res["rows"]]
    bad = [x for x in rows if not x.ok]
    if bad:
        part.status, part.reason = "failed", f"{len(bad)} rows outside their contract"
    how = ("the CUDA ops of the scratch build on the GPU" if not r.dry else
           "the kernels' own code on the CPU under the CUDA emulation (cuda/emu), sizes "
           "the emulation can run in place of 100003 and 2^24")
    part.data = {"rows": len(rows), "bit_equal": sum(x.equal for x in rows), "failed": len(bad),
                 "sizes": res.get("sizes")}
    part.body = (f"{how}; sizes {res.get('sizes')}: {len(rows)} rows, "
                 f"{sum(x.equal for x in rows)} bit-equal, {len(bad)} outside their contract "
                 f"({secs:.0f} s).  `bits`: every output the C op's bits; `fp32 order`: "
                 "sketch buckets and peeled values up to the order of fp32 sums (atomics).\n\n"
                 + markdown(rows))


UNRUN = ("Two ranks: NCCL refuses two ranks on one device and gloo has no CUDA send/recv, so "
         "on one GPU these stay unrun: the batched isend/irecv between ranks "
         "(`Comm.post_send` on CUDA; part f runs the reduce-scatter's exchange over gloo "
         "as one staged all-to-all instead), NCCL's all-gather of several ranks' codes and "
         "FSDP2's reduce-scatter stream against a second rank's traffic, the owners' sums "
         "of several ranks' codes (EF21's estimate over ranks), and the overlap of the codec "
         "stream with the next unit's all-gather prefetch.  The loopback rank stands in for "
         "the codec and feedback side of a second rank only.")


def part_hook(r: Runner, part: Part, later: int) -> None:
    """d: the hook's CUDA path on one rank, each preset."""
    out = r.out / "hook.json"
    res, secs = run_json(r, part, [r.python, "-m", "tagc_bench.cuda_hook", "--device",
                                   "cpu" if r.dry else "cuda", "--json", str(out)], out, later)
    if res is None:
        part.body = UNRUN
        return
    rows = res["rows"]
    bad = [x for x in rows if x["status"] == "failed"]
    if bad:
        part.status, part.reason = "failed", f"{len(bad)} checks failed"
    elif rows and all(x["status"] == "skipped" for x in rows):  # e.g. a torch without FSDP2
        part.status, part.reason = "skipped", rows[0]["detail"]
    lines = ["| preset | check | status | detail |", "|---|---|---|---|"]
    for x in rows:
        lines.append(f"| {x['preset']} | {x['check']} | "
                     f"{'**failed**' if x['status'] == 'failed' else x['status']} | "
                     f"{x['detail'].replace('|', '/')} |")
    for x in bad:
        tb = x.get("metrics", {}).get("traceback")
        if tb:
            lines += ["", f"{x['preset']} / {x['check']}:", "```", tb, "```"]
    how = ("one NCCL rank on the GPU" if not r.dry else
           "the CPU path (gloo, one rank): a check of the harness and the CPU code only; "
           "the CUDA-only checks are skipped")
    part.data = {"checks": len(rows), "failed": len(bad),
                 "skipped": sum(x["status"] == "skipped" for x in rows)}
    part.body = (f"{how} ({secs:.0f} s); module `tagc_bench.cuda_hook` says what each check "
                 f"does.\n\n" + "\n".join(lines) + "\n\n" + UNRUN)


def part_kernels(r: Runner, part: Part, later: int) -> None:
    """e (kernels): each CUDA kernel against a device-to-device copy."""
    out = r.out / "kernels.json"
    cmd = [r.python, "scripts/bench/bench_kernels_gpu.py", "--json", str(out)]
    if r.dry:
        cmd += ["--emu-lib", str(_emu_lib(r, part, later)), "--n", "4099", "--iters", "2",
                "--warmup", "1"]
    else:
        cmd += ["--n", str(1 << 24), "--iters", "20", "--warmup", "3"]
    res, _ = run_json(r, part, cmd, out, later)
    if res is None:
        return
    lines = ["| op | bytes | ms | GB/s | % of copy |", "|---|---:|---:|---:|---:|"]
    for x in res["rows"]:
        lines.append(f"| {x['op']} | {x['bytes']} | {x['ms']:.4f} | {x['GB/s']:.1f} | "
                     f"{x['pct_copy']:.1f}% |")
    goals = res.get("goals", [])
    part.data = {"goals": goals}
    met = "; ".join(f"{g['op']} >= {g['goal_pct_copy']:.0f}% of the copy: "
                    f"{'met' if g['met'] else 'MISSED'} ({(g['pct_copy'] or 0):.1f}%)"
                    for g in goals)
    if r.dry:
        head = ("Under the CUDA emulation (n = 4099, 2 iterations): a check of the "
                "benchmark's calls, **not a measurement**; the goals below mean nothing here.")
    else:
        head = (f"{res['device']}, n = {res['n']} (k = {res['k']}), {res['iters']} iterations "
                "after 3 warm-ups, CUDA events; bytes = what the op must at least read and "
                "write; % of copy = its bandwidth over `dst.copy_(src)`'s.")
    part.body = f"{head}\n\nGoals: {met}\n\n" + "\n".join(lines)


def _emu_lib(r: Runner, part: Part, later: int) -> Path:
    """The emulated kernels of a dry run: part c's build, else one made here."""
    lib = r.scratch / "emu" / "libtagc_cuda_emu.so"
    if not lib.exists():
        r.run(part, [r.python, "-c", "import sys; from tagc_bench import cuda_emu; "
                     "cuda_emu.build(sys.argv[1])", str(lib.parent)],
              r.limit(part.name, later), r.env())
    return lib


def part_two_ranks(r: Runner, part: Part, later: int) -> None:
    """f (two ranks): two processes sharing the GPU over gloo, the hook's reduce-scatter
    with a real peer against the CPU path, and NCCL's refusal."""
    out = r.out / "two_ranks.json"
    cmd = [r.python, "-m", "tagc_bench.two_ranks", "--json", str(out),
           "--timeout", str(int(max(30, r.limit(part.name, later) - 30)))]
    if r.dry:
        cmd += ["--device", "emu", "--emu-lib", str(_emu_lib(r, part, later))]
    res, secs = run_json(r, part, cmd, out, later)
    if res is None:
        return
    lines = ["| preset | path | units on the unit path | collectives | result |",
             "|---|---|---|---|---|"]
    for c in res["cases"]:
        taken = c["unit_path_taken"]
        lines.append(f"| {c['preset']} | {c['path']} | "
                     f"{f'{sum(taken)} of {len(taken)}' if taken else '-'} | "
                     f"{', '.join(c['collectives']) or '-'} | "
                     + ("bit-equal to the CPU path" if not c["failures"] else
                        "**" + "; ".join(c["failures"][:4]).replace("|", "/") + "**") + " |")
    how = (f"{res['device']}, {res['ranks']} processes, gloo, {res['steps']} steps (an Inf on "
           f"rank 1 at step {res['inf_step']}), units of {res['shards']} values per shard; "
           f"module `tagc_bench.two_ranks` says what is checked ({secs:.0f} s).")
    if r.dry:
        how = ("**The dry run**: the reducers' CUDA branch on CPU tensors with the kernels "
               "emulated; the real peer and the staged all-to-all are real. " + how)
    nccl = f"\n\nNCCL with two ranks on one device: `{res['nccl']}`" if "nccl" in res else ""
    part.data = {"cases": len(res["cases"]), "ok": res["ok"]}
    part.body = how + "\n\n" + "\n".join(lines) + nccl


# sequences of 1024 tokens per step: 8 leaves the step bound by the host's launches on
# an H100/H200 (eager PyTorch), 32 by the GPU; the codec's cost differs between the two
STEP_BATCHES = (8, 32)


def _step_table(res: Dict[str, Any]) -> str:
    lines = ["| variant | step ms (median) | mean | host ms to enqueue (median) | overhead ms | "
             "overhead % | codec alone ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for v in res["variants"]:
        if "skipped" in v:
            lines.append(f"| {v['name']} | skipped: {v['skipped']} | | | | | |")
            continue
        alone = f"{v['codec_alone_ms']:.2f}" if "codec_alone_ms" in v else "-"
        lines.append(f"| {v['name']} | {v['step_ms_median']:.2f} | {v['step_ms_mean']:.2f} | "
                     f"{v['host_ms_median']:.2f} | {v['overhead_ms']:+.2f} | "
                     f"{v['overhead_pct']:+.1f}% | {alone} |")
    return "\n".join(lines)


def _host_table(res: Dict[str, Any]) -> str:
    rows = [v for v in res["variants"] if "host_us_per_unit" in v]
    if not rows:
        return ""
    # the codecs' calls, then the hook's (each row times the calls of its own codec)
    keys = list(dict.fromkeys(k for v in rows for k in v["host_us_per_unit"]))
    lines = ["| variant | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for v in rows:
        us = v["host_us_per_unit"]
        lines.append(f"| {v['name']} | " + " | ".join(f"{us[k]:.1f}" if k in us else "-"
                                                      for k in keys) + " |")
    return "\n".join(lines)


def part_step(r: Runner, part: Part, later: int) -> None:
    """e (step): one bf16 GPT-2 124M step without and with the codec, at a batch that
    leaves the step bound by the host's launches and at one that leaves it GPU-bound."""
    runs: List[Dict[str, Any]] = []
    reasons = []
    for batch in ((2,) if r.dry else STEP_BATCHES):
        out = r.out / f"step_b{batch}.json"
        cmd = [r.python, "-m", "tagc_bench.gpu_step", "--json", str(out)]
        cmd += (["--device", "cpu", "--shape", "tiny", "--context", "64", "--batch",
                 str(batch), "--steps", "2", "--warmup", "1"] if r.dry else
                ["--device", "cuda", "--shape", "gpt2-124m", "--context", "1024", "--batch",
                 str(batch), "--steps", "10", "--warmup", "3"])
        res, _ = run_json(r, part, cmd, out, later)
        if res is None:
            reasons.append(f"batch {batch}: {part.reason}")
            continue
        runs.append(res)
    part.status = "failed" if reasons else "ok"
    part.reason = "; ".join(reasons)
    if not runs:
        return
    bodies = []
    for res in runs:
        m = res["model"]
        head = (f"{res['device']}: GPT ({m['n_layer']} layers, width {m['n_embd']}, vocab "
                f"{m['vocab_size']}, context {m['block_size']}; {res['params'] / 1e6:.1f}M "
                f"parameters), **batch {res['batch']} ({res['tokens_per_step']} tokens)**, "
                f"bf16 autocast, AdamW; {res['units']} units as tagc.shard_model would make "
                f"them; median of {res['steps']} steps after {res['warmup']} warm-ups.  "
                f"tagc-full's gather codec alone (int8, two gathers a step): "
                f"{res['gather_codec_ms']:.2f} ms.")
        if "max_memory_allocated_gib" in res:
            head += f"  Peak memory {res['max_memory_allocated_gib']:.1f} GiB."
        host = _host_table(res)
        if host:
            host = ("\n\nHost microseconds per unit of each codec call (the gradients in "
                    "place, every unit back to back; `order` is the wait for the caller's "
                    "stream and the stream switch; `reduce (hook)`: the hook's whole "
                    "reduction of a unit at two ranks, the loopback in place of NCCL, on the "
                    "general path and on the unit path):\n\n" + host)
        bodies.append(head + "\n\n" + _step_table(res) + host)
    intro = ("With the codec: each unit's flat gradient encoded and decoded on a side stream "
             "as its last gradient lands (the hook's moment), the optimizer waiting for it.  "
             "Host ms: until the step is enqueued; near the step's time, the launching "
             "thread bounds the step and the codec's host time adds to it; far below, the "
             "GPU bounds it and the codec hides behind its work.")
    if r.dry:
        intro = "**Not a measurement** (the CPU, a tiny shape). " + intro
    part.data = {"runs": runs}
    part.body = intro + "\n\n" + "\n\n".join(bodies)


# ----------------------------------------------------------------------------- the report
def scrub(text: str, scratch: Path) -> str:
    """No folder of this machine in the report: the checkout and scratch by name, any
    other home-like path as ``<path>``."""
    text = text.replace(str(scratch), "<scratch>").replace(str(REPO), "<repo>")
    return MACHINE_PATH.sub("<path>", text)


def log_tail(path: Optional[Path], lines: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def report(parts: List[Part], env: Dict[str, Any], dry: bool, argv: Sequence[str],
           started: float, total: float) -> str:
    """The markdown report."""
    failed = [p for p in parts if p.status == "failed"]
    gpu = env.get("smi", [{}])[0] if env.get("smi") else {}
    ti = env.get("torch", {})
    title = "dry run, no GPU" if dry else (gpu.get("name") or ti.get("device") or "no GPU")
    out = [f"# TAGC GPU check: {title}, "
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}", ""]
    out += [f"`bash scripts/gpu_check.sh {' '.join(argv)}`".replace("  ", " "), "",
            f"**{'FAILED' if failed else 'passed'}**: "
            f"{sum(p.status == 'ok' for p in parts)} parts ok, {len(failed)} failed, "
            f"{sum(p.status == 'skipped' for p in parts)} skipped; {total:.0f} s in all; exit "
            f"status {1 if failed else 0}.", ""]
    if dry:
        out += ["A **dry run** (`--dry-run`) on a machine without a GPU: nothing here ran on a "
                "GPU; the parts ran their CPU paths and the CUDA emulation where the code "
                "allows, and say so.", ""]
    out += ["## Environment", "", "| | |", "|---|---|"]
    rows = [("device", gpu.get("name") or ti.get("device") or "none"),
            ("compute capability", gpu.get("compute_cap") or ti.get("cc") or "-"),
            ("GPU memory", gpu.get("memory.total") or
             (f"{ti['memory_gib']} GiB" if "memory_gib" in ti else "-")),
            ("multiprocessors", ti.get("sms", "-")),
            ("driver", gpu.get("driver_version") or "-"),
            ("CUDA (torch's / nvcc)", f"{ti.get('torch_cuda') or '-'} / {env.get('nvcc') or '-'}"),
            ("torch", ti.get("torch", "-")), ("Python", ti.get("python", "-")),
            ("CPUs", os.cpu_count()), ("commit", env.get("commit", "-")),
            ("build archs", env.get("archs") or "-")]
    out += [f"| {k} | {v} |" for k, v in rows] + [""]
    out += ["## Parts", "", "| part | what | status | seconds | why |", "|---|---|---|---:|---|"]
    for p in parts:
        out.append(f"| {p.key} | {p.title} | "
                   f"{'**failed**' if p.status == 'failed' else p.status} | "
                   f"{p.seconds:.0f} | {p.reason.replace('|', '/')} |")
    out.append("")
    for p in parts:
        out += [f"## {p.key}. {p.title}", "", f"Status: **{p.status}**"
                + (f" ({p.reason})" if p.reason else "") + f", {p.seconds:.0f} s.", ""]
        if p.body:
            out += [p.body, ""]
        if p.status == "failed":
            out += ["Last lines of its log:", "", "```", log_tail(p.log), "```", ""]
    return "\n".join(out)


def report_path(args: argparse.Namespace) -> Path:
    """``--out``; else a temporary folder (dry run); else ``$OUT``; else docs/gpu/."""
    if args.out:
        return Path(args.out) / "gpu_report.md"
    if args.dry_run:
        return Path(tempfile.mkdtemp(prefix="tagc-gpu-report-")) / "gpu_report.md"
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_report.md"
    return REPO / "docs" / "gpu" / f"report-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.md"


PARTS = [("a", "build", "build the extension with its CUDA kernels"),
         ("b", "tests", "cuda-marked tests and the build's CPU tests"),
         ("c", "ops", "every CUDA codec op against its C twin"),
         ("d", "hook", "the hook's CUDA path on one rank, each preset"),
         ("e", "kernels", "each kernel against a device-to-device copy"),
         ("e", "step", "one bf16 GPT-2 124M step without and with the codec"),
         ("f", "two_ranks", "two ranks sharing the GPU over gloo, against the CPU path")]


def main(argv: Optional[List[str]] = None) -> int:
    """``scripts/gpu_check.sh [--dry-run] [--out DIR] [--parts a,c] [--keep-scratch]``.

    Returns:
        0 when no part failed, 1 when one did, 2 when there is no GPU (without --dry-run).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: CPU paths and the CUDA emulation; the report in a temp folder")
    ap.add_argument("--out", default=None, help="write gpu_report.md into this folder")
    ap.add_argument("--parts", default="build,tests,ops,hook,kernels,step,two_ranks",
                    help="the parts to run (the others are reported skipped)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole run (default {GPU_BUDGET} on a GPU, "
                         f"{DRY_BUDGET} dry)")
    ap.add_argument("--keep-scratch", action="store_true", help="keep the scratch folder")
    ap.add_argument("--python", default=sys.executable, help="the interpreter of every part")
    args = ap.parse_args(argv)
    started, t0 = time.time(), time.monotonic()
    smi = nvidia_smi()
    ti = torch_info(args.python)
    if not args.dry_run and not ti.get("gpu"):
        print("gpu_check: torch sees no CUDA GPU here "
              f"({ti.get('error') or ti.get('torch')}); run with --dry-run", file=sys.stderr)
        return 2
    archs = "80;90" if args.dry_run else cuda_archs(smi, ti.get("cc"))
    nvcc_v = _cmd([shutil.which("nvcc") or "nvcc", "--version"]).splitlines()
    env = {"smi": smi, "torch": ti, "archs": archs, "commit": commit(),
           "nvcc": re.sub(r".*release ", "", nvcc_v[-2]) if len(nvcc_v) >= 2 else ""}
    scratch = Path(tempfile.mkdtemp(prefix="tagc-gpu-check-"))
    runner = Runner(scratch, args.dry_run, args.python,
                    args.budget or (DRY_BUDGET if args.dry_run else GPU_BUDGET))
    wanted = set(args.parts.split(","))
    parts = [Part(key, name, title) for key, name, title in PARTS]
    funcs = {"build": lambda p, later: part_build(runner, p, archs, later),
             "tests": lambda p, later: part_tests(runner, p, later),
             "ops": lambda p, later: part_ops(runner, p, later),
             "hook": lambda p, later: part_hook(runner, p, later),
             "kernels": lambda p, later: part_kernels(runner, p, later),
             "step": lambda p, later: part_step(runner, p, later),
             "two_ranks": lambda p, later: part_two_ranks(runner, p, later)}
    print(f"gpu_check: {'dry run' if args.dry_run else ti.get('device')}; archs {archs}; "
          f"scratch {scratch}", flush=True)
    try:
        for i, part in enumerate(parts):
            later = sum(p.name in wanted for p in parts[i + 1:])
            p0 = time.monotonic()
            if part.name not in wanted:
                part.reason = "not selected (--parts)"
            elif runner.limit(part.name, later) < 20:
                part.reason = "the time budget is spent"
            else:
                try:
                    funcs[part.name](part, later)
                except Exception as exc:  # noqa: BLE001 - the next part runs regardless
                    part.status, part.reason = "failed", f"{type(exc).__name__}: {exc}"[:300]
            part.seconds = time.monotonic() - p0
            print(f"gpu_check: part {part.key} ({part.name}): {part.status}"
                  + (f" ({part.reason})" if part.reason else "") + f", {part.seconds:.0f} s",
                  flush=True)
            if part.status == "failed" and part.log is not None:
                print(scrub(log_tail(part.log, 15), scratch), flush=True)
        text = report(parts, env, args.dry_run, argv, started, time.monotonic() - t0)
        path = report_path(args)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(scrub(text, scratch))
    finally:
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    failed = [p for p in parts if p.status == "failed"]
    print(f"gpu_check: {len(failed)} of {len(parts)} parts failed; report {path} "
          f"({time.monotonic() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
