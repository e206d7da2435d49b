"""The step benchmark's configurations (its rows), shared by the benchmark and the cost
model so that both read one definition of what a row runs.

A row is plain FSDP or a TAGC preset (found by name, ``tagc.presets``), optionally
under FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``, without
resharding after forward (``reshard_after_forward=False``: every unit gathered once
per step) or with TAGC config fields overridden (``full-int4g``: ``tagc-full`` with
``gather: int4``).  ``scripts/bench/bench_step.py`` builds each row from it and
``tagc.cost.bench`` predicts each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple


@dataclass(frozen=True)
class Row:
    """One configuration of ``bench_step.py``.

    Args:
        preset: the TAGC preset's name (``tagc.presets``), or None for plain FSDP.
        bf16: parameters gathered, computed and gradients reduced in bf16 (FSDP2
            ``MixedPrecisionPolicy``, FSDP1 ``MixedPrecision``; fp32 masters).
        reshard: FSDP2's ``reshard_after_forward`` under FULL_SHARD (False: the forward's
            gather is kept for the backward, one gather per unit and step).
        override: TAGC config fields replacing the preset's, as (key, value) pairs.
    """

    preset: Optional[str] = None
    bf16: bool = False
    reshard: bool = True
    override: Tuple[Tuple[str, Any], ...] = ()

    @property
    def fields(self) -> Dict[str, Any]:
        """The overridden TAGC config fields as a dict."""
        return dict(self.override)


ROWS: Dict[str, Row] = {
    "fsdp": Row(),
    "dense": Row("tagc-dense"),
    "10x-1bit": Row("tagc-10x-1bit"),
    "10x-4bit": Row("tagc-10x-4bit"),
    "exact": Row("tagc-exact"),
    "sparse": Row("tagc-sparse"),
    "auto": Row("tagc-auto"),
    "balanced": Row("tagc-balanced"),
    "lean": Row("tagc-lean"),
    "full": Row("tagc-full"),
    # under MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), what GPU users run:
    # every FSDP collective already at half the bytes (compare the bf16 rows together)
    "fsdp-bf16": Row(bf16=True),
    "full-bf16": Row("tagc-full", bf16=True),
    # gathering once (reshard_after_forward=False): the memory of FULL_SHARD's gathered
    # units traded for one all-gather per unit instead of two
    "fsdp-noreshard": Row(reshard=False),
    "full-noreshard": Row("tagc-full", reshard=False),
    # tagc-full's parameter gathers on int4 codes instead of int8
    "full-int4g": Row("tagc-full", override=(("gather", "int4"),)),
    # the gathers on int4 codes of the weights' change (gather_delta)
    "full4": Row("tagc-full4"),
    # local steps on the HSDP route (--hsdp only): one outer sync every outer_every
    # steps, so time a multiple of it (--steps) for a step's average
    "local": Row("tagc-local"),
}


def baseline(name: str) -> str:
    """The plain FSDP row a row's speed-up is measured against: the one with the same
    precision and resharding.

    Args:
        name: a key of :data:`ROWS`.
    Returns:
        the plain row's name.
    """
    row = ROWS[name]
    return next(k for k, r in ROWS.items()
                if r.preset is None and r.bf16 == row.bf16 and r.reshard == row.reshard)
