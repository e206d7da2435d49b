"""``python -m tagc.train`` (or ``torchrun ... -m tagc.train``): GPT-2 training, the same
as ``scripts/train_gpt2.py``, from an installed package in any folder."""
from tagc.train.loop import main

if __name__ == "__main__":
    main()
