"""Teacher-student regression: a student MLP learns a fixed random teacher MLP, on FSDP2.

The task of the quality suite's ``regression`` rows and of issue 22's probes; the code
is ``tagc_bench.teacher_student`` (``scripts/bench/tagc_bench/``, the scripts' helpers);
this file starts it, from any folder, with the same arguments, and
``scripts/bench/quality_suite.py`` launches it:

    python3 scripts/research/teacher_student.py plain tagc-lean tagc-balanced
    python3 scripts/research/teacher_student.py plain tagc-lean ternary ternary-res \\
        --batch 256 --steps 100

``--help`` lists the options and the variants.
"""
import sys
from pathlib import Path

# the scripts' helpers, scripts/bench/tagc_bench, from the folder beside this one
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from tagc_bench.teacher_student import main  # noqa: E402 - after the path

if __name__ == "__main__":
    main()
