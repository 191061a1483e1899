"""Estimation: a training step's memory before anything runs, on fake tensors.

The fake-tensor mode (:mod:`.fakemode`), with the ops whose outputs it makes as
the kernels do rather than as PyTorch's meta functions do (:mod:`.kernel_outputs`), building models without memory
(:mod:`.building`), the training step, nbmem's own or the user's
(:mod:`.step`, :mod:`.userstep`, :mod:`.tasks`), fine-tuning choices
(:mod:`.finetune`), CUDA's autocast policy, attention and dropout kernels followed
on a CPU (:mod:`.autocast_policy`, :mod:`.attention`, :mod:`.dropout`, :mod:`.kernels`), cuDNN's
LSTM/GRU kernel as an NVIDIA GPU runs it (:mod:`.cudnn_rnn`, its workspace model fitted to an H100's
sizes in :mod:`.cudnn_rnn_fit`), data
parallelism (:mod:`.parallel`), quantized weights and low-bit optimizers through
bitsandbytes' and torchao's own code (:mod:`.quantization`, :mod:`.quantized_layers`,
:mod:`.quantized_kernels`, :mod:`.low_bit`), what it can't run and says so
(:mod:`.unsupported`: compiled code, bitsandbytes models built on fake tensors),
and ``nbmem.estimate`` itself (:mod:`.estimate`), whose result is :mod:`.result`'s.
Built on :mod:`nbmem.tracking` and :mod:`nbmem.core`.
"""
