"""The project as a user installs it: a wheel in a fresh environment, used from a folder
outside the checkout, and a CI run that cannot pass on a broken build."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    training on the built-in corpus runs through ``python -m tagc.train``."""
    src = _checkout_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(dist), str(src)],
                   check=True, capture_output=True, env=_env(TAGC_BUILD_CUDA="0"))
    (wheel,) = dist.glob("tagc-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {Path(n).name: zf.read(n) for n in zf.namelist()
                   if n.startswith("tagc/configs/") and n.endswith(".yaml")}
        assert "tagc/train/netem.sh" in zf.namelist()
    source = {p.name: p.read_bytes() for p in (ROOT / "configs").glob("*.yaml")}
    assert shipped == source, sorted(set(shipped) ^ set(source))

    venv = tmp_path / "venv"
    # torch comes from the system site-packages: installing it again would copy gigabytes
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
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
