"""TAGC under Hugging Face Accelerate: its FSDP plugin shards, ``tagc.register`` hooks.

The README's recipe as a script (a Llama built from a config, random tokens, a few
AdamW steps), for ``accelerate launch``:

    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 \\
        scripts/accelerate_tagc.py --tagc tagc-balanced
    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 1 \\
        scripts/accelerate_tagc.py --tagc tagc-balanced

FSDP2: ``tagc.shard_model`` shards the model with TAGC's unit layout before
``accelerator.prepare`` (Accelerate keeps a model that is already sharded).  FSDP1: the
plugin takes ``tagc.fsdp1_auto_wrap_policy`` as its wrap policy.  Either way
``tagc.register`` runs on the prepared model, before the first backward.

Accelerate applies its FSDP plugin on accelerator devices only (on a CPU-only machine
``--use_fsdp`` gives plain DDP or no distribution at all), so this needs GPUs.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

import torch


def main(argv: Optional[List[str]] = None) -> float:
    """Train a few steps; prints and returns the last loss."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tagc", default="tagc-balanced",
                   help="a TAGC preset: a shipped name (tagc-balanced, lean, ...) or a YAML path")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--min_numel", type=int, default=None, help="override the preset's")
    args = p.parse_args(argv)

    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from transformers import LlamaConfig, LlamaForCausalLM

    import tagc_hook as tagc

    overrides = {} if args.min_numel is None else {"min_numel": args.min_numel}
    cfg = tagc.TAGCConfig.preset(args.tagc, overrides)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=256,
                                         intermediate_size=688, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=4096))
    plugin = FullyShardedDataParallelPlugin()  # version and options from accelerate launch
    if plugin.fsdp_version == 2:
        model = tagc.shard_model(model, cfg)  # TAGC's unit layout; prepare() keeps it
    else:
        plugin.auto_wrap_policy = tagc.fsdp1_auto_wrap_policy(model, cfg)
    acc = Accelerator(fsdp_plugin=plugin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = acc.prepare(model, optimizer)
    state = tagc.register(model, cfg)
    gen = torch.Generator().manual_seed(acc.process_index)
    loss = torch.zeros(())
    for _ in range(args.steps):
        x = torch.randint(0, 4096, (4, 128), generator=gen).to(acc.device)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    st = state.stats(global_totals=True)["global_compressed_total"]
    acc.print(f"loss {loss.item():.4f}; compressed units sent {st['wire_ratio']:.3f} of "
              f"plain FSDP's bytes over {st['ranks']} ranks")
    return float(loss.item())


if __name__ == "__main__":
    main()
