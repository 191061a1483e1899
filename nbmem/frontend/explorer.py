"""``nbmem.explore``: sliders and menus over a workload, answered from estimates as you move them.

Each change re-estimates the training step on fake tensors (cached per
configuration) and redraws what the peak is made of against the device's
capacity; a button runs the chosen configuration for real, tracked on this
machine, to check the estimate.
"""

from __future__ import annotations

import html
import importlib.util
import time
from typing import Any

from ..core import _env
from ..core.devices import PRESETS, parse_capacity
from ..estimation.estimate import OPTIMIZERS, PRECISIONS, Estimate, estimate
from ..estimation.finetune import AS_BUILT, check_trainable, trainable_label
from ..estimation.quantization import SHORTHANDS, quantization_label
from ..estimation.finetune import PRESETS as TRAINABLE_PRESETS
from ..estimation.parallel import STRATEGIES, check_parallel
from ..core.rendering import stacked_bar_html
from ..core.units import format_bytes
from ..estimation.userstep import check_step
from ..whatif.sweep import real_mode, run_configuration
from ..estimation.plan import Plan

__all__ = ["explore", "Explorer"]

#: The GPU counts the panel offers (estimates answer any of them).
WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: The most ranks the button launches for real on this machine.
LAUNCH_LIMIT = 4
#: The optimizer menu's entry for a user's step that builds its own (optimizer=None); a menu value can't be None.
OWN_OPTIMIZER = "your step's own"


class Explorer:
    """The panel: ``controls`` (ipywidgets by knob name), ``view`` (the widget to display)."""

    def __init__(
        self,
        model: Any,
        batch: Any,
        *,
        batch_size: int = 32,
        max_batch_size: int = 1024,
        device: str = "T4",
        precision: str = "fp32",
        checkpointing: bool = False,
        optimizer: str | None = "adamw",
        accumulation: int = 1,
        parallel: str = "single",
        world_size: int = 1,
        step: Any = None,
        trainable: Any = None,
        quantization: Any = None,
    ) -> None:
        import ipywidgets as widgets

        parse_capacity(device)  # clear errors now rather than in a callback
        check_parallel(parallel, world_size)
        check_step(step, accumulation=accumulation, loss=None, optimizer=optimizer, parallel=parallel,
                   precision=precision)
        self.step = step  # the user's own training step (None: nbmem's built-in one)
        check_trainable(trainable)
        weights = _weights_menu(quantization)  # an unknown quantization fails here, not in a callback
        optimizers = list(OPTIMIZERS) + ([OWN_OPTIMIZER] if step is not None else [])
        if world_size not in WORLD_SIZES:
            raise ValueError(f"the explorer offers world sizes {', '.join(map(str, WORLD_SIZES))}, got {world_size}")
        self.model, self.batch = model, batch
        self._cache: dict[tuple[Any, ...], Estimate] = {}
        self.last: Estimate | None = None
        self.measured: Estimate | None = None
        self.seconds = 0.0  # how long the last update took
        style = {"description_width": "initial"}
        self.controls = {
            "batch_size": widgets.IntSlider(batch_size, min=1, max=max_batch_size, description="batch size",
                                            continuous_update=False, style=style),
            "precision": widgets.Dropdown(options=PRECISIONS, value=precision, description="precision", style=style),
            "checkpointing": widgets.Checkbox(value=checkpointing, description="activation checkpointing"),
            "optimizer": widgets.Dropdown(options=optimizers, value=OWN_OPTIMIZER if optimizer is None else optimizer,
                                          description="optimizer", style=style),
            # a user's step owns its loop shape, accumulation included
            "accumulation": widgets.IntSlider(accumulation, min=1, max=32, description="accumulation steps",
                                              continuous_update=False, disabled=step is not None, style=style),
            "device": widgets.Dropdown(options=_devices(device), value=device, description="device", style=style),
            "parallel": widgets.Dropdown(options=list(STRATEGIES), value=parallel, description="data parallel",
                                         style=style),
            "world_size": widgets.Dropdown(options=list(WORLD_SIZES), value=world_size, description="GPUs",
                                           disabled=parallel == "single", style=style),
            "trainable": widgets.Dropdown(options=_trainable_menu(trainable), value=_menu_value(trainable),
                                          description="trains", style=style),
            "quantization": widgets.Dropdown(options=weights, value=AS_BUILT if quantization is None else quantization,
                                             description="weights", style=style),
        }
        self.chart = widgets.HTML()
        self.chart.add_class("nbmem-explore-chart")
        self.button = widgets.Button(description="measure for real (tracked)", button_style="info",
                                     layout=widgets.Layout(width="auto"))
        self.check = widgets.HTML()
        for control in self.controls.values():
            control.observe(self._changed, names="value")
        self.button.on_click(self._measure)
        rows = list(self.controls.values())
        self.view = widgets.VBox(
            [widgets.HBox(rows[:3]), widgets.HBox(rows[3:6]), widgets.HBox(rows[6:]),
             self.chart, widgets.HBox([self.button]), self.check]
        )
        self.view.add_class("nbmem-explore")
        self.update()

    def config(self) -> dict[str, Any]:
        """The knobs the controls show, as :func:`nbmem.estimate` takes them (``step`` included)."""
        config = {name: control.value for name, control in self.controls.items()}
        if config["optimizer"] == OWN_OPTIMIZER:
            config["optimizer"] = None
        for name in ("trainable", "quantization"):
            if config[name] == AS_BUILT:  # a menu value can't be None
                config[name] = None
        return {**config, "step": self.step}

    def _changed(self, change: Any) -> None:
        if change["owner"] is self.controls["parallel"]:
            # one device has no GPU count; a strategy starts from the count shown
            single = change["new"] == "single"
            size = self.controls["world_size"]
            size.disabled = single
            if single and size.value != 1:
                size.value = 1  # observed: updates once more, with both knobs consistent
                return
        self.update()

    def update(self) -> Estimate:
        """Estimate the current configuration (cached) and redraw the chart."""
        started = time.perf_counter()
        config = self.config()
        # a PEFT config can't be hashed: what trains is keyed by its label (the menu holds one value per label)
        key = tuple(sorted((name, trainable_label(value) if name == "trainable" else
                            quantization_label(value) if name == "quantization" else value)
                           for name, value in config.items() if name != "step"))
        if key not in self._cache:
            self._cache[key] = estimate(self.model, self.batch, **config)
        self.last = self._cache[key]
        self.chart.value = _chart_html(self.last)
        self.seconds = time.perf_counter() - started
        return self.last

    def _measure(self, button: Any = None) -> Estimate | None:
        config = self.config()
        ranks = config["world_size"]
        if ranks > LAUNCH_LIMIT:
            self.check.value = (
                f"<div class='nbmem-explore-check' style='font-size:12px'>a real check launches one process per GPU "
                f"on this machine, at most {LAUNCH_LIMIT}: choose {LAUNCH_LIMIT} GPUs or fewer to check the "
                f"estimate</div>"
            )
            return None
        mode = real_mode()
        where = "measured on CUDA" if mode == "measured" else "tracked on this CPU"
        if config["parallel"] != "single":
            where = f"{ranks} real ranks {where}, the largest shown"
        running = f"<i>running the step for real, {where}…</i>"
        self.check.value = running

        def heard(finished: int, world_size: int) -> None:  # issue 15: the real check's progress, rank by rank
            self.check.value = f"{running} <span style='font-size:12px'>{finished} of {world_size} ranks finished</span>"

        where = f"run for real, {where}"
        capacity, _ = parse_capacity(config["device"])
        self.measured = run_configuration(self.model, self.batch, Plan(mode=mode, **config), on_rank=heard)
        estimated = self.update()
        difference = (self.measured.peak - estimated.peak) / estimated.peak if estimated.peak else 0.0
        self.check.value = (
            f"<div class='nbmem-explore-check' style='font-size:12px'>{where}: "
            f"{format_bytes(self.measured.peak)} allocated at the peak (estimate {format_bytes(estimated.peak)}, "
            f"{difference:+.1%}){'' if self.measured.peak <= capacity else ' — does NOT fit'}</div>"
        )
        return self.measured

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle: dict[str, Any] = self.view._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = str(self.last)
        return bundle


def _devices(device: Any) -> list[tuple[str, Any]]:
    """The device menu: the presets, and the given device first when it is a size, labelled readably."""
    presets = [(name, name) for name in PRESETS]
    if isinstance(device, str) and device in PRESETS:
        return presets
    return [(parse_capacity(device)[1], device), *presets]


def _trainable_menu(trainable: Any) -> list[tuple[str, Any]]:
    """The "trains" menu: as built, all, head, lora where peft is installed, and the user's own choice."""
    menu = [(AS_BUILT, AS_BUILT), ("all", "all"), ("head", "head")]
    if importlib.util.find_spec("peft") is not None:
        menu.append(("lora", "lora"))
    if trainable is not None and trainable not in TRAINABLE_PRESETS:
        menu.append((f"yours: {trainable_label(trainable)}", trainable))
    return menu


def _weights_menu(quantization: Any) -> list[tuple[str, Any]]:
    """The "weights" menu: as built, and bitsandbytes' 4-bit and 8-bit where it is installed, and the user's own."""
    menu = [(AS_BUILT, AS_BUILT)]
    if importlib.util.find_spec("bitsandbytes") is not None:
        menu += [(name, name) for name in SHORTHANDS]
    if quantization is not None and quantization not in SHORTHANDS:
        menu.append((f"yours: {quantization_label(quantization)}", quantization))
    elif quantization is not None and len(menu) == 1:
        Plan(batch_size=1, quantization=quantization)  # says what to install
    return menu


def _menu_value(trainable: Any) -> Any:
    return AS_BUILT if trainable is None else trainable


def _chart_html(result: Estimate) -> str:
    capacity = result.capacity or result.peak
    segments = [(name, size) for name, size in result.breakdown.at_peak]
    free = max(capacity - result.peak, 0)
    over = result.peak > capacity
    verdict = (
        f"<b style='color:#b00020'>does NOT fit</b>: {format_bytes(result.peak)} > {format_bytes(capacity)}"
        if over
        else f"fits: {format_bytes(result.peak)} of {format_bytes(capacity)} ({result.peak / capacity:.0%})"
    )
    reserved = f"; reserved {format_bytes(result.reserved)} (simulated)" if result.reserved is not None else ""
    scale = (
        f"; per GPU, {result.parallel} on {result.world_size} GPUs (global batch {result.global_batch})"
        if result.parallel != "single"
        else ""
    )
    return (
        "<div style='font-family:sans-serif;font-size:13px;max-width:48em'>"
        f"<div>estimated peak on <b>{html.escape(result.capacity_label)}</b>: {verdict}{reserved}; "
        f"effective batch {result.effective_batch}{scale}</div>"
        + f"<div style='color:#555'>step: {html.escape(result.step)}</div>"
        + "".join(f"<div style='color:#555'>{html.escape(name.strip())}: {html.escape(text)}</div>"
                  for name, text in (result.trained.rows(result.mode) if result.trained else []))
        + stacked_bar_html([*segments, ("free", free)], "nbmem-explore-bar")
        + "</div></div>"
    )


def explore(model: Any, batch: Any, **options: Any) -> Explorer | None:
    """Open the explorer panel (a notebook with widgets); elsewhere, say so and suggest ``nbmem.sweep``.

    Options: ``batch_size``, ``max_batch_size`` (the slider's end), ``device``,
    ``precision``, ``checkpointing``, ``optimizer``, ``accumulation``,
    ``parallel`` and ``world_size`` (the figures are then per GPU; the
    button launches real ranks on this machine for up to 4 GPUs), and
    ``step``, your own training step ``step(model, batch, optimizer)`` (see
    :func:`nbmem.estimate`; the accumulation slider is then off, and the
    optimizer menu offers "your step's own", ``optimizer=None``), and
    ``trainable`` (see :func:`nbmem.estimate`): the "trains" menu offers
    as built, all, head and lora (where peft is installed), and yours; and
    ``quantization``: the "weights" menu offers as built, nf4, fp4 and int8
    (where bitsandbytes is installed), and yours.
    ``model`` and ``batch`` are as for :func:`nbmem.estimate`. Each change of
    a control re-estimates on fake tensors; returns the :class:`Explorer`
    (``controls``: the widgets by knob name; ``last``: the current
    :class:`~nbmem.Estimate`), or None after printing the hint outside a
    notebook.

    Example, in a notebook cell (it needs a frontend with widgets)::

        build = lambda: torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
        make = lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,)))
        panel = nbmem.explore(build, make, device="T4", batch_size=64, optimizer="adamw")
        panel.last.fits                  # the configuration the controls show now
    """
    if not _env.widgets_usable():
        print(
            "nbmem.explore needs a notebook frontend with widgets (JupyterLab, Jupyter Notebook, VS Code). "
            "Here, compare configurations with nbmem.sweep(model, batch, batch_size=[...], precision=[...], ...)."
        )
        return None
    explorer = Explorer(model, batch, **options)
    from IPython.display import display

    display(explorer)
    return explorer
