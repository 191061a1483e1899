"""Attribution: what each tracked storage is for, and which module it belongs to.

Installed while a :class:`~nbmem.tracking.Tracker` is active and removed with
it, whatever the cell does. It tells the tracker:

- parameters and buffers: when a module registers them (construction) and
  whenever a module runs (for ones made earlier);
- gradients: after autograd accumulates a parameter's ``.grad``
  (post-accumulate-grad hooks, removed afterwards), and at every optimizer step;
- optimizer state: every tensor in ``optimizer.state`` after a step;
- activations: what autograd saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``), the honest definition;
- modules: the top-level module running while a storage is made, named as
  ``torch.utils.module_tracker.ModuleTracker`` names them. Only forward is
  followed: ModuleTracker's backward tracking registers autograd hooks on
  every module call and made tracked steps 1.2x slower still (measured on a
  CNN); storages made during backward are labelled ``(backward)``, except
  gradients, which go to their parameter's module.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

if TYPE_CHECKING:  # pragma: no cover
    from .tracking import Tracker

__all__ = ["Attribution", "top_level", "BACKWARD"]

BACKWARD = "(backward)"


def top_level(name: str | None) -> str | None:
    """The top-level part of a module path: ``"Sequential.0.fc"`` -> ``"Sequential.0"``.

    A root module with no children is its own top level.

    >>> top_level("Sequential.0.fc"), top_level("CrossEntropyLoss"), top_level(None)
    ('Sequential.0', 'CrossEntropyLoss', None)
    """
    if not name:
        return None
    return ".".join(name.split(".")[:2])


def _owner_path(module_name: str, path: str) -> str:
    """The module that holds ``path`` (``"0.weight"`` under ``"Sequential"`` -> ``"Sequential.0"``)."""
    return f"{module_name}.{path.rsplit('.', 1)[0]}" if "." in path else module_name


class Attribution:
    """The hooks that keep a tracker's categories and modules right (see the module docstring)."""

    def __init__(self, tracker: "Tracker") -> None:
        self.tracker = tracker
        self._running: list[str | None] = []  # top-level module of each forward in progress
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._handles: list[Any] = []
        self._grad_hooks: dict[int, Any] = {}
        self._stepping: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # optimizers inside step()
        self._saved: Any = None

    # -- install / remove ----------------------------------------------------

    def install(self) -> None:
        try:
            self._handles += [
                nn_module.register_module_forward_pre_hook(self._on_forward),
                nn_module.register_module_forward_hook(self._on_forward_end, always_call=True),
                nn_module.register_module_parameter_registration_hook(self._on_parameter),
                nn_module.register_module_buffer_registration_hook(self._on_buffer),
                optim_module.register_optimizer_step_pre_hook(self._on_step_begin),
                optim_module.register_optimizer_step_post_hook(self._on_step_end),
            ]
            saved = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            saved.__enter__()
            self._saved = saved
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Remove every hook this installed; safe to call more than once."""
        if self._saved is not None:
            saved, self._saved = self._saved, None
            saved.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for handle in self._grad_hooks.values():
            handle.remove()
        self._grad_hooks.clear()
        self._running.clear()

    # -- names -----------------------------------------------------------------

    def name_of(self, module: torch.nn.Module) -> str:
        """A module's path as ModuleTracker names it: root class name, then attribute names."""
        name = self._names.get(module)
        if name is None:
            name = type(module).__name__
            self._names[module] = name
            self._name_children(module, name)
        return name

    def _name_children(self, module: torch.nn.Module, name: str) -> None:
        for child_name, child in module.named_children():
            if child not in self._names:
                self._names[child] = f"{name}.{child_name}"
                self._name_children(child, f"{name}.{child_name}")

    def current_module(self) -> str | None:
        if self._running:
            return self._running[-1]
        if torch._C._current_graph_task_id() != -1:  # inside autograd's backward (as ModuleTracker checks)
            return BACKWARD
        return None

    # -- hooks -------------------------------------------------------------------

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        name = self.name_of(module)
        owner = top_level(name)
        outermost = not self._running
        self._running.append(owner)
        if outermost:
            # The whole tree, once per outermost call: some parameters are used
            # without their module ever being called (MultiheadAttention's
            # out_proj goes straight to F.multi_head_attention_forward).
            for path, parameter in module.named_parameters():
                self._parameter(parameter, top_level(_owner_path(name, path)))
            for path, buffer in module.named_buffers():
                self.tracker.classify(buffer, "buffer", top_level(_owner_path(name, path)))
            return
        for own_parameter in module._parameters.values():
            if own_parameter is not None:
                self._parameter(own_parameter, owner)
        for own_buffer in module._buffers.values():
            if own_buffer is not None:
                self.tracker.classify(own_buffer, "buffer", owner)

    def _parameter(self, parameter: torch.nn.Parameter, owner: str | None) -> None:
        self.tracker.classify(parameter, "parameter", owner)
        if parameter.requires_grad and id(parameter) not in self._grad_hooks:
            self._grad_hooks[id(parameter)] = parameter.register_post_accumulate_grad_hook(self._on_grad)

    def _on_forward_end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._running:
            self._running.pop()

    def _on_parameter(self, module: torch.nn.Module, name: str, parameter: Any) -> Any:
        if parameter is not None:
            self.tracker.classify(parameter, "parameter")
        return None

    def _on_buffer(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        if buffer is not None:
            self.tracker.classify(buffer, "buffer")
        return None

    def _owner(self, parameter: torch.Tensor) -> str | None:
        record = self.tracker.record_of(parameter)
        return None if record is None else record.module

    def _on_grad(self, parameter: torch.Tensor) -> None:
        if parameter.grad is not None:
            self.tracker.classify(parameter.grad, "gradient", self._owner(parameter))

    def settle(self) -> None:
        """Classify what an optimizer interrupted mid-step (by an error) has already made.

        Its state tensors are in ``optimizer.state`` from the start of a step,
        but the step-end hook that names them never runs when the step fails.
        """
        for optimizer in list(self._stepping):
            self._on_step_end(optimizer, (), {})

    def _on_step_begin(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._stepping.add(optimizer)
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    self.tracker.classify(parameter.grad, "gradient", self._owner(parameter))

    def _on_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._stepping.discard(optimizer)
        for parameter, state in optimizer.state.items():
            owner = self._owner(parameter) if isinstance(parameter, torch.Tensor) else None
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.tracker.classify(value, "optimizer state", owner)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.tracker.classify(tensor, "activation", self.current_module())
        # detached: keeping the tensor itself, with its grad_fn, would make a
        # reference cycle through C++ for an op that saves its own output, and a
        # graph never run backward would never be freed (autograd re-attaches
        # the grad_fn when it unpacks; PyTorch's own docs detach here)
        return tensor.detach()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
