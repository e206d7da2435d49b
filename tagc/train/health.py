"""What ends a run early and cleanly: a loss that is no longer finite, and SIGTERM.

Every rank must take the same decision at the same step (a save or an exit are
collectives), so each step's verdict is one small all-reduce of two flags: whether any
rank's loss is not finite, and whether any rank was asked to stop.
"""
from __future__ import annotations

import logging
import math
import signal
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    """The train loss stayed non-finite past the patience."""


class StepHealth:
    """The run's verdict after each step (call :meth:`after_step` on every rank).

    Args:
        patience: consecutive steps with a non-finite loss tolerated; the next one
            raises :class:`NonFiniteLoss`.
        device: where the flags are all-reduced (the process group's device).
    """

    def __init__(self, patience: int, device: torch.device) -> None:
        self.patience, self.device = patience, device
        self.bad_steps = 0
        self.finite = True
        self._term = False
        self._old: Optional[Any] = None
        if threading.current_thread() is threading.main_thread():
            # torchrun forwards SIGTERM to every worker; each saves, then exits
            self._old = signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum: int, frame: Any) -> None:
        self._term = True

    def close(self) -> None:
        """Put the SIGTERM handler back."""
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None

    def after_step(self, loss: float, iter_num: int) -> bool:
        """Agree on the step's health.

        Args:
            loss: this rank's train loss of the step.
            iter_num: the step just made (for the error).
        Returns:
            True when a rank got SIGTERM: save and exit.
        Raises:
            NonFiniteLoss: the loss was not finite on some rank for more than
                ``patience`` consecutive steps.
        """
        flags = torch.tensor([0.0 if math.isfinite(loss) else 1.0, float(self._term)],
                             device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, term = flags.tolist()
        self.finite = not bad
        self.bad_steps = self.bad_steps + 1 if bad else 0
        if self.bad_steps > self.patience:
            raise NonFiniteLoss(
                f"train loss not finite at iter {iter_num} on some rank"
                f"{f' for {self.bad_steps} steps in a row' if self.bad_steps > 1 else ''}; "
                "stopped without saving (the newest checkpoint is the last finite state: "
                "resume with --init_from=resume, lower --learning_rate or raise "
                "--grad_clip; --nonfinite_patience tolerates isolated steps)")
        if bad:
            logger.warning("iter %d: train loss not finite on some rank (%d of %d tolerated "
                           "in a row)", iter_num, self.bad_steps, self.patience)
        return bool(term)
