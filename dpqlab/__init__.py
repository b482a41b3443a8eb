"""dpqlab: the tools that check and model dpq, never shipped in its wheel and never imported by it
(``tests/test_layout.py`` and ``.ci/run`` check): the CUDA timeline model (``timeline/``), the stream
checker, fault injection, the fakes and the simulated link, the statistical-parity formula, real
auto-round blocks recorded mid-run, and the one-GPU check (``gpu_check/``, run by
``benchmarks/gpu_check.sh``). Run from the repository root (tests put it on ``PYTHONPATH``)."""
