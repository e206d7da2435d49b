"""The library's sources say what the code does, not when or why it changed: no issue
numbers, dates or commit hashes in ``tagc/``, ``tagc_hook.py``, ``csrc/``, ``cuda/`` and
``configs/``.  History lives in git and CHANGELOG.md; a comment that cites it goes stale
the day it is written and tells a reader nothing the code does not."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the library: the package, its public face, the C codec, the CUDA kernels, the presets
LIBRARY = [ROOT / "tagc", ROOT / "tagc_hook.py", ROOT / "csrc", ROOT / "cuda", ROOT / "configs"]
TEXT_SUFFIXES = {".py", ".c", ".h", ".cu", ".cuh", ".cpp", ".hpp", ".yaml", ".yml", ".sh",
                 ".md", ".txt", ".cfg", ".toml"}

# "issue 42", "issues 39 and 42", "Issue #7"; a bare "#42" not preceded by a word
# character or "&" (an HTML entity such as "&#39;" is not a reference)
ISSUE = re.compile(r"\bissues?\s+#?\d+|(?<![\w&])#\d+\b", re.IGNORECASE)
# ISO dates: 2026-11-27
DATE = re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b")
# candidate commit ids: 7-40 lowercase hex digits as a whole word with a letter and a
# digit in it (C hex constants carry "0x" and so never form a whole word of this kind);
# only those that git resolves to a commit of this repository count
HEX_WORD = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def library_files() -> List[Path]:
    """Every text source file of the library (build products and caches excluded)."""
    out: List[Path] = []
    for top in LIBRARY:
        paths = [top] if top.is_file() else sorted(top.rglob("*"))
        out += [p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES
                and "__pycache__" not in p.parts]
    return out


def _hits(pattern: re.Pattern, files: List[Path]) -> List[str]:
    """``path:line: text`` for every match of ``pattern``."""
    found = []
    for path in files:
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    return found


def commits_among(words: Set[str]) -> Set[str]:
    """The words that name a commit of this checkout (``git cat-file --batch-check``)."""
    if not words:
        return set()
    ordered = sorted(words)
    out = subprocess.run(["git", "-C", str(ROOT), "cat-file", "--batch-check"],
                         input="\n".join(ordered) + "\n", capture_output=True, text=True,
                         check=True).stdout.splitlines()
    # one answer line per query, in order: "<sha> commit <size>" or "<word> missing"
    return {w for w, line in zip(ordered, out) if line.split()[1:2] == ["commit"]}


def test_the_scan_sees_the_library() -> None:
    """The walk finds the sources it is meant to police (a wrong root would pass vacuously)."""
    names = {p.relative_to(ROOT).as_posix() for p in library_files()}
    assert {"tagc/__init__.py", "tagc_hook.py", "csrc/tagc.h",
            "configs/tagc-balanced.yaml"} <= names


def test_patterns_catch_history_and_spare_code() -> None:
    """Each pattern flags what it is for and leaves ordinary code alone."""
    for text in ("until issue 42", "Issue #7", "issues 39 and 42", "see #42"):
        assert ISSUE.search(text), text
    for text in ("x = a[0]  # 42 entries", "&#39;", "#define N 42", "#include <x.h>"):
        assert not ISSUE.search(text), text
    assert DATE.search("measured 2026-11-27 at load 2")
    assert not DATE.search("shape 2026-11 x 27")
    assert HEX_WORD.findall("commit 1913caf and 4542df6") == ["1913caf", "4542df6"]
    assert HEX_WORD.findall("0xdeadbeef 0x7fffffff c0ffee12 1234567 abcdefg") == ["c0ffee12"]


def test_no_issue_numbers_in_the_library() -> None:
    hits = _hits(ISSUE, library_files())
    assert hits == [], "issue numbers in the library (history lives in git):\n" + "\n".join(hits)


def test_no_dates_in_the_library() -> None:
    hits = _hits(DATE, library_files())
    assert hits == [], "dates in the library (history lives in git):\n" + "\n".join(hits)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs git and a checkout to tell commit ids from other hex words")
def test_no_commit_ids_in_the_library() -> None:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=9", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the resolver itself: HEAD's short id is a commit, a hex word of no object is not
    assert commits_among({head, "abcdef0123"}) == {head}
    where: Dict[str, List[str]] = {}
    for path in library_files():
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for word in HEX_WORD.findall(line):
                where.setdefault(word, []).append(f"{path.relative_to(ROOT)}:{no}")
    commits = commits_among(set(where))
    hits = [f"{w} at {', '.join(where[w])}" for w in sorted(commits)]
    assert hits == [], "commit ids in the library (history lives in git):\n" + "\n".join(hits)
