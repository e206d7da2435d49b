"""What the benchmark and research scripts share (``scripts/bench/``, ``scripts/research/``).

Never imported by ``tagc_hook`` or the hook's modules: a program that only trains with
TAGC does not load it.  A script imports its code from here, never from another script.

* :mod:`tagc.bench.shapes`: the step benchmark's GPT-2 (``scripts/bench/bench_step.py``)
  and the GPT-2 shapes of this repository, from :mod:`tagc.train.model` and the
  shipped ``train-tiny`` preset;
* :mod:`tagc.bench.cost`: the cost model of plain FSDP/HSDP and TAGC (bytes and step
  time; ``scripts/bench/cost_model.py`` is its command line);
* :mod:`tagc.bench.teacher_student`: the teacher-student regression task
  (``python -m tagc.bench.teacher_student``; the quality suite launches it);
* :mod:`tagc.bench.probes`: the tiny GPT-2 schedule and evaluation the one-process
  probes share (``scripts/research/sim_ablation.py``, ``sim_feedback.py``);
* :mod:`tagc.bench.outputs`: where a benchmark writes the report of a run
  (``docs/runs/<name>/``, committed with the figures it backs);
* :mod:`tagc.bench.gpu_check`: ``scripts/gpu_check.sh``, the check a session runs first on
  a borrowed GPU, over :mod:`~tagc.bench.cuda_ops` (every CUDA op against its C twin),
  :mod:`~tagc.bench.cuda_hook` (the hook's CUDA path on one rank),
  :mod:`~tagc.bench.gpu_step` (a GPT-2 124M step with and without the codec) and
  :mod:`~tagc.bench.cuda_emu` (the kernels under the CPU emulation, for ``--dry-run``).
"""
