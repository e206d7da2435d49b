"""The README is the front door: short, its commands the ones CI and users run, its links
landing on sections that exist, its quick start a program that runs as printed, and no
history in it (measurements, with their dates and commits, live in docs/RESULTS.md)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_LINES, MAX_WORDS = 120, 1100
# the line the quick start prints on rank 0
QUICK_LINE = re.compile(r"loss (?P<first>[\d.]+) -> (?P<last>[\d.]+) \(exact weights "
                        r"(?P<val>[\d.]+)\); sent (?P<sent>[\d.]+) MB of plain FSDP's "
                        r"(?P<plain>[\d.]+) MB; checkpoint in ckpt/")


def fenced(text: str, lang: str) -> List[str]:
    """The bodies of the ``` blocks of one language."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> Set[str]:
    """Every heading anchor of a markdown file (fenced blocks skipped)."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def test_it_is_short() -> None:
    assert len(README.splitlines()) <= MAX_LINES
    assert len(README.split()) <= MAX_WORDS


def test_the_commands_are_the_ones_ci_and_users_run() -> None:
    """The test command is the one ``.ci/run`` runs; the first command installs and
    trains 2 ranks with a TAGC preset on the built-in corpus."""
    (commands,) = fenced(README, "bash")
    lines = [ln for ln in commands.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 2, lines
    main, tests = lines
    assert "torchrun --standalone --nproc_per_node 2 scripts/train_gpt2.py --tagc" in main
    assert main.startswith("pip install torch==2.13.0 && pip install -e '.[test]' && ")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in [ln.strip() for ln in ci], (tests, "not a line of .ci/run")


def test_slug_matches_github() -> None:
    assert slug("Time to plain FSDP's loss on a 200 Mbit link") == \
        "time-to-plain-fsdps-loss-on-a-200-mbit-link"
    assert slug("HSDP with more nodes: R = 2, 3, 4 nodes x 1 rank") == \
        "hsdp-with-more-nodes-r--2-3-4-nodes-x-1-rank"
    assert slug("GPT-2 124M (`fsdp_overlap`)") == "gpt-2-124m-fsdp_overlap"


def test_every_link_lands() -> None:
    """Each relative link names a file of the checkout, and each #anchor a heading of it."""
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [ln for ln in links if not re.match(r"[a-z]+://", ln)]
    assert any("RESULTS.md#" in ln for ln in local)
    broken: Dict[str, str] = {}
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        if not target.exists():
            broken[link] = "no such file"
        elif anchor and anchor not in anchors(target):
            broken[link] = "no such heading"
    assert broken == {}, broken


def test_no_history_outside_the_links() -> None:
    """No dates, issue numbers or commit ids in the README's text; the results' links may
    name the sections that carry them."""
    text = re.sub(r"\]\([^)]*\)", "]()", README)
    assert re.findall(r"\b20\d\d-[01]\d-[0-3]\d\b", text) == []
    assert re.findall(r"\bissues? #?\d+|(?<![\w&])#\d+\b", text, re.IGNORECASE) == []
    words = set(re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text))
    if words and (ROOT / ".git").exists():
        out = subprocess.run(["git", "-C", str(ROOT), "cat-file", "--batch-check"],
                             input="\n".join(sorted(words)) + "\n", capture_output=True,
                             text=True).stdout
        assert " commit " not in out, out


def test_the_quoted_quick_start_line_is_what_the_program_prints() -> None:
    """The line the README quotes after the program parses as the program's format."""
    quoted = README.split("```python", 1)[1].split("```", 2)[1]
    assert QUICK_LINE.search(" ".join(quoted.split())), "the quoted line is not the format"


@pytest.mark.dist
@pytest.mark.codec
def test_the_quick_start_runs_on_two_ranks(tmp_path: Path) -> None:
    """The README's program, pasted as it is, trains on 2 ranks under torchrun: the loss
    falls, TAGC sends fewer bytes than plain FSDP, the checkpoint is written and read
    back; and it prints the numbers the README quotes (the run is seeded)."""
    (program,) = fenced(README, "python")
    (tmp_path / "quickstart.py").write_text(program)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", "quickstart.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = QUICK_LINE.search(p.stdout)
    assert got, p.stdout
    assert float(got["last"]) < float(got["first"]) / 4
    assert float(got["sent"]) < float(got["plain"]) / 3
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    quoted = QUICK_LINE.search(" ".join(README.split("```python", 1)[1].split()))
    assert (got["sent"], got["plain"]) == (quoted["sent"], quoted["plain"])
    for key in ("first", "last", "val"):
        assert abs(float(got[key]) - float(quoted[key])) <= 0.05, (key, got[0], quoted[0])
