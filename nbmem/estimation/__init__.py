"""Estimation: a training step's memory before anything runs, on fake tensors.

The fake-tensor mode (:mod:`.fakemode`), building models without memory
(:mod:`.building`), the training step, nbmem's own or the user's
(:mod:`.step`, :mod:`.userstep`, :mod:`.tasks`), fine-tuning choices
(:mod:`.finetune`), CUDA's autocast policy and attention kernels followed on a
CPU (:mod:`.autocast_policy`, :mod:`.attention`, :mod:`.kernels`), data
parallelism (:mod:`.parallel`), what it can't run and says so (:mod:`.unsupported`:
compiled code, bitsandbytes), and ``nbmem.estimate`` itself (:mod:`.estimate`). Built on :mod:`nbmem.tracking` and :mod:`nbmem.core`.
"""
