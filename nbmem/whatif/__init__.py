"""What-ifs: many configurations side by side, and the largest batch that fits.

``nbmem.sweep`` (:mod:`.sweep`) and its table (:mod:`.comparison`),
``nbmem.max_batch_size`` (:mod:`.batchsize`), real multi-process runs
(``nbmem.launch``, :mod:`.launcher`; its folders, :mod:`.launch_folders`, and what ranks leave
in them, :mod:`.rank_files`), and the progress view of long ones
(:mod:`.progress`). Built on :mod:`nbmem.estimation` and the layers below.
"""
