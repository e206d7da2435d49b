"""The links and the codec: what a collective and a codec call cost.

:class:`Cluster` holds the machines and links (bandwidths, latencies, backend) and,
where measured, :class:`CollectiveRates`, the rate gloo's collectives reached per
process group, collective and size (``scripts/bench/bench_collectives.py``, the
nccl-tests of the emulated network).  :data:`DEFAULT_CODEC` is the codec's measured
throughput on this project's CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

# Codec throughput, values per second on one CPU core (this project's 2-core machine),
# from docs/RESULTS.md "Codec speed", the S = 2^24 rows (median ms for 2^24 values): quant encode int4 15.789 ms and ternary 16.612 ms (the AVX2
# table); quant decode int4 5.115 ms and ternary 14.828 ms, select+sparsify 15.653 ms,
# sparse unpack 2.152 ms, auto pack 0.708 ms and auto decode 4.867 ms at theta 0.9875
# (the first table); wq encode+decode int8 fp32 17.062 ms, split in two
# halves (encode and decode alone ran at about the same fraction of memcpy: 1.05-1.42
# and 0.93-1.09).  int8 and sign quant were not timed: they take int4's figures.  tls
# (tagc-lean's code): RESULTS "Codec speed", the tls rows of its eight-block encoder
# (encode with an fp32 residual; a later run, in which ternary's encode took 9.5 ms).
_MEASURED_MS_PER_2_24 = {
    "quant_encode_int4": 15.789, "quant_encode_ternary": 16.612,
    "quant_decode_int4": 5.115, "quant_decode_ternary": 14.828,
    "quant_encode_tls": 10.821, "quant_decode_tls": 12.659,
    "sparsify": 15.653, "sparse_unpack": 2.152, "auto_pack": 0.708, "auto_decode": 4.867,
    "wq_encode": 17.062 / 2, "wq_decode": 17.062 / 2,
}
DEFAULT_CODEC = {op: 2 ** 24 / (ms * 1e-3) for op, ms in _MEASURED_MS_PER_2_24.items()}
for _side in ("encode", "decode"):
    for _fmt in ("int8", "sign"):  # not timed: int4's figures
        DEFAULT_CODEC[f"quant_{_side}_{_fmt}"] = DEFAULT_CODEC[f"quant_{_side}_int4"]


def codec_rates(overrides: Dict[str, float], speedup: float = 1.0) -> Dict[str, float]:
    """The codec throughputs: the defaults, times ``speedup``, with ``overrides``.

    Args:
        overrides: values per second per op (keys of :data:`DEFAULT_CODEC`).
        speedup: factor on the defaults (> 0).
    Returns:
        every op's values per second.
    """
    if not (math.isfinite(speedup) and speedup > 0):
        raise ValueError(f"codec speedup must be > 0, got {speedup!r}")
    rates = {k: v * speedup for k, v in DEFAULT_CODEC.items()}
    for k, v in overrides.items():
        if k not in DEFAULT_CODEC:
            raise ValueError(f"unknown codec op {k!r}; known: {sorted(DEFAULT_CODEC)}")
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"codec throughput {k} must be > 0 values/s, got {v!r}")
        rates[k] = float(v)
    return rates


# Collectives the measured tables distinguish (scripts/bench/bench_collectives.py OPS):
# gloo's all-gather and all-to-all do not reach its all-reduce's rate, and TAGC's exchange
# (tagc/comm.py isend/irecv to every peer: p2p, all posted at once; p2p_ring, in ring
# steps, what the CPU path does from three ranks) is neither.
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "all_to_all", "p2p", "p2p_ring")
# The process groups a table is measured on (bench_collectives.py): every rank, a
# node's ranks (the intra-node link), one rank per node (HSDP's replicas).
COLLECTIVE_GROUPS = ("world", "node", "replica")


@dataclass(frozen=True)
class CollectiveRates:
    """Measured rates of collectives: bytes per second a host's link carries, per
    process group, collective and size (``scripts/bench/bench_collectives.py``, the
    nccl-tests of the emulated network).

    Between the measured sizes the rate is interpolated linearly in log(size); outside
    them the nearest size's rate holds.  A (group, kind) the table lacks falls back to
    the cluster's link bandwidth.

    Args:
        tables: {group: {kind: ((size bytes, bytes/s), ...)}}, sizes increasing; size
            = the full tensor (all-reduce input, all-gather output, all-to-all and p2p
            input), rate = the bytes ``bench_collectives.py``'s ``link_bytes`` counts on
            the link (times the node's N ranks for ``replica``) over the slowest rank's
            time.
        source: where the table comes from (printed with predictions).
    """

    tables: Dict[str, Dict[str, Tuple[Tuple[float, float], ...]]]
    source: str = ""

    def __post_init__(self) -> None:
        for g, kinds in self.tables.items():
            if g not in COLLECTIVE_GROUPS:
                raise ValueError(f"collective group {g!r}: one of {list(COLLECTIVE_GROUPS)}")
            for k, rows in kinds.items():
                if k not in COLLECTIVE_KINDS:
                    raise ValueError(f"collective {k!r}: one of {list(COLLECTIVE_KINDS)}")
                if not rows or any(len(r) != 2 or not (r[0] > 0 and r[1] > 0) for r in rows) \
                        or any(a[0] >= b[0] for a, b in zip(rows, rows[1:])):
                    raise ValueError(f"{g}/{k}: rows must be (size > 0, rate > 0) pairs with "
                                     "increasing sizes")

    @classmethod
    def from_report(cls, report: Dict[str, Any], source: str = "") -> "CollectiveRates":
        """The table of a ``bench_collectives.py`` output (its ``collectives`` entry).

        Raises:
            ValueError: not such an output.
        """
        tab = report.get("collectives") if isinstance(report, dict) else None
        if not isinstance(tab, dict) or not tab:
            raise ValueError("not a bench_collectives.py output: no 'collectives' table")
        return cls({g: {k: tuple((float(a), float(b)) for a, b in rows)
                        for k, rows in kinds.items()} for g, kinds in tab.items()},
                   source or report.get("command", ""))

    def rate(self, group: str, kind: str, size: float) -> Optional[float]:
        """Bytes per second for one call, or None when the table lacks (group, kind).

        Args:
            group: one of :data:`COLLECTIVE_GROUPS`.
            kind: one of :data:`COLLECTIVE_KINDS`.
            size: bytes of the full tensor.
        """
        rows = self.tables.get(group, {}).get(kind)
        if not rows:
            return None
        if size <= rows[0][0]:
            return rows[0][1]
        for (s0, r0), (s1, r1) in zip(rows, rows[1:]):
            if size <= s1:
                f = math.log(size / s0) / math.log(s1 / s0)
                return r0 + f * (r1 - r0)
        return rows[-1][1]




@dataclass(frozen=True)
class Cluster:
    """The machines and links.

    Args:
        ranks_per_node: ranks (GPUs, or processes) per node, ``N`` (>= 1).
        nodes: nodes ``R`` (>= 1).
        intra_gbit: bandwidth of a rank's link to the other ranks of its node, Gbit/s
            of payload.
        inter_gbit: bandwidth of a node's link to the other nodes (shared by its
            ranks), Gbit/s of payload.
        intra_latency_s: per-message latency inside a node.
        inter_latency_s: per-message latency between nodes.
        backend: ``nccl`` (ring reduce-scatter) or ``gloo`` (its reduce-scatter is an
            all-reduce: twice the bytes, DESIGN section 4).
        overlap: fraction of the compute time that can hide communication, in [0, 1]
            (0: nothing hidden, as plain FSDP with gloo on the CPU, and every run
            ``--check`` compares with; 1: a step takes
            ``max(compute, communication)`` plus the codec).
        link_efficiency: fraction of the bandwidth collectives reach, in (0, 1]
            (1: first principles; ``--check`` can fit it to a measured plain step); it
            scales the measured rates too.
        collectives: measured collective rates (:class:`CollectiveRates`); where they
            cover a collective they replace the link bandwidths.
        pair_gather: TAGC's all-gathers over two gloo ranks go as one isend/irecv
            exchange (``tagc/comm.py`` ``exchanges_pairwise``; timed as ``p2p``); False
            for runs of the code before it (gloo's all-gather).
        ring_exchange: TAGC's exchange over three or more gloo ranks goes in ring
            steps (``tagc/comm.py`` ``Comm.stepped``; timed as ``p2p_ring``, else as
            ``p2p``); False for runs of the code before it (every message at once).
        worker: TAGC's FSDP2 collectives run on its worker thread beside the compute
            (``fsdp_overlap`` on CPU tensors, ``tagc/overlap.py``), timed unit by unit
            (:mod:`.schedule`); False for runs without it (before it, or
            ``fsdp_overlap=false``) and for GPUs, whose streams ``overlap`` stands for.
    """

    ranks_per_node: int
    nodes: int
    intra_gbit: float
    inter_gbit: float
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 30e-6
    backend: str = "nccl"
    overlap: float = 0.0
    link_efficiency: float = 1.0
    collectives: Optional[CollectiveRates] = None
    pair_gather: bool = True
    ring_exchange: bool = True
    worker: bool = False

    def __post_init__(self) -> None:
        for k in ("ranks_per_node", "nodes"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be an int >= 1, got {v!r}")
        for k in ("intra_gbit", "inter_gbit"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{k} must be a positive bandwidth in Gbit/s, got {v!r}")
        for k in ("intra_latency_s", "inter_latency_s"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{k} must be a latency >= 0 seconds, got {v!r}")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap!r}")
        if not 0.0 < self.link_efficiency <= 1.0:
            raise ValueError(f"link_efficiency must be in (0, 1], got {self.link_efficiency!r}")

    @property
    def world(self) -> int:
        """All ranks, ``N * R``."""
        return self.ranks_per_node * self.nodes

    def bytes_per_s(self, inter: bool) -> float:
        """Payload bytes per second of a link, efficiency applied.

        Args:
            inter: the inter-node link (else the intra-node one).
        Returns:
            bytes per second.
        """
        gbit = self.inter_gbit if inter else self.intra_gbit
        return gbit * 1e9 / 8 * self.link_efficiency

    def measured_s(self, group: str, kind: str, size: float, link: float) -> Optional[float]:
        """Seconds of one collective from the measured rates, or None when not covered.

        Args:
            group: ``world``, ``node`` or ``replica``.
            kind: one of :data:`COLLECTIVE_KINDS`.
            size: bytes of the full tensor.
            link: bytes one rank puts on the link (``predict._Step``'s ``link``).
        """
        if self.collectives is None:
            return None
        # one rank per node: the replicas are the world; a table measured before
        # p2p_ring existed times the ring steps as p2p
        groups = [group] + (["world"] if group == "replica" and self.ranks_per_node == 1 else [])
        kinds = [kind] + (["p2p"] if kind == "p2p_ring" else [])
        rate = next((r for k in kinds for g in groups
                     if (r := self.collectives.rate(g, k, size)) is not None), None)
        if rate is None:
            return None
        share = self.ranks_per_node if group == "replica" else 1
        return link * share / (rate * self.link_efficiency)
