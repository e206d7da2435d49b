"""The source distribution carries every file the extension's build needs."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs the git checkout (the tracked files are the reference)")
def test_sdist_holds_every_tracked_build_file(tmp_path: Path) -> None:
    """Every tracked file under csrc/, cuda/, tagc/ and configs/ is in the sdist
    (a header left out makes `pip install` of the sdist fail to compile)."""
    # a copy of the tracked files: setuptools would otherwise reuse the checkout's
    # tagc.egg-info/SOURCES.txt, which remembers files no rule includes any more
    src = tmp_path / "src"
    for name in subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True,
                               text=True).stdout.split():
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)],
                   cwd=src, check=True, capture_output=True, env={"TAGC_BUILD_CUDA": "0",
                                                                 "PATH": "/usr/bin:/bin"})
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        packed = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    tracked = subprocess.run(["git", "ls-files", "csrc", "cuda", "tagc", "configs"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout.split()
    assert tracked and not set(tracked) - packed, sorted(set(tracked) - packed)
