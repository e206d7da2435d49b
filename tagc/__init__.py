"""The implementation behind ``tagc_hook`` (the public entry point; import that).

Reading order: ``config`` (the knobs; ``presets`` finds the shipped YAML files),
``selection`` (which parameters, which units), ``wrapping`` (that unit layout applied:
``fsdp1_auto_wrap_policy``, ``shard_model``), ``state`` (``register``), ``fsdp1``/``fsdp2``
(the glue), ``reducer`` (one unit's reduction; ``memory`` the layout and bytes of its
feedback state), ``bypass`` (its timing-based choice of path), ``transports`` (what crosses the network; ``codec`` holds the handle on the C
module ``_tagc``), ``hsdp`` (custom HSDP's compressed all-reduce between replicas;
``overlap`` runs it beside the backward on the CPU, ``local`` takes it once every H
steps instead: DiLoCo's outer step), ``gather`` (quantized parameter
all-gathers), ``pipeline`` (pipeline parallelism's stage boundaries, coded), then ``comm``, ``device``, ``stats``, ``checkpoint`` (``positions``: where each
feedback element belongs, for another cluster shape) and ``teardown`` (the
exit drain for gloo's workers).
"""
