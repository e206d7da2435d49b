"""What one configuration costs per optimizer step: bytes per rank and step time.

:func:`predict` walks a model's units through a configuration's collectives (FSDP's
all-gathers and reduce-scatter, TAGC's exchange, HSDP's all-reduce between replicas),
each sized by the library's rules (:mod:`.configs`) and timed on the cluster's links
or measured collective rates (:mod:`.links`); :func:`sweep` and :func:`report` tabulate
predictions over node counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .configs import (DTYPE_BYTES, Compression, Config, gather_bytes, hsdp_form, pairs_message,
                      quant_bytes)
from .layouts import ModelSpec, unit_counts
from .links import Cluster, codec_rates
from .schedule import UnitJobs, worker_step_s

@dataclass
class Prediction:
    """What one configuration costs per optimizer step.

    Attributes:
        config: the configuration.
        ideal: bytes one rank sends per category as the hook and the benchmark count
            them (ring collectives' ideal bytes: reduce-scatter ``(G-1)/G``; keys
            ``gather``, ``grad`` (FSDP's reduce-scatter or TAGC's exchange inside the
            reduce-scatter group), ``cross`` (HSDP between replicas), ``control``).
        link: the same as the backend sends it (gloo's reduce-scatter is an all-reduce).
        node_inter: bytes one node puts on its inter-node link.
        comm_s: time in collectives (none overlapped with each other).
        codec_s: time in the codec.
        compute_s: compute time given.
        messages: latency terms counted (a fraction under local steps: those of
            the outer exchange, once every H steps).
        scheduled_s: the step as :func:`.schedule.worker_step_s` replays it, unit by
            unit, when TAGC's FSDP2 worker runs the collectives beside the compute
            (``Cluster.worker``); None: compute + codec + what ``overlap`` leaves.
    """

    config: Config
    ideal: Dict[str, float] = field(default_factory=dict)
    link: Dict[str, float] = field(default_factory=dict)
    node_inter: float = 0.0
    comm_s: float = 0.0
    codec_s: float = 0.0
    compute_s: float = 0.0
    messages: float = 0
    overlap: float = 0.0
    scheduled_s: Optional[float] = None

    @property
    def bytes_per_rank(self) -> float:
        """Bytes one rank sends per step on the backend."""
        return sum(self.link.values())

    @property
    def ideal_bytes_per_rank(self) -> float:
        """Ideal-ring bytes one rank sends per step."""
        return sum(self.ideal.values())

    @property
    def step_s(self) -> float:
        """Compute + codec + the communication compute does not hide."""
        if self.scheduled_s is not None:
            return self.scheduled_s
        hidden = min(self.comm_s, self.overlap * self.compute_s)
        return self.compute_s + self.codec_s + self.comm_s - hidden


class _Step:
    """Accumulates one step's collectives into a :class:`Prediction`.

    Every call describes one collective of one unit: ``times`` = how many of them run
    per step for the bytes (1 per unit and call), ``lat`` = how many FSDP units it
    stands for (the latency terms and the per-unit votes; > 1 for the aggregate units
    of :func:`generic_model`).
    """

    def __init__(self, cluster: Cluster, pred: Prediction) -> None:
        self.c, self.p = cluster, pred

    def _account(self, cat: str, ideal: float, link: float, crosses: bool, intra: float,
                 nic: float, steps: int, times: int, lat: int,
                 measured: Optional[Tuple[str, str, float]] = None) -> None:
        """Add bytes, and time = the slowest link the collective uses + latencies.

        Args:
            cat: byte category.
            ideal, link: bytes one rank sends (ideal ring / the backend).
            crosses: whether it uses the inter-node link.
            intra: bytes one rank puts on its intra-node link.
            nic: bytes one node puts on its inter-node link.
            steps: sequential message steps (latency terms) of one call.
            times: calls, for the bytes.
            lat: FSDP units, for the latencies.
            measured: (group, kind, size) to look up in the measured collective rates
                (None: not a measured collective); where they cover it, its time.
        """
        c, p = self.c, self.p
        p.ideal[cat] = p.ideal.get(cat, 0.0) + ideal * times
        p.link[cat] = p.link.get(cat, 0.0) + link * times
        t = intra / c.bytes_per_s(False) if intra else 0.0
        if crosses:
            t = max(t, nic / c.bytes_per_s(True))
            p.node_inter += nic * times
        if measured is not None:
            m = c.measured_s(*measured, link)
            t = t if m is None else m
        p.comm_s += t * times + steps * lat * (c.inter_latency_s if crosses
                                                else c.intra_latency_s)
        p.messages += steps * lat

    def _crosses(self, group: str) -> bool:
        """Whether a collective over ``group`` uses the inter-node link."""
        return group == "replica" or (group == "world" and self.c.nodes > 1)

    def ring(self, cat: str, group: str, g: int, kind: str, nbytes: float, times: int,
             lat: int, tagc: bool = False) -> None:
        """A ring collective over ``g`` ranks.

        Args:
            cat: byte category.
            group: ``world`` (all ranks, node by node), ``node`` (the ranks of a node)
                or ``replica`` (one rank per node; the N such groups run at once).
            g: ranks in the group.
            kind: ``all_gather`` (nbytes = one rank's piece), ``reduce_scatter`` or
                ``all_reduce`` (nbytes = the whole input of one rank).
            nbytes: see kind.
            times: calls, for the bytes.
            lat: FSDP units, for the latencies.
            tagc: TAGC's own collective (its all-gathers over two gloo ranks are an
                exchange, :attr:`Cluster.pair_gather`), not FSDP's.
        """
        if g <= 1 or nbytes == 0:
            return
        # measured: the table entry timing it, and the size the tables index by
        if kind == "all_gather":
            ideal = link = (g - 1) * nbytes
            steps = g - 1
            pair = tagc and g == 2 and self.c.backend == "gloo" and self.c.pair_gather
            measured: Optional[Tuple[str, str, float]] = (group, "p2p" if pair else kind,
                                                          g * nbytes)
        elif kind == "reduce_scatter":
            ideal = (g - 1) / g * nbytes
            gloo = self.c.backend == "gloo"  # gloo: an all-reduce underneath
            link = 2 * ideal if gloo else ideal
            steps = 2 * (g - 1) if gloo else g - 1
            measured = (group, "all_reduce", nbytes) if gloo else None
        elif kind == "all_reduce":
            ideal = link = 2 * (g - 1) / g * nbytes
            steps = 2 * (g - 1)
            measured = (group, kind, nbytes)
        else:
            raise ValueError(f"unknown collective {kind!r}")
        crosses = self._crosses(group)
        # A node-contiguous ring crosses each node boundary once, so a node's link
        # carries one rank's bytes; replica groups: the node's N rings all cross it.
        nic = link * (self.c.ranks_per_node if group == "replica" else 1)
        intra = link if group != "replica" and self.c.ranks_per_node > 1 else 0.0
        self._account(cat, ideal, link, crosses, intra, nic, steps, times, lat, measured)

    def all_to_all(self, cat: str, group: str, g: int, msg: float, times: int,
                   lat: int, kind: str = "all_to_all") -> None:
        """Each rank sends ``msg`` bytes to each of the ``g - 1`` others.

        Args:
            cat: byte category.
            group: ``world`` or ``replica`` (as :meth:`ring`).
            g: ranks in the group.
            msg: bytes of one message.
            times: calls, for the bytes.
            lat: FSDP units, for the latencies.
            kind: ``all_to_all`` (one ``all_to_all_single``) or ``p2p`` (an isend to
                and an irecv from every peer, ``tagc/comm.py``): the same bytes, not the
                same rate on gloo.
        """
        if g <= 1 or msg == 0:
            return
        n = self.c.ranks_per_node
        if group == "world":
            # a node's N ranks each send to the g - N ranks of the other nodes
            nic, intra = n * (g - n) * msg, (min(n, g) - 1) * msg
        else:  # replica: every rank's g - 1 messages leave the node
            nic, intra = n * (g - 1) * msg, 0.0
        if kind == "p2p" and g >= 3 and self.c.backend == "gloo" and self.c.ring_exchange:
            kind = "p2p_ring"
        self._account(cat, (g - 1) * msg, (g - 1) * msg, self._crosses(group), intra, nic,
                      g - 1, times, lat, (group, kind, g * msg))


def predict(model: ModelSpec, cluster: Cluster, config: Config, compute_s: float = 0.0,
            codec: Optional[Dict[str, float]] = None) -> Prediction:
    """Bytes and time of one optimizer step.

    Collectives run one after the other (FSDP issues them in order on one stream);
    ``cluster.overlap`` decides how much of their total hides behind compute.

    Args:
        model: the units.
        cluster: ranks, links, backend, overlap.
        config: the configuration.
        compute_s: forward + backward + optimizer time of one step (>= 0).
        codec: values per second of codec ops (keys of :data:`DEFAULT_CODEC`), replacing
            the defaults.
    Returns:
        the prediction.
    """
    if not (isinstance(compute_s, (int, float)) and math.isfinite(compute_s) and compute_s >= 0):
        raise ValueError(f"compute time must be >= 0 seconds, got {compute_s!r}")
    rates = codec_rates(codec or {})
    p = Prediction(config, compute_s=compute_s, overlap=cluster.overlap)
    st = _Step(cluster, p)
    t = config.tagc
    eb = DTYPE_BYTES[config.dtype]
    hsdp = config.layout == "hsdp"
    group, g = ("node", cluster.ranks_per_node) if hsdp else ("world", cluster.world)
    # local steps (tagc/local.py): the exchange between the replicas, of the
    # pseudo-gradient instead of the gradient, once every H steps; counted apart, then
    # added at 1/H per step
    h = t.outer_every if t is not None else 0
    outer = Prediction(config) if h else p
    ost = _Step(cluster, outer) if h else st
    # TAGC's FSDP2 worker (tagc/overlap.py): the shard group's collectives beside the
    # compute, so the step is the schedule of each unit's jobs, not their sum
    worker = (cluster.worker and t is not None and not hsdp and config.fsdp == 2 and g > 1)
    jobs: List[UnitJobs] = []
    total = sum(u.numel * cnt for u, cnt in zip(model.units, unit_counts(model)))
    for u, cnt in zip(model.units, unit_counts(model)):
        segs = u.segments(g, config.fsdp)
        s = sum(segs)
        spent = p.comm_s + p.codec_s
        # -- parameter all-gathers: forward and backward (FSDP1's root and every unit
        # kept gathered after forward: forward only)
        calls = 1 if (config.fsdp == 1 and u.root) or not config.reshard else 2
        regather_s: Optional[float] = None
        fwd_end: Optional[float] = None  # set when the re-gather is timed apart
        if t is not None and t.gather != "none":
            msg = gather_bytes(segs, t.gather, t.gather_block, t.gather_delta)
            # gather_delta on gloo (tagc/gather.py): the backward's re-gather of what the
            # forward gathered all-gathers the flag bytes alone
            flags = t.gather_delta and calls == 2 and cluster.backend == "gloo"
            coded = 1 if flags else calls
            st.ring("gather", group, g, "all_gather", msg, coded, coded * cnt, tagc=True)
            if g > 1:  # tagc/gather.py: encode the own shard, decode all g messages
                p.codec_s += coded * (s / rates["wq_encode"] + g * s / rates["wq_decode"])
                if t.gather_delta:
                    # csrc/wq_delta.c on the changed call: the own shard compared and
                    # remembered (s), the held weights read and written beside the
                    # decode (g s); the unchanged re-gather's compare and copy cost about
                    # a plain call's codec: streaming passes, at the decoder's rate
                    p.codec_s += (s + g * s) / rates["wq_decode"]
            if flags:
                fwd_end = p.comm_s + p.codec_s
                st.ring("gather", group, g, "all_gather", 1, 1, cnt, tagc=True)
                if g > 1:  # the own shard compared, the held weights copied out
                    p.codec_s += (s + g * s) / rates["wq_decode"]
                regather_s = (p.comm_s + p.codec_s - fwd_end) / cnt
        else:
            st.ring("gather", group, g, "all_gather", s * eb, calls, calls * cnt)
        # one call's seconds for cnt units (the forward's, when the re-gather differs)
        gather_s = (p.comm_s + p.codec_s - spent) / calls if fwd_end is None else \
            fwd_end - spent
        spent = p.comm_s + p.codec_s
        # -- gradient over the reduce-scatter group (every rank, or the node's)
        compressed = t is not None and u.compressed
        if compressed and not hsdp and g > 1:
            _exchange(st, p, t, g, s, eb, cnt, rates)
        else:
            st.ring("grad", group, g, "reduce_scatter", g * s * eb, 1, cnt)
        if worker:  # an entry standing for cnt units: cnt equal units
            jobs += [UnitJobs(u.root, u.numel / total, gather_s / cnt,
                              (p.comm_s + p.codec_s - spent) / cnt, regather_s)] * cnt
        # -- HSDP: each rank's shard over the R replicas
        if hsdp and cluster.nodes > 1:
            if compressed:
                _cross(ost, outer, t, config.cross, cluster.nodes, s, eb, cnt, rates)
            else:
                ost.ring("cross", "replica", cluster.nodes, "all_reduce", s * eb, 1, cnt)
    if h:
        _add_share(p, outer, 1 / h)
    if worker:
        # a bf16 reduce dtype is read as soon as the exchange returns: not deferred
        p.scheduled_s = worker_step_s(jobs, compute_s, config.reshard,
                                      deferred=config.dtype == "fp32")
    return p


def _add_share(p: Prediction, q: Prediction, w: float) -> None:
    """Add ``w`` times ``q``'s bytes, times and latency terms into ``p``."""
    for mine, theirs in ((p.ideal, q.ideal), (p.link, q.link)):
        for cat, v in theirs.items():
            mine[cat] = mine.get(cat, 0.0) + w * v
    p.node_inter += w * q.node_inter
    p.comm_s += w * q.comm_s
    p.codec_s += w * q.codec_s
    p.messages += w * q.messages


def _pairs_codec(t: Compression, s: int, shards: int, messages: int,
                 rates: Dict[str, float]) -> float:
    """Seconds to select ``shards`` shards of s and add ``messages`` messages."""
    if t.mode == "sparse":
        return shards * s / rates["sparsify"] + messages * s / rates["sparse_unpack"]
    return shards * s * (1 / rates["sparsify"] + 1 / rates["auto_pack"]) \
        + messages * s / rates["auto_decode"]


def _exchange(st: _Step, p: Prediction, t: Compression, g: int, s: int, eb: int, cnt: int,
              rates: Dict[str, float]) -> None:
    """TAGC's compressed reduce-scatter of one unit over all ranks: an all-to-all."""
    if t.vote_bytes:
        st.ring("control", "world", g, "all_reduce", t.vote_bytes, cnt, cnt)
    if t.mode == "dense":  # transports.dense: one all_to_all_single
        st.all_to_all("grad", "world", g, s * eb, 1, cnt)
    elif t.mode == "quant":  # transports.quant: a message per owner, isend/irecv
        fmt = t.quant_format
        st.all_to_all("grad", "world", g, quant_bytes(s, fmt, t.quant_block), 1, cnt, "p2p")
        # the own shard stays exact: g - 1 shards encoded, g - 1 messages decoded; a
        # coded residual over the whole unit decoded and coded again
        p.codec_s += (g - 1) * s * (1 / rates[f"quant_encode_{fmt}"]
                                    + 1 / rates[f"quant_decode_{fmt}"]) \
            + t.residual_codec_s(g * s, rates)
    else:  # every shard selected (the own one too), g messages added at the owner
        st.all_to_all("grad", "world", g, pairs_message(t, s, eb), 1, cnt, "p2p")
        p.codec_s += _pairs_codec(t, s, g, g, rates)


def _cross(st: _Step, p: Prediction, t: Compression, cross: str, r: int, s: int, eb: int,
           cnt: int, rates: Dict[str, float]) -> None:
    """TAGC's HSDP exchange of one rank's shard of one unit between ``r`` replicas, in
    the form :func:`hsdp_form` picks (``tagc/hsdp.py``)."""
    if t.vote_bytes:  # the reducer's vote, once per call whatever the form
        st.ring("control", "replica", r, "all_reduce", t.vote_bytes, cnt, cnt)
    if hsdp_form(cross, t, r, s) == "all-gather":
        # GatherReducer: transports.SPREADS with place=False
        if t.mode == "dense":  # spread_dense: one SUM all-reduce, native HSDP's
            st.ring("cross", "replica", r, "all_reduce", s * eb, 1, cnt)
        elif t.mode == "quant":  # spread_quant: encode the shard once, decode all r
            fmt = t.quant_format
            st.ring("cross", "replica", r, "all_gather", quant_bytes(s, fmt, t.quant_block),
                    1, cnt, tagc=True)
            p.codec_s += s / rates[f"quant_encode_{fmt}"] + r * s / rates[f"quant_decode_{fmt}"] \
                + t.residual_codec_s(s, rates)
        else:  # spread_pairs: the k pairs of the shard all-gathered, all r added
            st.ring("cross", "replica", r, "all_gather", pairs_message(t, s, eb), 1, cnt,
                    tagc=True)
            p.codec_s += _pairs_codec(t, s, 1, r, rates)
        return
    # TwoPhaseReducer: the shard padded to r chunks; the to-the-owner phase is the mode's
    # FULL_SHARD transport over the replicas (r - 1 point-to-point messages per rank,
    # counted as an all-to-all of the same bytes, timed as p2p), then each owner codes
    # its chunk of the sum once and one all-gather brings every owner's message to every
    # replica (transports.SPREADS with place=True), where all r are decoded.
    chunk = -(-s // r)
    if t.mode == "dense":  # transports.dense, then spread_dense: the fp32 sums gathered
        st.all_to_all("cross", "replica", r, chunk * eb, 1, cnt)
        st.ring("cross", "replica", r, "all_gather", chunk * DTYPE_BYTES["fp32"], 1, cnt, tagc=True)
    elif t.mode == "quant":
        fmt, out = t.quant_format, t.owner_format
        enc, dec = rates[f"quant_encode_{fmt}"], rates[f"quant_decode_{fmt}"]
        st.all_to_all("cross", "replica", r, quant_bytes(chunk, fmt, t.quant_block), 1, cnt,
                      "p2p")
        st.ring("cross", "replica", r, "all_gather", quant_bytes(chunk, out, t.quant_block),
                1, cnt, tagc=True)
        # transports.quant: the own chunk is added exact, the r - 1 others encoded and
        # r - 1 received messages decoded; spread_quant: one chunk encoded, r decoded,
        # on the owner's code
        p.codec_s += (r - 1) * chunk * (1 / enc + 1 / dec) + chunk / rates[f"quant_encode_{out}"] \
            + r * chunk / rates[f"quant_decode_{out}"] \
            + t.residual_codec_s((r + 1) * chunk, rates)  # residual and residual_out
    else:
        # transports.pairs: every chunk selected (the own one too), r messages added at
        # the owner; spread_pairs: k of the owner's sum selected, r messages added
        msg = pairs_message(t, chunk, eb)
        st.all_to_all("cross", "replica", r, msg, 1, cnt, "p2p")
        st.ring("cross", "replica", r, "all_gather", msg, 1, cnt, tagc=True)
        p.codec_s += _pairs_codec(t, chunk, r, r, rates) + _pairs_codec(t, chunk, 1, r, rates)


# --------------------------------------------------------------------------- compute time

# Training FLOPs per token and parameter: 2 forward + 4 backward multiply-adds
# (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", C = 6 N D).
FLOPS_PER_PARAM_TOKEN = 6


def flops_compute_s(params: float, tokens_per_rank: int, tflops: float, mfu: float) -> float:
    """Compute time of one step from the 6 x params x tokens estimate.

    Args:
        params: model parameters.
        tokens_per_rank: tokens each rank processes per optimizer step.
        tflops: peak dense TFLOP/s of one rank's device (dtype of the matmuls).
        mfu: achieved fraction of that peak, in (0, 1].
    Returns:
        seconds.
    """
    if tokens_per_rank < 1 or not tflops > 0 or not 0 < mfu <= 1:
        raise ValueError("flops estimate: tokens_per_rank >= 1, tflops > 0 and mfu in (0, 1] "
                         f"needed, got {tokens_per_rank}, {tflops}, {mfu}")
    return FLOPS_PER_PARAM_TOKEN * params * tokens_per_rank / (tflops * 1e12 * mfu)


# --------------------------------------------------------------------------- sweep and report


def sweep(model: ModelSpec, base: Cluster, nodes: Sequence[int], configs: Sequence[Config],
          compute_s: float, codec: Dict[str, float]) -> Dict[str, Dict[int, Prediction]]:
    """Every configuration at every node count.

    Args:
        model: the model.
        base: the cluster (its ``nodes`` is replaced by each of ``nodes``).
        nodes: node counts R.
        configs: configurations.
        compute_s: compute time per step.
        codec: codec throughputs.
    Returns:
        ``{config name: {R: prediction}}``.
    """
    out: Dict[str, Dict[int, Prediction]] = {}
    for cfg in configs:
        out[cfg.name] = {r: predict(model, replace(base, nodes=r), cfg, compute_s, codec)
                         for r in nodes}
    return out


def winner(table: Dict[str, Dict[int, Prediction]], r: int) -> Prediction:
    """The fastest configuration at R = r.

    Args:
        table: :func:`sweep`'s result.
        r: the node count.
    Returns:
        its prediction (the first of the table's order on a tie).
    """
    return min((by_r[r] for by_r in table.values()), key=lambda p: p.step_s)


def _fmt_mb(b: float) -> str:
    """Bytes as MB, 4 significant digits."""
    return f"{b / 1e6:.4g}"


def _ratio(num: float, den: float) -> str:
    """``num / den`` to 4 significant digits, or "-" when either is 0 (nothing sent).

    Args:
        num: the numerator (native HSDP's bytes).
        den: the denominator (the configuration's bytes).
    Returns:
        the text.
    """
    return f"{num / den:.4g}" if num and den else "-"


def report(model: ModelSpec, base: Cluster, nodes: Sequence[int],
           table: Dict[str, Dict[int, Prediction]]) -> str:
    """Markdown tables: bytes per rank, bytes per node between nodes (and their ratio to
    native HSDP's when ``hsdp`` is in the table), step time, winners.

    Args:
        model: the model.
        base: the cluster (ranks per node, links).
        nodes: node counts R (the columns).
        table: :func:`sweep`'s result.
    Returns:
        the text.
    """
    cols = " | ".join(f"R={r} ({r * base.ranks_per_node} ranks)" for r in nodes)
    sep = "|---" * (len(nodes) + 1) + "|"
    first = next(iter(table.values()))[nodes[0]]
    lines = [f"model: {model.name}, {model.params / 1e6:.2f}M parameters, "
             f"{100 * model.compressed_fraction():.1f}% in compressed units, "
             f"{model.unit_count} FSDP units",
             f"cluster: {base.ranks_per_node} ranks per node, intra {base.intra_gbit:g} Gbit/s "
             f"+ {base.intra_latency_s * 1e6:g} us, inter {base.inter_gbit:g} Gbit/s per node "
             f"+ {base.inter_latency_s * 1e6:g} us, backend {base.backend}, overlap "
             f"{base.overlap:g}, link efficiency {base.link_efficiency:g}; compute "
             f"{first.compute_s:.4g} s per step", ""]
    tables: List[Tuple[str, Callable[[Prediction, int], str]]] = [
        ("bytes sent per rank per step (MB)", lambda p, r: _fmt_mb(p.bytes_per_rank)),
        ("bytes per node on the inter-node link per step (MB)",
         lambda p, r: _fmt_mb(p.node_inter)),
        ("predicted step time (s)", lambda p, r: f"{p.step_s:.4g}")]
    native = table.get("hsdp")
    if native is not None:
        # How much less than native HSDP a configuration puts between nodes: the figure
        # HSDP compression is judged by (COST_MODEL.md), exact where the MB above round.
        tables.insert(2, ("native HSDP's inter-node bytes / the configuration's (x)",
                          lambda p, r: _ratio(native[r].node_inter, p.node_inter)))
    for title, fn in tables:
        lines += [f"**{title}**", "", f"| config | {cols} |", sep]
        for by_r in table.values():
            cfg = next(iter(by_r.values())).config
            lines.append(f"| {cfg.name} | " + " | ".join(fn(by_r[r], r) for r in nodes) + " |")
        lines.append("")
    lines.append("**fastest configuration**")
    lines.append("")
    for r in nodes:
        best = winner(table, r)
        lines.append(f"- R={r}: {best.config.name}, {best.step_s:.4g} s")
    return "\n".join(lines)
