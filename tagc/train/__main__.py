"""``python -m tagc.train`` (or ``torchrun ... -m tagc.train``): GPT-2 training, the same
as ``scripts/train_gpt2.py``, from an installed package in any folder; its usage line and
launch hints name ``-m tagc.train`` (tagc.train.config.entry_point)."""
from tagc.train.loop import main

if __name__ == "__main__":
    main()
