"""What the torchft tests share (tests/test_ft.py, tests/test_ft_local.py): replicas as
threads of this process, each with torchft's reconfigurable gloo group, and
:class:`Quorums` in the Lighthouse's part.  Import after ``pytest.importorskip("torchft")``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroupGloo

from tagc.config import TAGCConfig
from tagc.ft import FTAllReduce


class FailingGloo(ProcessGroupGloo):
    """torchft's gloo group whose point-to-point sends raise while :attr:`fail`."""

    fail = False

    def send(self, tensors: List[torch.Tensor], dst_rank: int, tag: int) -> Any:
        if self.fail:
            raise RuntimeError("injected send failure")
        return super().send(tensors, dst_rank, tag)


class StubManager:
    """The ``torchft.Manager`` methods FTAllReduce reads, for one replica."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.world, self.rank, self.step = 0, 0, 0
        self.error: Optional[Exception] = None
        self.decision = False  # the quorum's commit vote, set by Quorums.commit
        # votes cast from the members' threads (FTLocalSteps): a barrier and the voters
        self.ballot: Optional[threading.Barrier] = None
        self.voters: List["StubManager"] = []
        self.quorums = 0
        self.fns: Dict[str, Tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        # a heal staged for the next quorum: the donor's state, once it took its own
        self.heal_from: Optional[Dict[str, Any]] = None
        self.serving: Optional[Dict[str, Any]] = None

    def num_participants(self) -> int:
        return self.world

    def participating_rank(self) -> Optional[int]:
        return self.rank

    def current_step(self) -> int:
        return self.step

    def errored(self) -> Optional[Exception]:
        return self.error

    def report_error(self, e: Exception) -> None:
        self.error = e

    def should_commit(self, timeout: Optional[timedelta] = None) -> bool:
        if self.ballot is not None:  # the members vote from their own threads
            self.ballot.wait()
            self.decision = all(m.error is None for m in self.voters)
            self.ballot.wait()
        if self.decision:
            self.step += 1
        return self.decision

    def start_quorum(self) -> None:
        """The quorum itself is formed by :meth:`Quorums.form`; a heal staged there
        (:meth:`heal`) is applied here, from the state the donor had at its own
        ``start_quorum``, as torchft's recovery does."""
        self.quorums += 1
        if self.serving is not None:
            self.serving["state"] = {k: save() for k, (_, save) in self.fns.items()}
            self.serving["ready"].set()
            self.serving = None
        if self.heal_from is not None:
            staged, self.heal_from = self.heal_from, None
            assert staged["ready"].wait(30), "the donor never took its quorum"
            for key, (load, _) in self.fns.items():
                load(staged["state"][key])

    def heal(self, donor: "StubManager") -> None:
        """At the next quorum this replica loads ``donor``'s state."""
        self.heal_from = donor.serving = {"ready": threading.Event()}

    def register_state_dict_fn(self, key: str, load: Callable[[Any], None],
                               save: Callable[[], Any]) -> None:
        self.fns[key] = (load, save)


class Replica:
    def __init__(self, cfg: TAGCConfig, pg_timeout: float = 20.0) -> None:
        self.pg = FailingGloo(timeout=timedelta(seconds=pg_timeout))
        self.manager = StubManager(self.pg)
        self.ft = FTAllReduce(self.manager, self.pg, cfg)


class Quorums:
    """The Lighthouse's part: quorums of replicas, their groups, their commits."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        self.quorum_id = 0
        self.members: List[Replica] = []

    def form(self, members: List[Replica], step: int) -> None:
        """Configure every member's group for a new quorum at ``step`` (a joiner is
        healed to it, as the Manager does)."""
        self.quorum_id += 1
        self.members = members
        addr = f"localhost:{self.store.port}/torchft/{self.quorum_id}"

        def configure(i: int) -> None:
            m = members[i].manager
            m.world, m.rank, m.step, m.error = len(members), i, step, None
            members[i].pg.configure(addr, str(id(members[i])), i, len(members))

        self.run(configure)

    def run(self, fn: Callable[[int], Any]) -> List[Any]:
        """``fn(i)`` on every member at once (member i on its own thread)."""
        with ThreadPoolExecutor(len(self.members)) as pool:
            return list(pool.map(fn, range(len(self.members))))

    def sync(self, grads: List[torch.Tensor], key: Any = "g") -> List[torch.Tensor]:
        """One all-reduce of member i's ``grads[i]`` (copies), on every member."""
        outs = [g.clone() for g in grads]
        self.run(lambda i: self.members[i].ft.allreduce(outs[i], key=key).wait())
        return outs

    def commit(self) -> bool:
        """The commit vote (True only if no member errored), then every member's
        ``FTAllReduce.should_commit``; fails if a member's answer differs."""
        ok = all(r.manager.error is None for r in self.members)
        for r in self.members:
            r.manager.decision = ok
        assert [r.ft.should_commit() for r in self.members] == [ok] * len(self.members)
        return ok


