"""Teacher-student regression: a student MLP learns a fixed random teacher MLP, on FSDP2.

The task of the quality suite's ``regression`` rows and of issue 22's probes; the code
is ``tagc.bench.teacher_student`` (which ``python3 -m tagc.bench.teacher_student``
runs from any folder, and ``scripts/bench/quality_suite.py`` launches); this file only
starts it, with the same arguments:

    python3 scripts/research/teacher_student.py plain tagc-lean tagc-balanced
    python3 scripts/research/teacher_student.py plain tagc-lean ternary ternary-res \\
        --batch 256 --steps 100

``--help`` lists the options and the variants.
"""
from tagc.bench.teacher_student import main

if __name__ == "__main__":
    main()
