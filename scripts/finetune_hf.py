"""Train or fine-tune a Hugging Face causal LM with PyTorch FSDP, with or without TAGC.

The model comes from a local checkpoint folder (``--hf_model``: config.json and weights,
read with ``local_files_only``; its tokenizer too when the folder has one) or is built
fresh from a model type and config fields (``--hf_config llama:hidden_size=256,...``).
Nothing is downloaded.  Everything else (data, progress bar, logs, metrics.csv,
TensorBoard, summary.json, checkpoints through torch.distributed.checkpoint, bit-exact
resume, TAGC presets) is scripts/train_gpt2.py's, with the same options:

    torchrun --standalone --nproc_per_node 2 scripts/finetune_hf.py \\
        --hf_config "llama:hidden_size=256,intermediate_size=688,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=2" \\
        --tagc tagc-balanced
    torchrun --standalone --nproc_per_node 2 scripts/finetune_hf.py --hf_model ~/ckpt/my-gpt2 \\
        --fsdp 2 --learning_rate 5e-5 --tagc tagc-lean

A built model without a tokenizer folder trains on byte tokens (its vocab_size is set to
cover them when not given).  Without ``--tagc`` the units are the model's transformer
blocks (its ``_no_split_modules``); with it, TAGC's own layout.  The code is
tagc.train.hf; this file only starts it.
"""
import os

from tagc.train.hf import main

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
