"""The front end: what a notebook or a shell user sees.

The ``%gpumem`` magics (:mod:`.magics`, their options :mod:`.options` and cells
:mod:`.cells`), the widget, HTML and text display
(:mod:`.display`), the live gauge (:mod:`.live_gauge`), the interactive
explorer (:mod:`.explorer`), and ``nbmem profile`` (:mod:`.cli`,
:mod:`.profiling`). The top of the house: nothing below imports it.
"""
