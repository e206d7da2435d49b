"""Every command the docs show still exists, starts and runs: each ``scripts/...`` path
that README.md and docs/**/*.md name is a file of the checkout, and each Python script and
``python -m tagc...`` module among them answers ``--help`` (run from a folder outside
the checkout, as a user's shell would be anywhere).  Each documented command also runs
its main path once with the smallest arguments that reach it (:data:`MAIN_PATHS`: a
few steps, tiny sizes, outputs in a temporary folder), or names the existing test that
does.  And no code, doc or data file names a folder of one development machine
(figures trace to the repository).

A moved or renamed script fails here with the document and line that still name the
old path; a command that fails at once (a crash before its first step) fails here
with its command line and output.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple, Union

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# a path under scripts/ (a .py or .sh file), as the docs write it
SCRIPT = re.compile(r"(?<![\w/.-])(scripts/[\w./-]+?\.(?:py|sh))(?![\w/])")
# an absolute folder of one machine (a checkout, a home, an experiments folder)
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|home|root)/")
# a module started with `python -m` or `torchrun ... -m` (the package's own only)
MODULE = re.compile(r"\b(?:python3?|torchrun)\b[^`\n]*?\s-m\s+(tagc[\w.]*)")

def references() -> List[Tuple[str, int, str, str]]:
    """(document, line, kind, name) of every script path and package module the docs
    name; kind is ``script`` or ``module``."""
    out = []
    for doc in DOCS:
        rel = str(doc.relative_to(ROOT))
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            out += [(rel, i, "script", m) for m in SCRIPT.findall(line)]
            out += [(rel, i, "module", m) for m in MODULE.findall(line)]
    return out


def test_the_docs_name_commands() -> None:
    """The scan finds what it should (a broken pattern would pass everything)."""
    refs = references()
    scripts = {name for _, _, kind, name in refs if kind == "script"}
    assert {"scripts/train_gpt2.py", "scripts/bench/cost_model.py"} <= scripts
    assert any(kind == "module" for _, _, kind, _ in refs)


def test_every_script_the_docs_name_exists() -> None:
    missing = [(doc, line, name) for doc, line, kind, name in references()
               if kind == "script" and not (ROOT / name).is_file()]
    assert not missing, "the docs name scripts that do not exist (document, line, path): " \
        f"{missing}"


def _commands() -> List[List[str]]:
    """One ``--help`` command per distinct Python script and package module named."""
    scripts, modules = set(), set()
    for _, _, kind, name in references():
        if kind == "script" and name.endswith(".py") and (ROOT / name).is_file():
            scripts.add(name)
        elif kind == "module":
            modules.add(name)
    return [[sys.executable, str(ROOT / s), "--help"] for s in sorted(scripts)] + \
        [[sys.executable, "-m", m, "--help"] for m in sorted(modules)]


@pytest.fixture(scope="module")
def helps(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Dict[Tuple[str, ...], "Future[subprocess.CompletedProcess]"]:
    """Start the selected ``--help`` commands, two at a time, each in a folder of its own:
    each mostly imports torch on one core while this process waits, so the second core
    would sit idle one at a time."""
    wanted = [tuple(item.callspec.params["cmd"]) for item in request.session.items
              if getattr(item, "originalname", "") == "test_every_command_answers_help"]
    pool = ThreadPoolExecutor(max_workers=2)
    request.addfinalizer(lambda: pool.shutdown(wait=True, cancel_futures=True))
    return {cmd: pool.submit(_help, list(cmd), tmp_path_factory.mktemp("help"))
            for cmd in dict.fromkeys(wanted)}


def _help(cmd: List[str], cwd: Path) -> subprocess.CompletedProcess:
    """``cmd`` run in ``cwd``; a start that fails with an OSError (seen once in CI: EFAULT
    from the exec of two starts at once, before the command ran) is tried once more."""
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    except OSError:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("cmd", _commands(), ids=lambda c: c[-2] if c[1] != "-m" else c[2])
def test_every_command_answers_help(
        cmd: List[str],
        helps: Dict[Tuple[str, ...], "Future[subprocess.CompletedProcess]"]) -> None:
    r = helps[tuple(cmd)].result()
    assert r.returncode == 0, f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr[-2000:]}"
    assert "usage:" in r.stdout, f"{' '.join(cmd)} printed no usage:\n{r.stdout[:500]}"


def test_no_machine_paths_in_code_docs_or_data() -> None:
    """Reports and commands name repository paths, never one machine's folders."""
    files = [ROOT / "README.md"] + [p for top in ("scripts", "docs", "tests", "tagc", "configs")
                                    for p in sorted((ROOT / top).rglob("*")) if p.is_file()
                                    and p.suffix in (".py", ".md", ".json", ".sh", ".yaml",
                                                     ".c", ".h", ".cu")]
    bad = [(str(p.relative_to(ROOT)), i) for p in files
           for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
           if MACHINE_PATH.search(line)]
    assert not bad, f"machine paths (file, line): {bad}"


# --------------------------------------------------------------------------- main paths

@dataclass(frozen=True)
class Run:
    """One documented command run to the end of its main path.

    ``{out}`` in ``args`` and ``expect`` is the folder every command shares
    as its working directory (one token cache for the training runs); every output
    goes below it, never into the checkout.
    """

    args: Tuple[str, ...]
    # files (or folders) under {out} that only the main path writes: an early exit 0
    # (a usage message, a skipped part) does not pass
    expect: Tuple[str, ...] = ()
    # what the machine must have: "root" (netem's network namespaces), a program name
    needs: Tuple[str, ...] = ()
    # what the output must hold where the command writes no file
    prints: str = ""
    # (task, steps): the script's TASKS entry cut to that many steps (the quality
    # comparisons take no step option; their tasks are hundreds of steps)
    shrink: Tuple[str, int] = ()
    # (a glob under the checkout, a path under {out}): its last match copied there first
    copy: Tuple[str, str] = ()
    label: str = ""
    # about how long it runs on the 2-core machine: the longest start first
    seconds: int = 10


@dataclass(frozen=True)
class CiStep:
    """A command CI's script runs on its own (not run again here)."""

    line: str  # the line of .ci/run that runs it
    how: str


@dataclass(frozen=True)
class Covered:
    """A command whose main path an existing test already runs (not run twice)."""

    test: str  # "tests/test_x.py::test_name"
    # what in that test's source starts the command (checked: a renamed or rewritten
    # test stops counting)
    starts: str
    how: str


# Every script and module the docs name -> how its main path is checked here.
MAIN_PATHS: Dict[str, List[Union[Run, Covered, CiStep]]] = {
    "scripts/accelerate_tagc.py": [Covered(
        "tests/test_hf.py::test_accelerate_recipe", '"accelerate", "launch"',
        "accelerate launch with its FSDP plugin; the plugin needs 2 GPUs (no CPU mode)")],
    "scripts/bench/bench_codec.py": [Run(
        ("--sizes", "4096", "--rounds", "1", "--only", "wq", "--json", "{out}/codec"),
        expect=("codec/bench_codec_4096.json",), seconds=11)],
    "scripts/bench/bench_collectives.py": [Covered(
        "tests/test_netem.py::test_bench_collectives_times_every_group_and_op",
        '"bench_collectives.py"',
        "2 emulated hosts x 2 ranks, every op (root)")],
    "scripts/bench/bench_kernels_gpu.py": [Covered(
        "tests/test_gpu_check.py::test_dry_run_passes_and_reports_every_part", '"--dry-run"',
        "gpu_check.sh --dry-run runs it on the CUDA emulation (--emu-lib)")],
    "scripts/bench/bench_pipeline.py": [Run(
        ("--rate", "1gbit", "--rows", "fp32", "int8", "--repeats", "1", "--steps", "1",
         "--warmup", "0", "--width", "32", "--timeout", "240", "--out", "{out}/pp-bench"),
        expect=("pp-bench/report.md", "pp-bench/results.json"), needs=("root", "ip", "tc"),
        seconds=21)],
    "scripts/bench/bench_report.py": [Run(
        ("{out}/step-report/results.json",), expect=("step-report/report.md",),
        copy=("docs/runs/step-*/results.json", "step-report/results.json"), seconds=1)],
    "scripts/bench/bench_step.py": [Run(
        ("--rate", "none", "--no-unshaped", "--no-codec", "--configs", "fsdp", "balanced",
         "--strategies", "FULL_SHARD", "--repeats", "1", "--steps", "1", "--warmup", "0",
         "--n-layer", "1", "--n-head", "2", "--n-embd", "64", "--vocab-size", "256",
         "--block-size", "32", "--batch", "1", "--measure-mb", "1", "--timeout", "240",
         "--out", "{out}/step"),
        expect=("step/report.md", "step/results.json"), needs=("root", "ip", "tc"),
        seconds=15)],
    "scripts/bench/bench_time_to_loss.py": [Run(
        # 6 steps: its equal-time run takes 6 x plain's time / the preset's steps, at
        # least one while the preset is under 6x slower (noise on a busy machine)
        ("--presets", "tagc-balanced", "--max_iters", "6", "--rate", "1gbit",
         "--timeout", "240", "--out", "{out}/ttl", "--", "--eval_interval=3",
         "--eval_iters=1", "--batch_size=2", "--block_size=32"),
        expect=("ttl/time_to_loss.md", "ttl/results.json"), needs=("root", "ip", "tc"),
        seconds=50)],
    # loopback, H = 2: both all-reduces of the comparison through two replica groups
    "scripts/bench/ft_runs.py": [Run(
        ("compare", "--rate", "none", "--H", "2", "--steps", "4", "--out", "{out}/ftr",
         "--", "--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32",
         "--batch_size=2", "--eval_iters=1"),
        expect=("ftr/report.md",), needs=("torchft_lighthouse",), seconds=25)],
    "scripts/bench/cost_model.py": [Covered(
        "tests/test_cost_model.py::test_cli_table_and_winner", "cli.main(",
        "its main() on a cluster sweep; --check and --cluster in the tests beside it")],
    # H = 2: a run whose round never ends in its steps sends nothing between replicas
    "scripts/bench/local_quality.py": [Run(
        ("--tasks", "tiny-r2", "--runs", "h2-m0.5", "--out_dir", "{out}/lq",
         "--doc", "{out}/lq.md", "--curves", "{out}/lq.png"),
        expect=("lq.md", "lq.png"), shrink=("tiny-r2", 2), seconds=26)],
    "scripts/bench/measure_bytes.py": [Run(("--world-sizes", "2", "--steps", "1",
                                            "--width", "64"), prints=" quant int4 ", seconds=13)],
    "scripts/bench/bench_unit_path.py": [Run(("--shape", "tiny", "--repeats", "2"),
                                             prints="unit path taken by", seconds=6)],
    "scripts/bench/pp_quality.py": [Run(
        ("--tasks", "tiny-300", "--codes", "int8", "--out_dir", "{out}/ppq",
         "--doc", "{out}/ppq.md", "--curves", "{out}/ppq.png"),
        expect=("ppq.md", "ppq.png"), shrink=("tiny-300", 2), seconds=26)],
    "scripts/bench/tagc_bench/cuda_hook.py": [Covered(
        "tests/test_gpu_check.py::test_dry_run_passes_and_reports_every_part", '"--dry-run"',
        "part d of gpu_check.sh --dry-run")],
    "scripts/bench/tagc_bench/cuda_ops.py": [Covered(
        "tests/test_gpu_check.py::test_dry_run_passes_and_reports_every_part", '"--dry-run"',
        "part c of gpu_check.sh --dry-run")],
    "scripts/bench/tagc_bench/host_counts.py": [Covered(
        "tests/test_host_counts.py::test_the_table_with_host_time", "host_counts.main(",
        "its table with --time on the session's emulated library")],
    "scripts/bench/tagc_bench/gpu_step.py": [Covered(
        "tests/test_gpu_check.py::test_dry_run_passes_and_reports_every_part", '"--dry-run"',
        "part e of gpu_check.sh --dry-run")],
    "scripts/bench/reshape_quality.py": [Run(
        ("--cases", "fsdp2:2-fsdp2:1", "--steps", "2", "--at", "1", "--global-batch", "2",
         "--out", "{out}/reshape"),
        expect=("reshape/results.json",), prints="fsdp2:2 -> fsdp2:1", seconds=40)],
    "scripts/bench/quality_suite.py": [Run(
        ("--tasks", "regression-b256", "--methods", "tagc-lean", "--scale", "0.02",
         "--seeds", "0", "--out_dir", "{out}/suite", "--doc", "{out}/suite.md",
         "--curves", "{out}/suite.png"),
        expect=("suite.md", "suite.png"), seconds=13)],
    "scripts/compare_quality.py": [
        Run(("--presets", "tagc-balanced", "--out_dir", "{out}/cq", "--",
             "--max_iters=2", "--eval_iters=1"),
            expect=("cq/quality.md", "cq/val_curves.png"), label="presets", seconds=24),
        Run(("--grid", "--methods", "quant-int4", "--steps", "2", "--out_dir", "{out}/cqg",
             "--", "--eval_iters=1"),
            expect=("cqg/grid.md", "cqg/grid_curves.png"), label="grid", seconds=21)],
    "scripts/finetune_hf.py": [Covered(
        "tests/test_hf.py::test_finetune_hf_from_config_and_checkpoint", "_finetune",
        "tagc.train.hf's main on 2 ranks: a Llama config and a GPT-2 checkpoint")],
    "scripts/gpu_check.sh": [Covered(
        "tests/test_gpu_check.py::test_dry_run_passes_and_reports_every_part", '"--dry-run"',
        "--dry-run: every part on the CPU paths and the CUDA emulation")],
    "scripts/gpu_quality.sh": [Covered(
        "tests/test_gpu_quality.py::test_dry_run_runs_and_reports", '"--dry-run"',
        "--dry-run: the CPU, a tiny shape, six steps of each preset")],
    "scripts/research/lean_family.py": [Run(
        ("--steps", "2", "--seeds", "10", "--members", "w128-b8-n0.5", "--out_dir",
         "{out}/lf", "tagc-lean"), expect=("lf/family.md",), seconds=12), Run(
        ("--sim", "--steps", "2", "--seeds", "10", "--members", "w128-b8-n0.5", "--out_dir",
         "{out}/lfs", "none:q=tlog64"), expect=("lfs/family.md",), seconds=6, label="sim")],
    "scripts/research/sim_ablation.py": [Run(
        ("--steps", "2", "--eval_interval", "1", "--out", "{out}/ablation.jsonl", "dense",
         "quant:fmt=int4"), expect=("ablation.jsonl",), seconds=11)],
    "scripts/research/sim_feedback.py": [Run(
        ("--task", "ts", "--steps", "2", "--eval_every", "1", "--out",
         "{out}/feedback.jsonl", "ef21:q=int4"), expect=("feedback.jsonl",), seconds=5)],
    "scripts/research/teacher_student.py": [Run(
        ("--steps", "2", "--eval_every", "1", "--out_dir", "{out}/ts-script", "plain",
         "tagc-balanced"), expect=("ts-script/summary.json",), seconds=11)],
    "scripts/tools/check_cuda.sh": [CiStep(
        "    bash scripts/tools/check_cuda.sh", "its own CI step where nvcc is installed")],
    "scripts/tools/sanitize.sh": [CiStep(
        'setsid bash scripts/tools/sanitize.sh >"$venv_dir/sanitize.log" 2>&1 &',
        "its own CI step, beside the install, before the tests")],
    "scripts/train_gpt2.py": [Covered(
        "tests/test_train.py::test_torchrun_command_line", '"train_gpt2.py"',
        "torchrun with 2 ranks and a preset, a few steps")],
    "tagc.cost": [Run(("--params", "124e6", "--nodes", "1,2", "--configs", "fsdp,fsdp+balanced"),
                      prints="fsdp+balanced", seconds=3)],
    "tagc.train": [Covered(
        "tests/test_packaging.py::test_wheel_installs_and_trains_outside_the_checkout",
        '"-m", "tagc.train"',
        "torchrun -m tagc.train from an installed wheel, outside the checkout")],
}
# a script without a step option, run with its TASKS entry cut short (Run.shrink)
SHRINK = """
import importlib.util, sys
path, task, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, path.rsplit("/", 1)[0])  # as when run as a file: its folder first
spec = importlib.util.spec_from_file_location("command_under_test", path)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
module.TASKS[task] = (steps, *module.TASKS[task][1:])
module.main(sys.argv[4:])
"""
# seconds one command may take on the 2-core machine before it counts as hung
RUN_TIMEOUT = 300


def _documented() -> List[str]:
    """Every script and module the docs name (the keys MAIN_PATHS must have)."""
    return sorted({name for _, _, _, name in references()})


def _runs() -> List[Tuple[str, Run]]:
    return [(name, e) for name, entries in MAIN_PATHS.items() for e in entries
            if isinstance(e, Run)]


def _run_id(name: str, run: Run) -> str:
    return Path(name).name + (f"[{run.label}]" if run.label else "")


def _missing(run: Run) -> Optional[str]:
    """Why this machine cannot run the command (None: it can)."""
    for need in run.needs:
        if need == "root":
            if os.geteuid() != 0:
                return "needs root (netem's network namespaces)"
        elif shutil.which(need) is None:
            return f"needs {need}"
    return None


def _command(name: str, run: Run, out: Path) -> List[str]:
    """The command line of a run.

    Args:
        name: the script's path in the checkout, or the module.
        run: its entry.
        out: the folder ``{out}`` stands for.
    Returns:
        the argv.
    """
    args = [a.replace("{out}", str(out)) for a in run.args]
    if not name.startswith("scripts/"):
        return [sys.executable, "-m", name, *args]
    path = str(ROOT / name)
    if run.shrink:
        task, steps = run.shrink
        return [sys.executable, "-c", SHRINK, path, task, str(steps), *args]
    return [sys.executable, path, *args]


Result = Tuple[List[str], int, str, float]


def _execute(name: str, run: Run, out: Path) -> Result:
    """Run one command with ``out`` as its working directory.

    Args:
        name: the script's path in the checkout, or the module.
        run: its entry.
        out: the shared folder.
    Returns:
        (argv, exit status (-1: timed out), stdout and stderr, seconds).
    """
    if run.copy:
        pattern, dest = run.copy
        src = sorted(ROOT.glob(pattern))[-1]
        (out / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, out / dest)
    cmd = _command(name, run, out)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        code, text = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        code = -1
        text = f"timed out after {RUN_TIMEOUT} s\n" + "".join(
            x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
            for x in (e.stdout, e.stderr))
    return cmd, code, text, time.perf_counter() - t0


def _checkout_outputs() -> Set[str]:
    """What the commands would leave in the checkout if an output escaped {out}: the
    run folders of docs/runs, and the default folders of runs, caches and builds."""
    return {p.name for p in (ROOT / "docs" / "runs").iterdir()} | \
        {d for d in ("out", "data_cache", "build", "bench_out") if (ROOT / d).exists()}


@dataclass
class Launched:
    """The runs under way: their shared folder, the checkout before them, {run id:
    its future}."""

    out: Path
    before: Set[str]
    futures: Dict[str, "Future[Result]"]


@pytest.fixture(scope="module")
def launched(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """Start every selected command that this machine can run, two at a time (the
    machine has 2 cores; most commands wait on process start-up and rendezvous),
    the longest first."""
    out = tmp_path_factory.mktemp("commands")
    wanted = {item.callspec.params["run_id"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_documented_command_runs"}
    todo = sorted(((n, r) for n, r in _runs() if _run_id(n, r) in wanted
                   and _missing(r) is None), key=lambda x: -x[1].seconds)
    before = _checkout_outputs()
    pool = ThreadPoolExecutor(max_workers=2)
    request.addfinalizer(lambda: pool.shutdown(wait=True, cancel_futures=True))
    return Launched(out, before, {_run_id(n, r): pool.submit(_execute, n, r, out)
                                  for n, r in todo})


def test_every_documented_command_has_a_main_path() -> None:
    """A command the docs start to name gets an entry (run or covered), and an entry
    whose command the docs no longer name goes."""
    documented, listed = set(_documented()), set(MAIN_PATHS)
    assert not documented - listed, f"add to MAIN_PATHS: {sorted(documented - listed)}"
    assert not listed - documented, f"no longer in the docs: {sorted(listed - documented)}"
    assert len({_run_id(n, r) for n, r in _runs()}) == len(_runs()), "duplicate run ids"


@pytest.mark.parametrize("entry", [(n, e) for n, es in MAIN_PATHS.items() for e in es
                                   if isinstance(e, Covered)],
                         ids=lambda e: f"{Path(e[0]).name}->{e[1].test.split('::')[1]}")
def test_the_covering_test_exists(entry: Tuple[str, Covered]) -> None:
    """The test named for a command is a test function of that file, and it still
    starts the command the way the entry says."""
    name, cov = entry
    path, func = cov.test.split("::")
    tree = ast.parse((ROOT / path).read_text())
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == func]
    assert found, f"{name}: {cov.test} does not exist"
    source = ast.get_source_segment((ROOT / path).read_text(), found[0]) or ""
    assert cov.starts in source, f"{name}: {cov.test} no longer holds {cov.starts!r}"


@pytest.mark.parametrize("entry", [(n, e) for n, es in MAIN_PATHS.items() for e in es
                                   if isinstance(e, CiStep)], ids=lambda e: Path(e[0]).name)
def test_the_ci_step_exists(entry: Tuple[str, CiStep]) -> None:
    """CI's script still runs the command as the entry says."""
    name, step = entry
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert step.line in lines and name in step.line, \
        f"{name}: .ci/run no longer has the line {step.line!r}"


# about 2.5 minutes in all on the 2-core machine, mostly training runs of 2 gloo ranks
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("run_id", [_run_id(n, r) for n, r in _runs()])
def test_documented_command_runs(run_id: str, launched: Launched) -> None:
    """The command exits 0 and writes what its main path writes, under {out}."""
    name, run = next((n, r) for n, r in _runs() if _run_id(n, r) == run_id)
    why = _missing(run)
    if why is not None:
        pytest.skip(f"{name}: {why}")
    cmd, code, text, seconds = launched.futures[run_id].result()
    out = launched.out
    shown = " ".join("<SHRINK>" if c == SHRINK else c for c in cmd)
    assert code == 0, f"{shown}\nexit {code} after {seconds:.0f} s:\n{text[-6000:]}"
    missing = [p for p in run.expect if not (out / p).exists()]
    assert not missing, f"{shown}: wrote none of {missing}; output:\n{text[-3000:]}"
    assert run.prints in text, f"{shown}: printed no {run.prints!r}:\n{text[-3000:]}"
    print(f"{run_id}: {seconds:.1f} s")


@pytest.mark.dist
@pytest.mark.slow
def test_the_commands_wrote_nothing_into_the_checkout(launched: Launched) -> None:
    """Every output of the runs above went to their temporary folder."""
    for f in launched.futures.values():
        f.result()
    new = _checkout_outputs() - launched.before
    assert not new, f"the commands wrote into the checkout: {sorted(new)}"
