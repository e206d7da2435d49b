"""Where a benchmark writes the report of one run, so that it can be committed.

Convention (``docs/runs/README.md``): every run whose figures a document quotes keeps
its report in the repository, ``docs/runs/<name>/`` (``report.md`` / ``results.json``
of ``bench_step.py``, ``time_to_loss.md`` / ``results.json`` of
``bench_time_to_loss.py``, ``collectives.json`` of ``bench_collectives.py``), and
the document (``docs/RESULTS.md``, ``docs/cost_model_runs.json``) names that folder.
The benchmarks' ``--out`` default is such a folder, named by the benchmark and the
UTC time it started: ``docs/runs/<kind>-<YYYYmmdd-HHMMSS>`` of the checkout.
How a report names a path is ``tagc.train.runs.shown``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Tuple

# the folder of committed run reports, relative to a checkout's root
RUNS = Path("docs") / "runs"


def run_dir(root: Path, kind: str, started: float = None) -> Path:
    """A new run's report folder: ``<root>/docs/runs/<kind>-<UTC date-time>``.

    Args:
        root: the checkout the benchmark script sits in.
        kind: what ran (``step``, ``time-to-loss``, ``collectives``).
        started: the run's start (seconds since the epoch; default now).
    Returns:
        the folder (not created).
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(started))
    return Path(root) / RUNS / f"{kind}-{stamp}"


def write_between(path: Path, text: str, marks: Tuple[str, str]) -> None:
    """Replace the part of the document ``path`` between the two marker lines ``marks``
    with ``text`` (the block appended when the markers are absent).

    Args:
        path: the document (created if missing).
        text: what goes between the markers.
        marks: the start and end markers (HTML comments, invisible when rendered).
    """
    old = path.read_text() if path.exists() else ""
    block = f"{marks[0]}\n{text}\n{marks[1]}"
    if marks[0] in old and marks[1] in old:
        head, rest = old.split(marks[0], 1)
        new = head + block + rest.split(marks[1], 1)[1]
    else:
        new = old + ("\n" if old else "") + block + "\n"
    path.write_text(new)


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write (its folder created) and close a matplotlib figure.

    Args:
        fig: the ``matplotlib.figure.Figure``.
        path: where the image goes.
    """
    import matplotlib.pyplot as plt
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def publish_comparison(text: str, doc: Path, marks: Tuple[str, str],
                       figure: Callable[[], None]) -> None:
    """A quality comparison's outputs: print its table, put it between the markers of
    ``doc`` (:func:`write_between`) and draw its curves.

    Args:
        text: the markdown table.
        doc: the document.
        marks: its markers.
        figure: draws and saves the curves.
    """
    print(text)
    write_between(doc, text, marks)
    figure()
