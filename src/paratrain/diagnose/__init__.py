"""Diagnostics of a machine and of a job: ``doctor`` (is this machine ready for distributed training?),
``guard`` (a running job's hangs, desyncs and data mistakes, named by rank and line) and ``plot`` (a run's
metrics as a figure; torch-free, so ``paratrain plot`` starts fast)."""
