"""Nothing lost on resume (tagc/train/checkpoint.py, tagc/checkpoint.py): checkpoints
kept and checksummed, a corrupted or truncated file refused by name, a non-finite run
stopped before it saves, another TAGC preset refused naming the knob, and a checkpoint
resumed on another FSDP version or world size with its feedback state where it belongs.

The state a resumed run holds is read back from the checkpoint it writes when it resumes
at its last step (``--max_iters`` = the saved step: it loads, evaluates and saves again,
with no step between), and compared, by parameter, with the one it loaded.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import tagc.train.data as token_data
from dist_helpers import run_dist
from tagc import positions
from tagc.train.checkpoint import checkpoints, choose
from tagc.train.loop import main

REPO = Path(__file__).resolve().parent.parent
FAST = ["--progress=false", "--tensorboard=false", "--tokenizer=byte", "--batch_size=2",
        "--block_size=32", "--eval_iters=1", "--eval_interval=1000", "--log_interval=100",
        "--warmup_iters=0"]

pytestmark = [pytest.mark.codec, pytest.mark.dist]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("token-cache")
    token_data.prepare(token_data.get_source("stdlib"), token_data.byte_tokenizer(), d)
    return d


def _mains(rank: int, world: int, argvs: List[List[str]]) -> List[Any]:
    """Each argv's run, or the text of the error it raised (the runs go on)."""
    out = []
    for argv in argvs:
        try:
            out.append(main(argv))
        except (ValueError, RuntimeError, FileNotFoundError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def _run(tmp: Path, cache: Path, name: str, *extra: str) -> List[str]:
    return [f"--out_dir={tmp / name}", f"--cache_dir={cache}", *FAST, *extra]


def _tagc_rows(folder: Path, out: Path) -> Dict[str, Any]:
    """(layout record, {(unit, buffer): rows}) of a training checkpoint's TAGC state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(folder, out)
    sd = torch.load(out, weights_only=False)["tagc"]
    rows = {(u, k): v for u, e in sd["units"].items() for k, v in e.items()
            if torch.is_tensor(v) and v.dim() == 2}
    return {"layout": json.loads(sd["layout"]), "rows": rows}


def _owed(state: Dict[str, Any], unit: str) -> torch.Tensor:
    """What a unit's residual rows owe the averaged gradient, in the canonical order
    (fp32 residuals: ``residual_code=none``)."""
    entry = state["layout"]["units"][unit]
    _, total = positions.canonical_offsets(entry["layout"])
    acc = torch.zeros(total, dtype=torch.float64)
    held = state["rows"][unit, "residual"]
    for r in range(held.shape[0]):
        idx = positions.buffer_index(entry, "residual", r)
        keep = idx >= 0
        acc.index_add_(0, idx[keep], held[r][keep].double())
    return acc * entry["weight"]


EXACT = "--tagc_set=residual_code=none"


def test_feedback_state_follows_fsdp_version_and_world_size(tmp_path: Path,
                                                            cache_dir: Path) -> None:
    """FSDP1 -> FSDP2 -> FSDP1 on 2 ranks, and FSDP2 2 ranks -> 1 rank: every resumed
    checkpoint owes the averaged gradient what the one it came from owed, element by
    element (to float32 rounding), though FSDP puts the elements elsewhere."""
    common = ["--tagc=tagc-balanced", EXACT]
    run_dist(_mains, 2, [_run(tmp_path, cache_dir, "a", "--fsdp=1", "--max_iters=3",
                              *common)], timeout=240)
    states = {}
    src = choose(tmp_path / "a" / "ckpt", "latest")
    states["fsdp1"] = _tagc_rows(src, tmp_path / "a1.pt")
    hops = [("fsdp2", "--fsdp=2", 2), ("back", "--fsdp=1", 2)]
    for tag, flag, world in hops:
        res = run_dist(_mains, world, [_run(tmp_path, cache_dir, "a", flag, "--max_iters=3",
                                            "--init_from=resume", *common)], timeout=240)
        assert isinstance(res[0][0], dict), res[0][0]
        states[tag] = _tagc_rows(choose(tmp_path / "a" / "ckpt", "latest"),
                                 tmp_path / f"a-{tag}.pt")
    # and one rank of FSDP2 from the FSDP2 checkpoint of 2 ranks
    res = run_dist(_mains, 2, [_run(tmp_path, cache_dir, "a", "--fsdp=2", "--max_iters=3",
                                    "--init_from=resume", *common)], timeout=240)
    res = run_dist(_mains, 1, [_run(tmp_path, cache_dir, "a", "--fsdp=2", "--max_iters=3",
                                    "--init_from=resume", *common)], timeout=240)
    assert isinstance(res[0][0], dict), res[0][0]
    states["one"] = _tagc_rows(choose(tmp_path / "a" / "ckpt", "latest"), tmp_path / "a-1.pt")
    units = [u for (u, k) in states["fsdp1"]["rows"] if k == "residual"]
    assert units
    for u in units:
        want = _owed(states["fsdp1"], u)
        assert want.abs().sum() > 0
        for tag in ("fsdp2", "back", "one"):
            got = _owed(states[tag], u)
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-9), (tag, u)
    # the layouts really differ for a unit with a bias (the reason for the mapping)
    moved = [u for u in units
             if not torch.equal(positions.canonical_index(states["fsdp1"]["layout"]["units"][u]
                                                          ["layout"]),
                                positions.canonical_index(states["fsdp2"]["layout"]["units"][u]
                                                          ["layout"])[:len(positions.canonical_index(
                                                              states["fsdp1"]["layout"]["units"][u]["layout"]))])]
    assert moved
    assert states["one"]["rows"][units[0], "residual"].shape[0] == 1


def test_kept_checksummed_and_refused_by_name(tmp_path: Path, cache_dir: Path) -> None:
    """Two checkpoints kept of three saves; a flipped byte in a .distcp file is refused
    naming the file, and --resume_from previous goes on from the one before; a
    truncated train_state.json is named; another preset is refused naming the knob
    before DCP reads a tensor (tagc-lean has no residual to read)."""
    base = ["--fsdp=2", "--tagc=tagc-balanced", "--ckpt_interval=2"]
    run_dist(_mains, 2, [_run(tmp_path, cache_dir, "k", "--max_iters=6", *base),
                         _run(tmp_path, cache_dir, "lean", "--max_iters=2", "--fsdp=2",
                              "--tagc=tagc-lean")], timeout=240)
    root = tmp_path / "k" / "ckpt"
    assert [it for it, _ in checkpoints(root)] == [4, 6]
    newest = choose(root, "latest")
    sums = json.loads((newest / "checksums.json").read_text())
    assert ".metadata" in sums and "train_state.json" in sums and "rank1.pt" in sums
    shard = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    for i in range(100, min(len(data), 4196)):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    res = run_dist(_mains, 2, [
        _run(tmp_path, cache_dir, "k", "--max_iters=7", "--init_from=resume", *base),
        _run(tmp_path, cache_dir, "k", "--max_iters=5", "--init_from=resume",
             "--resume_from=previous", *base),
        _run(tmp_path, cache_dir, "lean", "--max_iters=4", "--init_from=resume", "--fsdp=2",
             "--tagc=tagc-balanced"),
        _run(tmp_path, cache_dir, "k", "--max_iters=7", "--init_from=resume", "--fsdp=2",
             "--tagc=tagc-balanced", "--tagc_set=quant_block=128"),
    ], timeout=300)
    corrupted, previous, lean, block = res[0]
    assert isinstance(corrupted, str) and shard.name in corrupted and "corrupted" in corrupted
    assert "--resume_from previous" in corrupted
    assert isinstance(previous, dict) and previous["iters"] == 5, previous
    assert isinstance(lean, str) and "another TAGC config" in lean and "Missing key" not in lean
    assert "error_feedback" in lean or "quant_format" in lean or "mode" in lean, lean
    assert isinstance(block, str) and "quant_block: saved 64, now 128" in block, block
    assert "--tagc_set=quant_block=64 restores" in block, block  # the way back, named
    # a truncated train_state.json names the file
    newest = choose(root, "latest")
    (newest / "train_state.json").write_text('{"iter_num": 5, "wor')
    res = run_dist(_mains, 1, [_run(tmp_path, cache_dir, "k", "--max_iters=7",
                                    "--init_from=resume", *base)], timeout=120)
    assert "train_state.json" in res[0][0] and "unreadable" in res[0][0], res[0][0]


def test_nonfinite_run_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path,
                                                                cache_dir: Path) -> None:
    """A learning rate that blows the loss up within a few steps: the run stops with
    an error naming the step, and the checkpoints it keeps are those made while the
    loss was finite."""
    bad = ["--fsdp=2", "--tagc=tagc-balanced", "--ckpt_interval=1", "--learning_rate=1e4",
           "--min_lr=0", "--grad_clip=0", "--max_iters=8", "--keep_checkpoints=3"]
    res = run_dist(_mains, 2, [_run(tmp_path, cache_dir, "nan", *bad),
                               _run(tmp_path, cache_dir, "nan2", *bad,
                                    "--nonfinite_patience=100")], timeout=240)
    stop, patient = res[0]
    assert isinstance(stop, str) and "not finite at iter" in stop, stop
    kept = [it for it, _ in checkpoints(tmp_path / "nan" / "ckpt")]
    stopped_at = int(stop.split("not finite at iter ")[1].split()[0])
    assert kept and max(kept) < stopped_at
    # with patience it trains on, but saves nothing past the first non-finite step
    assert isinstance(patient, dict) and math.isnan(patient["final_val_loss"])
    assert max(it for it, _ in checkpoints(tmp_path / "nan2" / "ckpt")) < stopped_at


def test_a_checkpoint_written_before_checksums_loads(tmp_path: Path, cache_dir: Path) -> None:
    """tests/data/ckpt-v2-fsdp1: 2 ranks, FSDP1, tagc-balanced, 3 steps, written by the
    single-folder code (no checksums, TAGC state v2).  It resumes on its own shape with
    one warning, the residuals restored bit for bit; on another shape it is refused
    (no layout stored), naming why."""
    run = tmp_path / "legacy"
    shutil.copytree(REPO / "tests" / "data" / "ckpt-v2-fsdp1", run / "ckpt")
    # written when tagc-balanced's codes took a scale per 256 values
    args = ["--fsdp=1", "--tagc=tagc-balanced", "--tagc_set=min_numel=1024,quant_block=256",
            "--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
            "--init_from=resume"]
    res = run_dist(_legacy, 2, _run(tmp_path, cache_dir, "legacy", *args, "--max_iters=3"),
                   timeout=240)
    assert res[0]["iters"] == 3 and res[0]["warned"] == 1, res[0]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(REPO / "tests" / "data" / "ckpt-v2-fsdp1", tmp_path / "v2.pt")
    before = torch.load(tmp_path / "v2.pt", weights_only=False)["tagc"]["units"]
    after = _tagc_rows(choose(run / "ckpt", "latest"), tmp_path / "v3.pt")["rows"]
    compared = 0
    for unit, entry in before.items():
        if entry.get("has_residual"):
            assert torch.equal(entry["residual"], after[unit, "residual"]), unit
            compared += 1
    assert compared
    shutil.copytree(REPO / "tests" / "data" / "ckpt-v2-fsdp1", tmp_path / "legacy2" / "ckpt")
    res = run_dist(_mains, 2, [_run(tmp_path, cache_dir, "legacy2", *args, "--fsdp=2",
                                    "--max_iters=3")], timeout=240)
    assert "predates stored layouts" in res[0][0], res[0][0]


def _legacy(rank: int, world: int, argv: List[str]) -> Dict[str, Any]:
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = main(argv)
    out["warned"] = sum("checksums.json" in str(w.message) for w in seen)
    return out


@pytest.mark.slow
def test_sigterm_saves_then_exits(tmp_path: Path, cache_dir: Path) -> None:
    """torchrun, 2 ranks, a long run: SIGTERM to the launcher (as a scheduler's
    preemption) reaches every rank, which agree at the end of the step, save a
    checkpoint of that step and exit."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from tagc.train.runs import free_port
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "tagc.train",
           *_run(tmp_path, cache_dir, "term", "--fsdp=2", "--tagc=tagc-balanced",
                 "--max_iters=100000", "--log_interval=1")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.time() + 120
            while "iter 3: loss" not in log.read_text():
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert rc != 0 and "SIGTERM, checkpoint saved" in text, text[-3000:]
    kept = checkpoints(tmp_path / "term" / "ckpt")
    assert kept and kept[-1][0] >= 3, kept
    saved_at = int(text.split(": SIGTERM, checkpoint saved")[0].rsplit("iter ", 1)[1])
    assert kept[-1][0] == saved_at
