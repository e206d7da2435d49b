"""A training process that imports everything first, then waits for a file before it
runs ``python -m tagc.train`` with the rest of its arguments: tests/test_ft_train.py
restarts a replica group this way so that torch's import time (seconds, and noisy on a
loaded machine) does not race the survivor's remaining steps.

Usage (under torchrun): ``ft_gate.py GATE_FILE [tagc.train options]``.
"""
import sys
import time
from pathlib import Path

from tagc.train.loop import main

if __name__ == "__main__":
    gate = Path(sys.argv[1])
    print("ft_gate: imported, waiting", flush=True)
    while not gate.exists():
        time.sleep(0.01)
    main(sys.argv[2:])
