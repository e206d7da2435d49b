"""The project as a user installs it: a wheel in a fresh environment, used from a folder
outside the checkout, and a CI run that cannot pass on a broken build.

The wheel holds the library and what works installed; code that needs a checkout (the
GPU check, the CUDA emulation, run reports written into ``docs/``) lives beside the
scripts, ``scripts/bench/tagc_bench``, and never ships."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
# path parts only a checkout has: what the installed package must not build paths from
CHECKOUT_ONLY = ("docs", ".git")
# path prefixes only a checkout has (a relative path "docs/USAGE.md" given to a tool is
# the caller's; a report folder, the C sources or the CUDA emulation are the checkout's)
CHECKOUT_PREFIXES = ("docs/runs", "docs/gpu", ".git/", "csrc/", "cuda/")


def _env(**extra: str) -> dict:
    """The environment for a child that must not see this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CI")}
    return {**env, **extra}


def test_ci_refuses_a_broken_codec(tmp_path: Path) -> None:
    """Under CI=true a ``_tagc`` that fails to import stops the run (exit != 0, the import
    error in the message) instead of skipping every codec test; without CI it is a skip,
    counted by reason at the end."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path)
    (tmp_path / "_tagc.py").write_text('raise ImportError("undefined symbol: tagc_gone")\n')
    (tmp_path / "test_one.py").write_text(
        "import pytest\n\n\n@pytest.mark.codec\ndef test_needs_codec():\n    import _tagc\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", "."]
    ci = subprocess.run(cmd, cwd=tmp_path, env=_env(CI="true"), capture_output=True, text=True)
    assert ci.returncode != 0 and "tagc_gone" in ci.stdout + ci.stderr, ci.stdout + ci.stderr
    local = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert local.returncode == 0, local.stdout + local.stderr
    assert "skips by reason" in local.stdout and "tagc_gone" in local.stdout, local.stdout


def checkout_refs(source: str, name: str) -> List[Tuple[int, str]]:
    """Where a module's code finds the checkout around it: a walk up from its own file
    past the package's folder (``parents[N]``, N >= 2; ``.parent.parent.parent``) or a
    path into a folder only a checkout has (a part ``"docs"`` or ``".git"``, a
    :data:`CHECKOUT_PREFIXES` path; docstrings, which may cite the repository's
    documents, do not count).

    Args:
        source: the module's text.
        name: its file name, for syntax errors.
    Returns:
        (line, what) of each place, in order.
    """
    tree = ast.parse(source, name)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "parents"
                and not (isinstance(node.slice, ast.Constant) and node.slice.value in (0, 1))):
            out.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Attribute) and node.attr == "parent"
              and isinstance(node.value, ast.Attribute) and node.value.attr == "parent"
              and isinstance(node.value.value, ast.Attribute)
              and node.value.value.attr == "parent"):
            out.append((node.lineno, ast.unparse(node)))  # three levels up: a checkout's root
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docs
              and (node.value in CHECKOUT_ONLY or node.value.startswith(CHECKOUT_PREFIXES))):
            out.append((node.lineno, repr(node.value)))
    return sorted(out)


def test_the_scan_finds_checkout_paths() -> None:
    """The scan sees each way a module has found the checkout (a broken scan would pass
    everything), and leaves docstrings and prose alone."""
    bad = ('"""Cites docs/DESIGN.md."""\nfrom pathlib import Path\n'
           'ROOT = Path(__file__).resolve().parents[2]\n'
           'RUNS = Path("docs") / "runs"\nGIT = ROOT / ".git"\n'
           'UP = Path(__file__).parent.parent.parent\nEMU = ROOT / "cuda/emu"\n'
           'MSG = "see docs/CLUSTER.md for the assumptions"\nDEVICE = "cuda"\n'
           'HERE = Path(__file__).parents[0]\n')
    assert [line for line, _ in checkout_refs(bad, "bad.py")] == [3, 4, 5, 6, 7]


def _package_files(root: Path) -> Iterator[Path]:
    """The Python files the wheel ships from a tree: tagc/ and tagc_hook.py."""
    yield root / "tagc_hook.py"
    yield from sorted((root / "tagc").rglob("*.py"))


def test_no_module_of_the_package_needs_the_checkout() -> None:
    """Nothing under tagc/ (nor tagc_hook.py) finds files through the checkout around it,
    so every module works the same from a wheel; the checkout's helpers live in
    scripts/bench/tagc_bench instead."""
    found = {str(p.relative_to(ROOT)): refs for p in _package_files(ROOT)
             if (refs := checkout_refs(p.read_text(), str(p)))}
    assert found == {}, found
    assert not list((ROOT / "tagc").glob("bench/**/*.py"))
    assert (ROOT / "scripts" / "bench" / "tagc_bench" / "__init__.py").is_file()


def _outer_site(venv: Path) -> None:
    """Let a fresh virtual environment see the packages of the interpreter running the
    tests (torch, numpy, PyYAML, tqdm), wherever they are installed: a ``.pth`` file with
    their folders, read after the environment's own site-packages.  ``--system-site-packages``
    would reach the base interpreter's, which lack torch when the tests run in a venv.

    Args:
        venv: the environment (made by ``python -m venv``).
    """
    import numpy
    import torch
    import tqdm
    import yaml

    dirs = dict.fromkeys(str(Path(m.__file__).resolve().parents[1])
                         for m in (torch, numpy, yaml, tqdm))
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "outer_site.pth").write_text("".join(f"{d}\n" for d in dirs))


def _checkout_copy(dst: Path) -> Path:
    """The checkout's files as a clean clone would have them (tracked, plus new files git
    does not ignore), without build products."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        if (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)
    return dst


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs the git checkout (its files are what the wheel is built from)")
def test_wheel_installs_and_trains_outside_the_checkout(tmp_path: Path) -> None:
    """``pip install`` of the wheel (not editable) into a fresh virtual environment: the
    presets ship inside it, byte for byte the checkout's ``configs/``; from a folder
    outside the checkout the package finds them by name and a 2-rank FSDP + TAGC
    training on the built-in corpus runs through ``python -m tagc.train``.  Every module
    the wheel holds imports there, none finds the checkout (:func:`checkout_refs`), the
    checkout's helpers (``tagc_bench``) are not in it, and the cost model answers as
    ``python -m tagc.cost``."""
    src = _checkout_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(dist), str(src)],
                   check=True, capture_output=True, env=_env(TAGC_BUILD_CUDA="0"))
    (wheel,) = dist.glob("tagc-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {Path(n).name: zf.read(n) for n in zf.namelist()
                   if n.startswith("tagc/configs/") and n.endswith(".yaml")}
        names = zf.namelist()
        assert "tagc/train/netem.sh" in names
        modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in names
                         if n.endswith(".py") and not n.endswith("__main__.py"))
        found = {n: refs for n in names if n.endswith(".py")
                 if (refs := checkout_refs(zf.read(n).decode(), n))}
    assert found == {}, found
    assert "tagc.cost.cli" in modules and "tagc.train.runs" in modules, modules
    assert not [n for n in names if n.startswith(("tagc_bench", "tagc/bench", "scripts"))]
    source = {p.name: p.read_bytes() for p in (ROOT / "configs").glob("*.yaml")}
    assert shipped == source, sorted(set(shipped) ^ set(source))

    venv = tmp_path / "venv"
    # torch comes from the running interpreter's folders: installing it again would copy
    # gigabytes
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _outer_site(venv)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, env=_env())
    away = tmp_path / "elsewhere"
    away.mkdir()
    probe = ("import tagc, _tagc, tagc_hook as t\n"
             "print(tagc.__file__); print(_tagc.__file__)\n"
             "print(t.TAGCConfig.preset('full').gather, t.TAGCConfig() == "
             "t.TAGCConfig.preset('tagc-balanced'))\n")
    out = subprocess.run([py, "-c", probe], cwd=away, env=_env(), check=True,
                         capture_output=True, text=True).stdout.split("\n")
    assert out[0].startswith(str(venv)) and out[1].startswith(str(venv)), out
    assert out[2] == "int8 True", out

    imports = ("import importlib, sys\n"
               "for m in sys.argv[1:]:\n"
               "    print(m, importlib.import_module(m).__file__)\n")
    out = subprocess.run([py, "-c", imports, *modules], cwd=away, env=_env(),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    files = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert sorted(files) == modules
    assert all(f.startswith(str(venv)) for f in files.values()), files
    cost = subprocess.run([py, "-m", "tagc.cost", "--params", "124e6", "--nodes", "2",
                           "--configs", "fsdp,fsdp+balanced"], cwd=away, env=_env(),
                          capture_output=True, text=True)
    assert cost.returncode == 0 and "fsdp+balanced" in cost.stdout, cost.stderr[-3000:]

    train = subprocess.run(
        [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "tagc.train", "--tagc", "tagc-balanced", "--max_iters", "3",
         "--eval_interval", "3", "--eval_iters", "1", "--batch_size", "2",
         "--progress", "false", "--tensorboard", "false", "--out_dir", "out"],
        cwd=away, env=_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    log = train.stdout + train.stderr
    assert train.returncode == 0, log[-3000:]
    assert "final: iter 3" in log and "saved" in log, log[-3000:]
    assert (away / "out" / "summary.json").is_file()
