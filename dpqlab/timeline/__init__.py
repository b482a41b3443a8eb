"""The CUDA timeline model: the real tune recorded on logical GPUs on CPU, then replayed with CUDA's
semantics and a GPU's costs (docs/PERFORMANCE.md, "The CUDA timeline model"). Scaffolding for tests and
benchmarks: the runtime never imports it. Nothing in it is a measurement of a GPU, except what a
calibration file (:mod:`dpqlab.timeline.calibration`) brings from one."""
