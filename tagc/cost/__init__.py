"""Cost model of plain FSDP/HSDP and TAGC: bytes per rank and step time per step.

For a model (a parameter count and the fraction TAGC compresses, or a GPT-2 shape),
``N`` ranks per node, ``R`` nodes, the link bandwidths and latencies inside and
between nodes and the codec throughput, it predicts what each rank sends per
optimizer step and how long the step takes, for:

* ``fsdp``: plain FULL_SHARD over all ``N*R`` ranks (a ring all-gather of the
  parameters in forward, again in backward, a ring reduce-scatter of the gradient);
* ``hsdp``: native HSDP (FULL_SHARD inside a node, then a ring all-reduce of each
  rank's shard over the ``R`` replicas);
* ``fsdp+<preset>``: TAGC on FULL_SHARD: the compressed units' reduce-scatter becomes
  an all-to-all of compressed shards (``tagc/transports.py``), with ``full`` also
  the parameter all-gathers on int8 codes (``tagc/gather.py``);
* ``hsdp+<preset>``: TAGC's HSDP route (``tagc/hsdp.py``) with the hook's default
  ``hsdp_allreduce="auto"`` (``allreduce_form``): the all-gather form at ``R = 2`` and
  for ``dense``, the two-phase form where it sends fewer bytes (from ``R = 3``; ``lean``,
  whose owners code on int4, from ``R = 4``);
* ``hsdp+<preset>/2phase``: the two-phase form forced (``hsdp_allreduce="two_phase"``,
  ``TwoPhaseReducer``): each replica's shard in ``R`` chunks, ``R-1`` of them compressed
  to their owners, then every owner's re-compressed chunk of the sum (on the owner's
  code, ``hsdp_out_format``; a name ending ``@FMT`` sets it) all-gathered: about
  ``(R-1)/R`` of the two codes of one shard per rank, flat in ``R``;
* ``hsdp+<preset>/gather``: the all-gather form forced (``hsdp_allreduce="gather"``,
  ``GatherReducer``): every rank all-gathers its compressed shard to the ``R-1`` other
  replicas, ``R-1`` compressed shards per rank.

Which units are compressed follows the selection policy: ``layers="all"`` (the
default: what tagc-balanced, tagc-lean and tagc-full use, every parameter of at least
``min_numel`` elements) or ``non_attention`` (the attention QKV inputs uncompressed, as
the presets were until that change and as the measured runs of ``--check`` ran).

Byte counts apply the library's own rules, not copies of them: the codec's wire sizes
(``_tagc.quant_bytes``, ``_tagc.wq_bytes``), the transports' pairs message, the kept
entries and HSDP's all-reduce form (:mod:`.configs`), on the GPT-2 shapes the training
code builds (:mod:`tagc.cost.shapes`); they count what the hook's ``stats()`` and
``scripts/bench/bench_step.py`` count at the ``torch.distributed`` call.  ``check``
compares them and the step time with the measured runs of ``docs/cost_model_runs.json``.
See ``docs/COST_MODEL.md``; ``python -m tagc.cost`` is the command line (:mod:`.cli`;
``scripts/bench/cost_model.py`` in a checkout).

Modules: :mod:`.layouts` (models as FSDP units), :mod:`.links` (the cluster, measured
collective rates, the codec's throughput), :mod:`.configs` (configurations and the
library's size rules), :mod:`.predict` (one step's bytes and time, sweeps and the
report), :mod:`.schedule` (an FSDP2 step with TAGC's worker thread, unit by unit),
:mod:`.check` (against measured runs), :mod:`.bench` (the step benchmark's rows:
predictions before a run, the comparison after it), :mod:`.rows` (those rows, which
``scripts/bench/bench_step.py`` runs), :mod:`.shapes` (the GPT-2 shapes) and
:mod:`.cli` (the command line).
"""
from .check import (CALIBRATABLE, TCP_FRAME_OVERHEAD, CheckRow, calibrate, check, check_report,
                    load_runs)
from .configs import (DEFAULT_CONFIGS, DTYPE_BYTES, FORM_SUFFIX, GRAD_MODES, HSDP_FORMS,
                      PRESETS, VOTE_BYTES_EF21, VOTE_BYTES_PLAIN, Compression, Config,
                      gather_bytes, hsdp_form, keep_count, make_config, pairs_message,
                      quant_bytes, row_config)
from .layouts import (DEFAULT_LAYERS, DEFAULT_MIN_NUMEL, DEFAULT_SELECTED_FRACTION,
                      DEFAULT_UNITS, LAYER_POLICIES, MODELS, RUN_MODELS, CountedModel,
                      ModelSpec, Unit, bench_gpt2, default_selected_fraction, generic_model,
                      gpt2_124m, gpt2_124m_c256, gpt2_model, linear_pair_model, named_gpt2,
                      run_model,
                      tiny_gpt2, unit_counts)
from .links import (COLLECTIVE_GROUPS, COLLECTIVE_KINDS, DEFAULT_CODEC, Cluster,
                    CollectiveRates, codec_rates)
from .predict import (FLOPS_PER_PARAM_TOKEN, Prediction, flops_compute_s, predict, report,
                      sweep, winner)
