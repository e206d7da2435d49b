"""Training runs as subprocesses, for the scripts that compare them (quality_suite.py,
compare_quality.py, pp_quality.py, local_quality.py, bench_step.py, bench_time_to_loss.py):
the code a run executes, its record and reuse, its execution with a log, the options the
quality comparisons share, and the emulated network of tagc/train/netem.sh.

The runs train through the installed package (:data:`TRAIN_GPT2`: ``-m tagc.train``), in
the caller's folder, so the tools work from an installed wheel as from a checkout; the
code a run executes is the git state of the source tree the package is imported from
(:func:`code_id`: an editable install, a checkout on the path), else the installed
version.
"""
from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

# the package's own folder (tagc/): in a source tree, or in site-packages
PACKAGE = Path(__file__).resolve().parent.parent
# torchrun's arguments that start GPT-2 training (tagc/train/__main__.py)
TRAIN_GPT2 = ("-m", "tagc.train")
# what decides a run's result besides its configs (code_id hashes these paths)
CODE_DIRS = ("tagc", "csrc", "cuda", "scripts", "configs", "setup.py", "tagc_hook.py")
NETEM = Path(__file__).resolve().with_name("netem.sh")


def code_id() -> Dict[str, str]:
    """The code a run executes: the commit, the git tree of :data:`CODE_DIRS` and a hash
    of their uncommitted changes ("" when clean); installed outside a checkout, the
    package's version and a hash of its files.

    Returns:
        ``{"commit", "tree", "dirty"}``; ``tree`` and ``dirty`` decide reuse.
    """
    root = source_tree()
    if root is None:
        return installed_code_id()

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout

    trees = git("ls-tree", "HEAD", *CODE_DIRS)
    diff = git("diff", "HEAD", "--", *CODE_DIRS)
    untracked = git("ls-files", "--others", "--exclude-standard", "--", *CODE_DIRS)
    dirty = diff + untracked
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or "unknown",
            "tree": hashlib.sha256(trees.encode()).hexdigest()[:12],
            "dirty": hashlib.sha256(dirty.encode()).hexdigest()[:12] if dirty.strip() else ""}


def source_tree() -> Optional[Path]:
    """The git work tree the package is imported from, or None when it is installed.

    Git is asked from the package's folder, and its answer counts only when that tree's
    ``tagc/`` is this package: a wheel installed in a virtual environment that sits
    inside some work tree is still an installed package.

    Returns:
        the work tree's root, or None (not in one, or git missing).
    """
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=PACKAGE,
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not top or not (Path(top) / "tagc").is_dir():
        return None
    return Path(top) if (Path(top) / "tagc").resolve() == PACKAGE else None


def installed_code_id() -> Dict[str, str]:
    """:func:`code_id` of an installed package: its version, and a hash of the files of
    ``tagc`` (Python sources, shipped presets) and the ``_tagc`` extension.

    Returns:
        ``{"commit": "tagc <version>", "tree": hash, "dirty": ""}``.
    """
    from importlib import metadata

    import tagc
    from tagc.codec import _tagc, require_codec

    require_codec()

    h = hashlib.sha256()
    pkg = Path(tagc.__file__).resolve().parent
    files = sorted(p.relative_to(pkg.parent) for p in [*pkg.rglob("*.py"), *pkg.rglob("*.yaml")])
    for rel in files:
        h.update(str(rel).encode() + (pkg.parent / rel).read_bytes())
    h.update(Path(_tagc.__file__).read_bytes())
    try:
        version = metadata.version("tagc")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"commit": f"tagc {version}", "tree": h.hexdigest()[:12], "dirty": ""}


def shown(path: Path) -> str:
    """How a report records a path: relative to the current folder when it lies inside
    it (a committed report names no folder of the machine that ran it), else as given.

    Args:
        path: a file or folder.
    Returns:
        the path as text.
    """
    rel = os.path.relpath(Path(path).resolve())
    return rel if not rel.startswith("..") else str(path)


def run_meta(cmd: Sequence[str], configs: Dict[str, Any], code: Dict[str, str]) -> Dict[str, Any]:
    """What ``suite_run.json`` records of a run (quality_suite.py, compare_quality.py).

    Args:
        cmd: the run's command line.
        configs: everything besides the code that decides the result (reuse compares it).
        code: :func:`code_id`.
    Returns:
        the record.
    """
    return {"command": " ".join(shlex.quote(c) for c in cmd), "configs": configs, "code": code}


def reusable(folder: Path, meta: Dict[str, Any], done: str) -> bool:
    """Whether ``folder`` holds a finished run of the same configs and code."""
    path = folder / "suite_run.json"
    if not (path.is_file() and (folder / done).is_file()):
        return False
    old = json.loads(path.read_text())
    same = old.get("configs") == meta["configs"] and \
        {k: old["code"].get(k) for k in ("tree", "dirty")} == \
        {k: meta["code"][k] for k in ("tree", "dirty")}
    if not same:
        logger.warning("%s: ran other code or configs (%s); running again", folder,
                       old.get("code"))
    return same


def execute(cmd: List[str], folder: Path, meta: Dict[str, Any]) -> float:
    """Run ``cmd`` with its log in ``folder/train.log``; on success record ``meta``.

    Args:
        cmd: the command (run in the current folder).
        folder: the run's folder (created).
        meta: :func:`run_meta`'s record, written to ``suite_run.json`` once it ran.
    Returns:
        its wall time in seconds.
    Raises:
        RuntimeError: it failed (the log's tail in the message).
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "suite_run.json").unlink(missing_ok=True)
    logger.info("%s", meta["command"])
    t0 = time.perf_counter()
    with open(folder / "train.log", "w") as log:
        # faulthandler: a rank that dies of a signal leaves every thread's Python stack
        # in train.log (the teardown abort: DESIGN "Facts the code relies on")
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                           env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    if p.returncode != 0:
        tail = (folder / "train.log").read_text()[-3000:]
        raise RuntimeError(f"{folder} failed (exit {p.returncode}):\n{tail}")
    seconds = time.perf_counter() - t0
    (folder / "suite_run.json").write_text(json.dumps({**meta, "seconds": seconds}, indent=1))
    return seconds


def finished_run(cmd: List[str], folder: Path, meta: Dict[str, Any], *, report_only: bool,
                 reuse: bool) -> Optional[Dict[str, Any]]:
    """One run of a quality comparison (pp_quality.py, local_quality.py): train it, reuse
    its finished run of the same code and configs, or, with ``report_only``, only read it.

    Args:
        cmd, folder, meta: as :func:`execute`.
        report_only: train nothing; a run that never finished gives None.
        reuse: reuse a finished run of the same code and configs (:func:`reusable`).
    Returns:
        ``{"summary": summary.json, "curve": [(step, validation loss)], "record":
        suite_run.json}``, or None (``report_only`` and not finished).
    """
    if report_only:
        if not ((folder / "summary.json").is_file() and (folder / "suite_run.json").is_file()):
            logger.info("%s: not run, left out of the report", folder)
            return None
    elif not (reuse and reusable(folder, meta, "summary.json")):
        execute(cmd, folder, meta)
    return {"summary": json.loads((folder / "summary.json").read_text()),
            "curve": val_curve(folder),
            "record": json.loads((folder / "suite_run.json").read_text())}


def val_curve(folder: Path) -> List[Tuple[int, float]]:
    """A finished run's validation curve from its ``metrics.csv``.

    Args:
        folder: the run's ``--out_dir``.
    Returns:
        ``[(step, validation loss)]`` in the order evaluated.
    """
    with open(folder / "metrics.csv", newline="") as f:
        return [(int(r["iter"]), float(r["loss"])) for r in csv.DictReader(f)
                if r["kind"] == "val"]


def add_comparison_args(p: Any, tasks: Sequence[str], out_dir: str, doc: Path,
                        curves: Path) -> None:
    """The options every quality comparison script shares.

    Args:
        p: the ``argparse.ArgumentParser``.
        tasks: the script's tasks (``--tasks``, all by default).
        out_dir: the runs' default folder.
        doc: the document whose marked part takes the table.
        curves: the default path of the curves' figure.
    """
    p.add_argument("--tasks", nargs="+", default=list(tasks), choices=list(tasks))
    p.add_argument("--out_dir", default=out_dir)
    p.add_argument("--doc", default=str(doc))
    p.add_argument("--curves", default=str(curves))
    p.add_argument("--no-reuse", dest="reuse", action="store_false")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: the table and curves of the finished runs")


def split_passthrough(argv: Optional[Sequence[str]]) -> Tuple[List[str], List[str]]:
    """(this script's arguments, those after ``--`` for every training run).

    Args:
        argv: the command line (default sys.argv[1:]).
    Returns:
        the two lists.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def free_port() -> int:
    """A TCP port that is free in the root namespace (namespaces have their own ports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process under it, as a lost machine: torchrun's
    agent starts its workers in sessions of their own, so its process group would
    miss them.  Linux only (reads /proc)."""
    parent: Dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                # after the parenthesised name: the state, then the parent's pid
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, more = {pid}, {pid}
    while more:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def netem(net: list[str], *cmd: str, timeout: float = 60, check: bool = True) -> str:
    """Run ``tagc/train/netem.sh NET... CMD...``; its stdout (stderr logged as a warning).

    Args:
        net: the network options (prefix, hosts, rate, delay).
        *cmd: the netem.sh command and its arguments.
        timeout: seconds.
        check: raise RuntimeError when it fails.
    """
    r = subprocess.run(["bash", str(NETEM), *net, *cmd], capture_output=True, text=True,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"netem.sh {' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    if r.stderr.strip():
        logger.warning("%s", r.stderr.strip())
    return r.stdout
