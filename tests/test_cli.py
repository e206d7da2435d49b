"""The training command line as a user meets it: ``python -m tagc.train`` and
``scripts/train_gpt2.py``.

A bad setting (unknown key, bad value, a preset this run cannot take) is reported once,
by rank 0, naming the option that fixes it, before any rank loads data; ``--help``
opens with examples and the shipped presets; usage lines and the "start it with
torchrun" hint name the command that was run; the run ends with TAGC's one-line summary.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

import tagc.train.data as token_data
from dist_helpers import run_dist
from tagc import presets
from tagc.train.config import entry_point, parse_config
from tagc.train import loop
from tagc.train.loop import main

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "train_gpt2.py"

# the two entry points: (argv prefix, what the usage line and torchrun hint name)
ENTRIES = {"module": ([sys.executable, "-m", "tagc.train"], "python -m tagc.train",
                      "-m tagc.train"),
           "script": ([sys.executable, str(SCRIPT)], str(SCRIPT), str(SCRIPT))}


def _clean_env() -> Dict[str, str]:
    """This environment without torchrun's variables (a test run may sit inside one)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- in process

def test_config_errors_name_the_fix(tmp_path: Path) -> None:
    """Each message names the option or field to change, with the nearest known name."""
    y = tmp_path / "run.yaml"
    y.write_text("max_iter: 3\n")
    mine = tmp_path / "mine.yaml"
    mine.write_text("mode: quant\nquant_formt: int4\n")
    cases: List[Tuple[List[str], str]] = [
        (["--max_iter=3"], "unknown config key '--max_iter'; did you mean --max_iters?"),
        ([str(y)], "unknown config key 'max_iter'; did you mean max_iters?"),
        (["--tagc", "tagc-balanced", "--tagc_set", "thta=0.9"],
         "--tagc_set: unknown field 'thta'; did you mean theta?"),
        (["--tagc", str(mine)], "unknown field 'quant_formt'; did you mean quant_format?"),
        (["--tagc", "tagc-full"],
         "--tagc tagc-full quantizes FSDP2's parameter all-gathers (gather=int8): run "
         "with --fsdp 2"),
        (["--tagc", "tagc-balanced", "--tagc_set", "gather=int4"],
         "--tagc tagc-balanced --tagc_set gather=int4 quantizes FSDP2's parameter "
         "all-gathers (gather=int4): run with --fsdp 2"),
        (["--tagc", "tagc-local", "--fsdp", "2"], "run with --fsdp 2 --replicas R"),
        (["--tagc", "tagc-pp-int8"], "run with --pp 2 --tie_weights=false"),
        (["--pp=2", "--tie_weights=false", "--tagc", "tagc-balanced"],
         "a tagc-pp-* preset, not 'tagc-balanced'"),
        (["--pp=2", "--tie_weights=false", "--tagc", "tagc-pp-int8", "--tagc_set",
          "formt=int4"], "did you mean format?"),
        (["--tagc", "tagc-balanced", "--tagc_set", "quant_block=0"],
         "(--tagc tagc-balanced --tagc_set quant_block=0)"),
        (["--keep_checkpoints=0"], "--keep_checkpoints must be >= 1, got 0"),
        (["--replicas=2"], "--replicas > 1 (HSDP) needs --fsdp 2"),
        (["--min_lr=1"], "--min_lr must not exceed --learning_rate"),
    ]
    for argv, expected in cases:
        with pytest.raises(ValueError) as err:
            parse_config(argv)
        assert expected in str(err.value), (argv, str(err.value))
    # what the refusals leave open is accepted, FSDP2 presets on FSDP2
    assert parse_config(["--tagc", "tagc-full", "--fsdp", "2"]).tagc == "tagc-full"
    assert parse_config(["--tagc", "tagc-full", "--tagc_set", "gather=none"]).fsdp == 1
    assert parse_config(["--tagc", "tagc-local", "--fsdp", "2", "--replicas", "2"]).replicas == 2


def test_every_shipped_preset_has_a_purpose() -> None:
    names = presets.names()
    assert set(presets.PURPOSES) == set(names)
    assert all(presets.purpose(n) for n in names)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_config_error_is_printed_by_rank_0_only(rank: str, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    """main() on the command line: exit 2 on every rank, the message on rank 0 only."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(loop, "QUIET_RANK_DELAY_S", 0.0)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--max_iter=3"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    command = entry_point()[0]  # under pytest: python -m tagc.train
    if rank == "0":
        assert err.splitlines() == [
            f"usage: {command} [YAML ...] [--KEY VALUE ...]",
            f"{command}: error: unknown config key '--max_iter'; did you mean --max_iters? "
            f"({command} --help lists them)"]
    else:
        assert err == ""


# --------------------------------------------------------------------------- subprocesses

@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_help_and_launch_hint_name_the_command(entry: str, tmp_path: Path) -> None:
    """--help: the usage line, three examples of this command, the presets by purpose;
    without torchrun: how to start this command under it."""
    argv, command, target = ENTRIES[entry]
    r = subprocess.run([*argv, "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=_clean_env())
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0] == f"usage: {command} [YAML ...] [--KEY VALUE ...]"
    head = r.stdout[:r.stdout.index("options:")]
    examples = [ln for ln in head.splitlines() if target in ln and "torchrun" in ln
                or ln.strip().startswith(target)]
    assert len(examples) == 3, head
    assert head.index("examples:") < head.index("presets")
    for name in presets.names():
        assert re.search(rf"^  {re.escape(name)} +{re.escape(presets.purpose(name))}$", head,
                         re.M), name

    r = subprocess.run([*argv, "--max_iters=1"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env=_clean_env())
    assert r.returncode == 1
    assert r.stderr.startswith(f"{command}: start it with torchrun")
    assert f"torchrun --standalone --nproc_per_node 2 {target} [options]" in r.stderr
    other = ENTRIES["script" if entry == "module" else "module"][2]
    assert other not in r.stderr


@pytest.mark.dist
@pytest.mark.parametrize("case", ["cli", "yaml", "tagc_set", "fsdp"])
def test_torchrun_config_error_once_before_data(case: str, tmp_path: Path) -> None:
    """Two ranks under torchrun: the message once, each rank exiting 2, no worker
    traceback, no data loaded."""
    (tmp_path / "run.yaml").write_text("max_iter: 3\n")
    args, expected = {
        "cli": (["--max_iter=3"], "did you mean --max_iters?"),
        "yaml": (["run.yaml"], "unknown config key 'max_iter'; did you mean max_iters?"),
        "tagc_set": (["--tagc", "tagc-balanced", "--tagc_set", "thta=0.9"],
                     "--tagc_set: unknown field 'thta'; did you mean theta?"),
        "fsdp": (["--tagc", "tagc-full"], "(gather=int8): run with --fsdp 2"),
    }[case]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", "-m", "tagc.train",
           f"--out_dir={tmp_path / 'out'}", f"--cache_dir={tmp_path / 'cache'}",
           "--progress=false", *args]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                       env=_clean_env())
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert out.count(expected) == 1, out[-3000:]
    assert out.count("python -m tagc.train: error:") == 1, out[-3000:]
    # torchrun's report: rank 0 exits 2 first, rank 1 (waiting to let it print) exits 2
    # too or is stopped by torchrun
    exits = re.findall(r"rank\s*:\s*(\d) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", out)
    assert ("0", "2") in exits and {code for _, code in exits} <= {"2", "-15"}, out[-3000:]
    assert "tagc/train/" not in out, out[-3000:]  # no traceback from a worker
    assert "data:" not in out and not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------- summary

class _Lines(logging.Handler):
    """Keeps the training log's lines (installed before setup(), which then adds none)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run_logged(rank: int, world: int, argv: List[str]) -> Tuple[Dict[str, Any], List[str]]:
    handler = _Lines()
    log = logging.getLogger("tagc.train")
    log.addHandler(handler)
    log.propagate = False
    try:
        return main(argv), handler.lines
    finally:
        log.removeHandler(handler)


SUMMARY = re.compile(r"^TAGC tagc-balanced: (\d+)/(\d+) units compressed \((\d+)% of params\), "
                     r"sent ([\d.]+) MB of ([\d.]+) MB \(([\d.]+)% saved\), "
                     r"feedback ([\d.]+) B/param$")


@pytest.mark.codec
@pytest.mark.dist
def test_run_ends_with_the_tagc_summary(tmp_path: Path) -> None:
    """A tiny 2-rank run logs TAGCState.summary() once, on rank 0, after its numbers;
    the line agrees with the run's summary.json figures."""
    cache = tmp_path / "cache"
    token_data.prepare(token_data.get_source("stdlib"), token_data.byte_tokenizer(), cache)
    argv = [f"--out_dir={tmp_path / 'run'}", f"--cache_dir={cache}", "--tagc=tagc-balanced",
            "--progress=false", "--tokenizer=byte", "--batch_size=2", "--block_size=32",
            "--eval_iters=1", "--eval_interval=1000", "--max_iters=2", "--warmup_iters=0",
            "--save_checkpoint=false", "--tensorboard=false"]
    (s0, lines0), (_, lines1) = run_dist(_run_logged, 2, argv, timeout=240)
    assert any(ln.startswith("data: ") for ln in lines0)  # the line the refusals precede
    found = [SUMMARY.match(ln) for ln in lines0 if ln.startswith("TAGC ")]
    assert len(found) == 1 and found[0] is not None, lines0[-3:]
    assert not any(ln.startswith("TAGC ") for ln in lines1)  # rank 1 logs warnings only
    assert lines0[-1].startswith("TAGC ") and lines0[-2].startswith("final: ")
    comp, units, share, sent, plain, saved, feedback = found[0].groups()
    assert 0 < int(comp) <= int(units) and 50 <= int(share) <= 100
    assert float(sent) == pytest.approx(s0["bytes_sent"] / 1e6, abs=0.051)
    assert float(plain) == pytest.approx(s0["bytes_uncompressed"] / 1e6, abs=0.051)
    assert float(saved) == pytest.approx(s0["saved_pct"], abs=0.051)
    assert 50 < float(saved) < 100
    assert float(feedback) == pytest.approx(s0["feedback_bytes_per_param"], abs=0.0051)
