"""Every command the docs show still exists and starts: each ``scripts/...`` path that
README.md and docs/**/*.md name is a file of the checkout, and each Python script and
``python -m tagc...`` module among them answers ``--help`` (run from a folder outside
the checkout, as a user's shell would be anywhere).  And no code, doc or data file
names a folder of one development machine (figures trace to the repository).

A moved or renamed script fails here with the document and line that still name the
old path.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

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


@pytest.mark.parametrize("cmd", _commands(), ids=lambda c: c[-2] if c[1] != "-m" else c[2])
def test_every_command_answers_help(cmd: List[str], tmp_path: Path) -> None:
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
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
