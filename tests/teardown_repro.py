"""One rank of gloo's exit race, with plain ``torch.distributed`` (no FSDP, no TAGC).

Run as a script by ``tests/test_teardown.py`` (environment from the parent: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT).  The program's last collective carries many
small tensors and is waited for; the program then drops them, destroys the group
while something else still holds it (a module global, as a script's model would, or
a garbage cycle, as FSDP's modules are once ``main()`` returns) and ends.  Each
tensor whose Python object died first costs gloo's worker a GIL acquisition when it
lets the collective go, which widens the window in which the interpreter may begin
finalizing under it (the cause: ``tagc/teardown.py``).  ``--drain`` installs TAGC's
exit drain and nothing else.

``--drop after`` (the default) drops the tensors after waiting for the collective, as a
program does; whether gloo's worker lets go of them before or after that is a race.
``--drop before`` takes that race away on rank 0: rank 0 drops its tensors (and the
work handle) while the collective is in flight, and rank 1 issues its side only once
rank 0 has done so (through the store), so the worker's last reference certainly
comes after the Python objects died and costs a GIL acquisition per tensor; the main
thread then polls for the result with the GIL held (instead of a wait that releases
it), so those acquisitions are still pending when the program ends.  Without the drain
this aborts in most runs (README "Limits"), not all: the control of
``tests/test_teardown.py``'s fast test.

    python tests/teardown_repro.py --hold global --drain
    python tests/teardown_repro.py --drop before
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

HOLDER: Optional[Dict[str, Any]] = None


def main() -> None:
    """One collective over ``--tensors`` tensors, completed before its tensors are
    dropped (``--drop after``) or after (``before``), then destroy and end."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hold", choices=("global", "cycle"), default="global")
    ap.add_argument("--tensors", type=int, default=5000)
    ap.add_argument("--drain", action="store_true", help="tagc.teardown.install()")
    ap.add_argument("--drop", choices=("after", "before"), default="after",
                    help="drop the tensors after waiting for the collective, or (rank 0) "
                         "while it is in flight")
    args = ap.parse_args()
    global HOLDER
    if args.drain:
        from tagc import teardown

        teardown.install()
    dist.init_process_group("gloo")
    holder: Dict[str, Any] = {"group": dist.group.WORLD}
    if args.hold == "global":
        HOLDER = holder
    else:
        holder["self"] = holder
    tensors = [torch.ones(4) for _ in range(args.tensors)]
    if args.drop == "after":
        dist.all_reduce_coalesced(tensors)
        del tensors
    else:
        _drop_before(tensors)
    dist.destroy_process_group()


def _drop_before(tensors: List[torch.Tensor]) -> None:
    """The collective over ``tensors`` with every Python reference to them gone before
    it completes on rank 0; returns once it completed, the GIL held meanwhile."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    watch = tensors[-1].detach()  # another Python object on the last tensor's storage
    if rank != 0:
        store.wait(["tensors_dropped"])
    dist.all_reduce_coalesced(tensors, async_op=True)  # the handle dropped at once
    tensors.clear()  # the caller's list: the last Python references to the tensors
    if rank == 0:
        store.set("tensors_dropped", "1")
    deadline = time.monotonic() + 60.0
    while watch[-1].item() != float(world):  # a busy poll: the GIL stays held
        if time.monotonic() > deadline:
            raise RuntimeError("teardown_repro: the collective did not complete in 60 s")


if __name__ == "__main__":
    main()
