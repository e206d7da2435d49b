"""The implementation behind ``tagc_hook``, the public entry point: import that.

This docstring is the module map, the one place that lists every module of the
package (``tagc_hook``'s docstring and ``docs/USAGE.md``'s "Layout" point here).
Imports point down the list, with no circle; nothing here imports ``tagc_hook``,
and only ``tagc/codec.py`` imports the C module ``_tagc`` (``tests/test_layout.py``).

* ``tagc/config.py``      TAGCConfig: every knob, documented and validated; defaults
  are ``tagc-balanced``
* ``tagc/presets.py``     the YAML presets shipped with the package, found by name
* ``tagc/selection.py``   which parameters are compressed; which modules get own units
* ``tagc/wrapping.py``    that unit layout applied: fsdp1_auto_wrap_policy, shard_model
* ``tagc/state.py``       register() and TAGCState (stats, checkpoints)
* ``tagc/fsdp1.py``, ``tagc/fsdp2.py``  the FSDP glue (every torch internal it touches)
* ``tagc/hsdp.py``        custom HSDP: the all-reduce between replicas, compressed
* ``tagc/overlap.py``     custom HSDP on the CPU: that all-reduce beside the backward
* ``tagc/local.py``       custom HSDP's local steps (DiLoCo): an outer step every H
* ``tagc/ft.py``          that all-reduce and local steps over a torchft Manager's quorum
                          (FTAllReduce, FTLocalSteps)
* ``tagc/reducer.py``     UnitReducer: what FSDP holds per unit; one reduction
* ``tagc/bypass.py``      the timing-based bypass (``bypass_every``): compress or not
* ``tagc/memory.py``      what the feedback state keeps per rank: its layout and bytes
* ``tagc/transports.py``  what crosses the network: one function per mode, a table
* ``tagc/codec.py``       the handle on the C module ``_tagc`` (its only importer)
* ``tagc/gather.py``      quantized parameter all-gathers (FSDP2, ``gather``)
* ``tagc/pipeline.py``    pipeline parallelism: coded stage boundaries
  (``pipeline_stage``, ``PipelineConfig``; int8/int4 blocks or Protocol Models' subspace)
* ``tagc/checkpoint.py``  the state in checkpoints, the checks on resume, the mapping onto
  another shape; ``tagc/positions.py`` where each feedback element belongs (by name)
* ``tagc/comm.py``        counted collectives; ``tagc/device.py`` CPU/CUDA and streams;
  ``tagc/stats.py`` the counters behind ``TAGCState.stats()``
* ``tagc/teardown.py``    the exit drain: gloo's workers done with Python before exit
* ``tagc/_ext/``          the C module ``_tagc`` (entry points, argument checks, CUDA glue)
  over the codec in ``csrc/`` and the kernels in ``cuda/``
* ``tagc/cost/``          the cost model: bytes and step time per preset, layout and link
* ``tagc/train/``         the training harness behind ``scripts/train_gpt2.py`` and
  ``python -m tagc.train`` (never imported by ``tagc_hook``)

How one gradient travels through these modules: ``docs/DESIGN.md``, section 2.
"""

# The release, one constant: setup.py reads this line as text for the wheel's metadata.
__version__ = "0.1.0"
