"""Measuring and tracking: what a real run holds, seen while it runs.

Nestable peak scopes over a counter (:mod:`.counters`), and the devices'
own counters, CUDA's and every other accelerator's (:mod:`.accelerators`); the tracked mode's two
engines, a dispatch mode (:mod:`.tracker`, :mod:`.dispatch`) and the CPU
allocator wrapped in C++ (:mod:`.native`, :mod:`.native_tracking`, ``_native/``), and
what a tracker keeps off the device (:mod:`.host_memory`), among it an
optimizer's step counters, host memory on a GPU (:mod:`.host_counters`);
what they install and how it comes out again (:mod:`.installed`); attribution
to categories and modules (:mod:`.categories`); the baseline walk of live
tensors (:mod:`.live`); nestable scopes, the API of ``nbmem.measure`` and
``nbmem.track`` (:mod:`.scope`), and how a block is measured, the backend and engine it resolves to
(:mod:`.backends`); the timeline, out-of-memory diagnosis and
reclaiming what failed cells hold (:mod:`.timeline`, :mod:`.diagnosis`,
:mod:`.reclaim`); compiled code in a block, seen and guessed (:mod:`.compiled`). Built on :mod:`nbmem.core` only.
"""
