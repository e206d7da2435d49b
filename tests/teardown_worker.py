"""One rank of the teardown stress test (``tests/test_teardown.py``); run as a script.

What a user's script does at its end, with nothing added: train a few steps,
save a checkpoint, ``dist.destroy_process_group()`` with **no barrier**, exit.
The parent counts processes that die (SIGABRT, "terminate called without an
active exception") or print that message.  ``--tagc none`` is plain FSDP, the
control: whatever it shows is torch/gloo's, not TAGC's.  TAGC's ``register`` installs
the exit drain (``tagc/teardown.py``); ``--drain`` installs it on a plain run.

Usage (environment from the parent: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)::

    python tests/teardown_worker.py --fsdp fsdp2 --tagc exact --out /tmp/x
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

from dist_helpers import build_fsdp, toy_batch


def main() -> None:
    """Train ``--steps`` steps, save, destroy the group without a barrier."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fsdp", choices=("fsdp1", "fsdp2"), required=True)
    ap.add_argument("--tagc", default="none", help="a TAGC mode, or none (plain FSDP)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True, help="folder for the per-rank checkpoint")
    ap.add_argument("--drain", action="store_true", help="tagc.teardown.install()")
    args = ap.parse_args()
    import tagc_hook as tagc
    from tagc import teardown

    if args.drain:
        teardown.install()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    cfg = None
    if args.tagc != "none":
        # min_numel below the toy's unit sizes so every selected unit is compressed
        cfg = tagc.TAGCConfig(mode=args.tagc, min_numel=64, dense_steps=0, warmup_steps=0)
    model = build_fsdp(args.fsdp, cfg, d=16)
    state = tagc.register(model, cfg) if cfg is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        model(toy_batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    ckpt = {"model": model.state_dict()}
    if state is not None:
        ckpt["tagc"] = state.state_dict()
    torch.save(ckpt, os.path.join(args.out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
