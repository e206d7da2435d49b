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

    python tests/teardown_repro.py --hold global --drain
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

HOLDER: Optional[Dict[str, Any]] = None


def main() -> None:
    """One waited-for collective over ``--tensors`` tensors, then destroy and end."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hold", choices=("global", "cycle"), default="global")
    ap.add_argument("--tensors", type=int, default=5000)
    ap.add_argument("--drain", action="store_true", help="tagc.teardown.install()")
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
    dist.all_reduce_coalesced(tensors)
    del tensors
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
