"""The training script's torchft mode (tagc/train/ft.py, docs/TORCHFT.md).

Two replica groups of ``torchrun -m tagc.train --ft_lighthouse`` under a Lighthouse in
this process: one is killed with SIGKILL mid-run, the other keeps committing steps
alone, the killed one is started again, heals from its peer and rejoins, and both end
the run on the same model.  Beside it: the state a healing group loads, and the
settings the mode refuses.
"""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

pytest.importorskip("torchft", reason="torchft not installed (pip install tagc[ft])")

from tagc.train.config import parse_config  # noqa: E402
from tagc.train.runs import free_port, kill_tree  # noqa: E402

LOG_INTERVAL = 5
# a small GPT-2: about 25 ms a step alone on 2 cores
SMALL = ["--fsdp=2", "--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=32",
         "--batch_size=4", "--tokenizer=byte", "--threads=1", "--progress=false",
         "--eval_iters=2", "--eval_interval=100000", f"--log_interval={LOG_INTERVAL}",
         "--warmup_iters=10", "--tensorboard=false", "--timeout=20"]
# steps of the run: the survivor must still be training alone when the restarted
# group (imported before the kill, tests/ft_gate.py) has built its model and joined,
# about a second; alone it takes about 100 steps a second: the rejoin is checked,
# not assumed
STEPS = 400


# the kill test's modes: (preset options, steps per exchange, a fresh group's step at
# its first exchange, steps no committed exchange covers); local steps: TAGC's outer
# loop, two fragments (one synced every 4 steps, from step 8), streamed (each vote a
# step after its launch): steps 1-4 precede the first sync, and the sync launched at
# the last step is never voted
MODES = {"per-step": (["--tagc=tagc-balanced"], 1, 0, 0),
         "local-steps": (["--tagc=tagc-local",
                          "--tagc_set=outer_every=8,outer_fragments=2,outer_overlap=1"],
                         4, 8, 8)}


def _replica(tmp_path: Path, lighthouse: str, rid: int, tag: str, preset: List[str],
             gate: "Path | None" = None, steps: int = STEPS,
             out: str = "out") -> "tuple[Any, Path]":
    """One replica group: torchrun with one ``tagc.train`` process, or (``gate``) one
    that imports first and trains once the file ``gate`` exists; ``steps`` steps,
    its output under ``tmp_path/out``."""
    log = tmp_path / f"replica{rid}-{tag}.log"
    target = ["-m", "tagc.train"] if gate is None else \
        [str(Path(__file__).with_name("ft_gate.py")), str(gate)]
    args = ["torchrun", "--standalone", "--nproc_per_node=1", *target, *SMALL,
            *preset, f"--ft_lighthouse={lighthouse}", f"--ft_replica={rid}",
            f"--max_iters={steps}", f"--out_dir={tmp_path / out}",
            f"--cache_dir={tmp_path / 'cache'}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    with open(log, "w") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=tmp_path)
    return proc, log


def _lighthouse(tmp_path: Path, min_replicas: int) -> Any:
    """torchft's Lighthouse in this process (a replica is dropped after 1 s without a
    heartbeat), and the token cache the replicas share under ``tmp_path``."""
    from torchft._torchft import LighthouseServer

    import tagc.train.data as token_data

    token_data.prepare(token_data.get_source("stdlib"), token_data.byte_tokenizer(),
                       tmp_path / "cache")
    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=1000,
                            heartbeat_timeout_ms=1000)


def _wait_for(pattern: str, log: Path, procs: List[Any], seconds: float) -> "re.Match[str]":
    deadline = time.monotonic() + seconds
    while True:
        m = re.search(pattern, log.read_text(errors="replace"), re.M)
        if m:
            return m
        for p in procs:
            assert p.poll() is None, f"a replica exited ({p.returncode}):\n" + \
                log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"no {pattern!r} in {seconds} s:\n" + \
            log.read_text(errors="replace")[-3000:]
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.codec
@pytest.mark.parametrize("mode", list(MODES))
def test_a_killed_replica_group_rejoins_heals_and_the_run_ends(tmp_path: Path,
                                                                mode: str) -> None:
    """Replica group 1 is SIGKILLed once both have committed an exchange together
    (each step's gradients, or with local steps a fragment's outer sync every 4th
    step through TAGC's FTLocalSteps); group 0 commits alone (its quorum shrinks to
    1); group 1 restarted from scratch heals from group 0 at its step (torchft's
    recovery: model, optimizer, step, the outer anchor, momentum and counters) and
    both commit the rest
    together; both end at the same step with the same validation loss (the same
    weights), and the restarted group never committed alone."""
    preset, every, first, uncovered = MODES[mode]
    lh = _lighthouse(tmp_path, min_replicas=1)
    procs: List[Any] = []
    try:
        a, a_log = _replica(tmp_path, lh.address(), 0, "first", preset)
        b, b_log = _replica(tmp_path, lh.address(), 1, "first", preset)
        # the restart, imported ahead: it joins nothing until the gate opens
        gate = tmp_path / "restart"
        b2, b2_log = _replica(tmp_path, lh.address(), 1, "restarted", preset, gate)
        procs += [a, b, b2]
        _wait_for(r"^ft_gate: imported", b2_log, procs, 120)
        # both in one quorum first (a group that starts first trains alone until the
        # other's manager is up, then one heals from the other)
        together = _wait_for(r"^iter (\d+): .*torchft: 2 replicas", b_log, procs, 120)
        kill_at = int(together.group(1))
        kill_tree(b.pid)
        b.wait(10)
        procs.remove(b)
        # the survivor goes on alone (the dead group's heartbeats stopped); the sync the
        # kill broke reports one replica too, uncommitted, so wait until a whole sync
        # period and a log line more have passed alone: one exchange committed alone
        alone = r"^iter (\d+): .*torchft: 1 replicas"
        since = int(_wait_for(alone, a_log, [a], 60).group(1))
        deadline = time.monotonic() + 60
        while max(int(m.group(1)) for m in re.finditer(alone, a_log.read_text(), re.M)) < \
                since + 2 * every + LOG_INTERVAL:
            assert a.poll() is None and time.monotonic() < deadline, \
                a_log.read_text(errors="replace")[-3000:]
            time.sleep(0.05)
        gate.touch()
        # per step the first quorum heals it; with local steps the first sync, after
        # its first round of inner steps (and that sync commits with the peer)
        healed = _wait_for(rf"healed from a peer: step {first} -> (\d+)", b2_log, procs,
                           120)
        assert kill_at < int(healed.group(1)) < STEPS, healed.group(0)
        for p in (a, b2):
            assert p.wait(240) == 0, (a_log.read_text() + b2_log.read_text())[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
        lh.shutdown()
    sa, sb = (json.loads((tmp_path / "out" / f"replica-{r}" / "summary.json").read_text())
              for r in (0, 1))
    assert sa["iters"] == sb["iters"] == STEPS
    # the survivor: every exchange committed once (or healed over at the start), some
    # alone, the rest with its peer
    alone, together = sa["ft_committed_by_replicas"].get("1", 0), \
        sa["ft_committed_by_replicas"].get("2", 0)
    assert alone > 0 and together > 0, sa
    # a sync that failed at the kill is not run again with local steps (the fragment's
    # next sync sends its steps), and runs again per step
    dropped = sa["ft_failed"] if every > 1 else 0
    assert (alone + together + dropped) * every + sa["ft_healed_steps"] == \
        STEPS - uncovered, sa
    assert sa["ft_failed"] <= 1 and sa["ft_healed_steps"] < kill_at and sb["ft_healed"] == 1
    # the restarted group: only exchanges with its peer, from the step it healed at
    assert set(sb["ft_committed_by_replicas"]) == {"2"}, sb
    assert sb["ft_committed_by_replicas"]["2"] * every == STEPS - int(healed.group(1)) + \
        first - uncovered, sb
    if every == 1:  # the same weights
        assert sa["final_val_loss"] == sb["final_val_loss"]
    else:
        # each ends with its own local steps since a fragment's last sync; every merge
        # after the heal checked that both anchors agree (a mismatch ends the run)
        assert sa["final_val_loss"] == pytest.approx(sb["final_val_loss"], rel=0.02)
    assert 0 < sa["ft_bytes_between"] < 0.2 * sa["ft_bytes_between_fp32"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.codec
@pytest.mark.parametrize("preset", [["--tagc=tagc-balanced"],
                                    ["--tagc=tagc-local", "--tagc_set=outer_every=4"]],
                         ids=["per-step", "local-steps"])
def test_every_group_stopped_resumes_from_its_checkpoint_as_if_never_stopped(
        tmp_path: Path, preset: List[str]) -> None:
    """Both groups stop at step 20 (each saves its checkpoint: model, optimizer, the
    manager's step, TAGC's feedback between the groups and with local steps the outer
    anchor, momentum and counters) and start again with ``--init_from resume``; at step
    40 both have the validation loss of a run that never stopped, bit for bit."""
    lh = _lighthouse(tmp_path, min_replicas=2)  # every step with both groups

    def run(tag: str, steps: int, out: str, more: List[str]) -> List[Dict[str, Any]]:
        # one learning-rate schedule for every run: the 40 steps'
        procs = [_replica(tmp_path, lh.address(), r, tag,
                          [*preset, "--lr_decay_iters=40", *more], steps=steps, out=out)
                 for r in (0, 1)]
        try:
            for p, log in procs:
                assert p.wait(180) == 0, log.read_text(errors="replace")[-3000:]
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    kill_tree(p.pid)
        return [json.loads((tmp_path / out / f"replica-{r}" / "summary.json").read_text())
                for r in (0, 1)]

    try:
        straight = run("straight", 40, "straight", [])
        run("first", 20, "stopped", [])
        resumed = run("resumed", 40, "stopped", ["--init_from=resume"])
    finally:
        lh.shutdown()
    assert [s["iters"] for s in resumed] == [40, 40]
    assert [s["steps_this_run"] for s in resumed] == [20, 20]
    assert [s["ft_healed"] for s in resumed] == [0, 0]
    assert [s["final_val_loss"] for s in resumed] == [s["final_val_loss"] for s in straight]


@pytest.mark.dist
def test_plain_mode_averages_with_torchfts_own_allreduce(tmp_path: Path) -> None:
    """Without ``--tagc`` the groups average with ``Manager.allreduce`` (fp32): both
    end on the same model, every step committed with both, the bytes counted as the
    ring all-reduce of the shard."""
    lh = _lighthouse(tmp_path, min_replicas=2)
    procs: List[Any] = []
    try:
        for rid in (0, 1):
            env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                       LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tagc.train", *SMALL, "--max_iters=12",
                 f"--ft_lighthouse={lh.address()}", f"--ft_replica={rid}",
                 f"--out_dir={tmp_path / 'out'}", f"--cache_dir={tmp_path / 'cache'}",
                 "--save_checkpoint=false"], env=env, cwd=tmp_path,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=180)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.shutdown()
    sa, sb = (json.loads((tmp_path / "out" / f"replica-{r}" / "summary.json").read_text())
              for r in (0, 1))
    assert sa["final_val_loss"] == sb["final_val_loss"]
    assert sa["ft_committed_by_replicas"] == {"2": 12}
    shard = sum(p.numel() for p in _small_model().parameters())
    assert sa["ft_bytes_between"] == sb["ft_bytes_between"] == 12 * 4 * shard


def _small_model() -> torch.nn.Module:
    from tagc.train.model import GPT

    cfg = parse_config(SMALL)
    return GPT(cfg.gpt_config(257))


def _state_roundtrip(rank: int, world: int) -> Dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from tagc.train.ft import load_local_state, local_state

    out = {}
    models, opts = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
        for layer in m:
            fully_shard(layer)
        fully_shard(m)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        if seed == 0:  # a peer that has stepped; the other one never has (a fresh start)
            for _ in range(2):
                m(torch.randn(4, 5)).sum().backward()
                opt.step()
                opt.zero_grad()
        models.append(m)
        opts.append(opt)
    # through bytes, as torchft's checkpoint transport sends it
    buf = io.BytesIO()
    torch.save(local_state(models[0], opts[0]), buf)
    buf.seek(0)
    load_local_state(models[1], opts[1], torch.load(buf))
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        out.setdefault("params", []).append(torch.equal(p.to_local(), q.to_local()))
    # one more identical step on both: the optimizer state was taken over too
    for m, o in zip(models, opts):
        torch.manual_seed(5)
        m(torch.randn(4, 5)).sum().backward()
        o.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        out.setdefault("after", []).append(torch.equal(p.to_local(), q.to_local()))
    out["dtensor_state"] = all(type(v).__name__ == "DTensor"
                               for s in opts[1].state.values() for k, v in s.items()
                               if k != "step")
    return out


@pytest.mark.dist
def test_the_healed_state_is_the_peers_model_and_optimizer() -> None:
    """:func:`local_state` of a group that has stepped, loaded into a fresh one (no
    optimizer state yet), FSDP2 over 2 ranks: the shards equal, the optimizer state
    DTensors again, and the next step identical."""
    from dist_helpers import run_dist

    for res in run_dist(_state_roundtrip, 2, timeout=90):
        assert all(res["params"]) and all(res["after"]) and res["dtensor_state"], res


@pytest.mark.parametrize("argv,match", [
    (["--ft_lighthouse=http://h:1", "--fsdp=1"], "needs --fsdp 2"),
    (["--ft_lighthouse=http://h:1", "--fsdp=2", "--replicas=2"], "needs --fsdp 2"),
    (["--ft_lighthouse=http://h:1", "--fsdp=2", "--init_from=resume", "--tagc=tagc-local",
      "--ft_allreduce=torchft"], "outer state is not in the checkpoint"),
    (["--ft_lighthouse=http://h:1", "--fsdp=2", "--tagc=tagc-local",
      "--tagc_set=outer_fragments=2", "--ft_allreduce=torchft"],
     "outer_fragments=2, which --ft_lighthouse does not"),
    (["--ft_lighthouse=http://h:1", "--fsdp=2", "--tagc=tagc-full"],
     "--tagc_set gather=none"),
    (["--ft_lighthouse=http://h:1", "--fsdp=2", "--ft_allreduce=fp8"], "ft_allreduce"),
    (["--ft_lighthouse=http://h:1", "--fsdp=2", "--tagc=tagc-auto"],
     "--tagc_set bypass_every=0"),
    (["--ft_replica=-1"], "--ft_replica must be >= 0"),
])
def test_the_mode_refuses_what_it_cannot_run(argv: List[str], match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_config(argv)


def test_without_torchft_the_mode_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from tagc.train import ft

    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(SystemExit, match=re.escape("pip install 'tagc[ft]'")):
        ft.import_torchft()
