"""The core: plain data and arithmetic, with no hooks into torch.

Results and the records they are made of (:mod:`.results`, :mod:`.records`),
how they are written as text and HTML (:mod:`.rendering`), byte units
(:mod:`.units`), the CUDA caching allocator's rules as a simulation
(:mod:`.allocator`), device presets (:mod:`.devices`), what cuDNN's kernels
would add (:mod:`.cudnn`), the matplotlib figures
results draw themselves with (:mod:`.charts`) and where nbmem is running
(:mod:`._env`). Every other layer builds on these; they import nothing of
nbmem's from above.
"""
