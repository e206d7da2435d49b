"""Train GPT-2 with PyTorch FSDP, with or without TAGC gradient compression.

One process per device, launched by torchrun, on one node or several:

    # tiny model, built-in offline corpus, 2 CPU processes (gloo), TAGC exact mode
    torchrun --standalone --nproc_per_node 2 scripts/train_gpt2.py --tagc tagc-exact
    # baseline (plain FSDP), FSDP2, gradient accumulation 4
    torchrun --standalone --nproc_per_node 2 scripts/train_gpt2.py --fsdp 2 --grad_accum 4
    # the paper's setup on GPUs, 2 nodes
    torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        scripts/train_gpt2.py train-gpt2.yaml --tagc tagc-10x-1bit

Settings come from tagc.train.config.TrainConfig, then an optional YAML file (a bare
``.yaml`` argument or ``--config PATH``), then ``--key=value`` / ``--key value`` overrides,
converted to the field's type.  The whole configuration, the TAGC preset with its
``--tagc_set`` fields included, is checked before any rank loads data: an unknown key
(with the nearest known one), a bad value or a preset this run cannot take (``--tagc
tagc-full`` needs ``--fsdp 2``) is printed once, by rank 0, and every rank exits 2.
``--help`` gives examples, the shipped presets by purpose and every option.

Outputs in ``--out_dir``: metrics.csv, summary.json, config.json, tb/ (TensorBoard) and
ckpt/ (model, optimizer and TAGC state through torch.distributed.checkpoint, each rank's
RNG state); ``--init_from=resume`` continues bit-exactly on CPU.

The harness lives in the tagc.train package (config, model, data, optim, sharding,
metrics, checkpoint, loop); this file only starts it.
"""
from tagc.train.loop import main

if __name__ == "__main__":
    main()
