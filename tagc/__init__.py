"""The implementation behind ``tagc_hook`` (the public entry point; import that).

Reading order: ``config`` (the knobs), ``selection`` (which units), ``state``
(``register``), ``fsdp1``/``fsdp2`` (the glue), ``reducer`` (one unit's reduction),
``transports`` (what crosses the network), then ``comm``, ``device``, ``stats`` and
``checkpoint``.
"""
