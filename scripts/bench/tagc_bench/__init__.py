"""What the benchmark and research scripts share (``scripts/bench/``, ``scripts/research/``):
the code that needs a checkout, so it lives beside the scripts and never ships in the wheel.

Importable by the scripts of ``scripts/bench/`` (a script's own folder is on the path),
by those of ``scripts/research/`` (each puts ``scripts/bench/`` on the path) and by the
tests (``tests/conftest.py`` does).  Never imported by ``tagc`` or ``tagc_hook``.  A
script imports its code from here or from ``tagc``, never from another script.  What works
installed stays in the package: the cost model, the step benchmark's rows and the GPT-2
shapes are :mod:`tagc.cost` (``python -m tagc.cost``).

* :mod:`tagc_bench.teacher_student`: the teacher-student regression task
  (``python3 scripts/research/teacher_student.py``; the quality suite launches it);
* :mod:`tagc_bench.probes`: the tiny GPT-2 schedule and evaluation the one-process
  probes share (``scripts/research/sim_ablation.py``, ``sim_feedback.py``);
* :mod:`tagc_bench.outputs`: where a benchmark writes the report of a run
  (``docs/runs/<name>/`` of the checkout, committed with the figures it backs);
* :mod:`tagc_bench.gpu_check`: ``scripts/gpu_check.sh``, the check a session runs first on
  a borrowed GPU, over :mod:`~tagc_bench.cuda_ops` (every CUDA op against its C twin),
  :mod:`~tagc_bench.cuda_hook` (the hook's CUDA path on one rank),
  :mod:`~tagc_bench.gpu_step` (a GPT-2 124M step with and without the codec) and
  :mod:`~tagc_bench.cuda_emu` (the checkout's ``cuda/`` kernels under the CPU emulation,
  for ``--dry-run``).
"""
