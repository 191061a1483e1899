"""Attribution: what each tracked storage is for, and which module it belongs to.

Installed while a :class:`~nbmem.tracking.tracker.Tracker` is active and removed with
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

import threading
import weakref
from typing import Any, Protocol

import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

from ..core.cudnn import cudnn_kind
from .dispatch import skip_dynamo



class Accounts(Protocol):
    """What attribution needs of a tracker (:class:`nbmem.tracking.tracker.Tracker` is one).

    A protocol rather than an import: the tracker installs an Attribution, so
    this module sits below nbmem.tracking.tracker and must not import it.
    """

    _attribution: Any

    def classify(self, tensor: torch.Tensor, category: str, module: str | None = None) -> None: ...

    def module_of(self, tensor: torch.Tensor) -> str | None: ...

__all__ = ["Attribution", "top_level", "BACKWARD", "global_hooks", "remove_global_hooks", "saved_tensors_hooks_installed",
           "hooks_disable_wrapped"]

BACKWARD = "(backward)"

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# torch.utils._mode_utils.no_dispatch: no Python dispatch mode or subclass sees the ops inside
_NO_PYTHON_DISPATCH = torch._C._DisableTorchDispatch


# True while Dynamo traces (torch.compile): a hook it inlines must not touch nbmem's state
_compiling = torch.compiler.is_compiling


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


#: torch's global hook tables that :meth:`Attribution.install` adds to.
_GLOBAL_HOOKS: tuple[dict[int, Any], ...] = (
    nn_module._global_forward_pre_hooks,
    nn_module._global_forward_hooks,
    nn_module._global_parameter_registration_hooks,
    nn_module._global_buffer_registration_hooks,
    optim_module._global_optimizer_pre_hooks,
    optim_module._global_optimizer_post_hooks,
)


def _owner_of(hook: Any) -> "Attribution | None":
    owner = getattr(hook, "__self__", None)
    return owner if isinstance(owner, Attribution) else None


def global_hooks(tracker: "Accounts | None" = None) -> list[Any]:
    """nbmem's hooks in torch's global module and optimizer hook tables (``tracker``'s, or any)."""
    return [
        hook
        for hooks in _GLOBAL_HOOKS
        for hook in list(hooks.values())
        if (owner := _owner_of(hook)) is not None and (tracker is None or owner.tracker is tracker)
    ]


def saved_tensors_hooks_installed() -> bool:
    """Whether the innermost saved-tensors hooks are nbmem's."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return top is not None and _owner_of(top[0]) is not None


class Attribution:
    """The hooks that keep a tracker's categories and modules right (see the module docstring).

    Installing and removing survive an interrupt at any bytecode (issue 12):
    :meth:`remove` finds the hooks in torch's own tables rather than trusting
    handles an interrupt may have lost, and is idempotent.
    """

    def __init__(self, tracker: Accounts) -> None:
        self.tracker = tracker
        self._running: list[str | None] = []  # top-level module of each forward in progress
        self._thread: int | None = None  # the thread whose module calls are followed: install()'s
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        # parameters that may carry this attribution's post-accumulate-grad
        # hook, noted *before* the hook is registered, so remove() finds it
        self._hooked: dict[int, weakref.ref[torch.Tensor]] = {}
        self._stepping: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # optimizers inside step()
        self._saved = False  # set before pushing the saved-tensors hooks, for the same reason
        self._alone = False  # whether every saved-tensors hook below this one's, when pushed, was nbmem's
        #: Told the top-level module running after each module call begins or ends
        #: (the native engine labels allocations with it in C++); None: nobody asks.
        self.module_changed: Any = None
        #: Calls so far of layers that run cuDNN's kernels on an NVIDIA GPU, by kind (nbmem.core.cudnn): a tracked
        #: scope's result says what those would add
        self.cudnn_calls: dict[str, int] = {}

    # -- install / remove ----------------------------------------------------

    def install(self) -> None:
        """Install every hook; when interrupted, :meth:`remove` takes out what got in."""
        self._thread = threading.get_ident()  # module calls are followed on this thread only
        nn_module.register_module_forward_pre_hook(self._on_forward)
        nn_module.register_module_forward_hook(self._on_forward_end, always_call=True)
        nn_module.register_module_parameter_registration_hook(self._on_parameter)
        nn_module.register_module_buffer_registration_hook(self._on_buffer)
        optim_module.register_optimizer_step_pre_hook(self._on_step_begin)
        optim_module.register_optimizer_step_post_hook(self._on_step_end)
        below = torch._C._autograd._top_saved_tensors_default_hooks(True)
        owner = None if below is None else _owner_of(below[0])
        self._alone = below is None or (owner is not None and owner._alone)
        _let_nbmems_hooks_be_disabled()
        self._saved = True
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, _unpack)

    def remove(self) -> None:
        """Remove every hook this installed; safe to call more than once, and to call again when interrupted."""
        if self._saved:
            _remove_saved_tensors_hooks(self)
            self._saved = False
        if not saved_tensors_hooks_installed():  # no other tracker's (an outer scope's) left on top
            _restore_hooks_disable()
        remove_global_hooks(self.tracker)
        for key, ref in list(self._hooked.items()):
            parameter = ref()
            hooks = None if parameter is None else parameter._post_accumulate_grad_hooks
            for hook_id, hook in list((hooks or {}).items()):
                if getattr(hook, "__self__", None) is self:
                    hooks.pop(hook_id, None)  # type: ignore[union-attr]
            self._hooked.pop(key, None)
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
        if _compiling():
            return  # torch.compile traces module calls with their global hooks: nbmem's stay out of its graph
        if threading.get_ident() != self._thread:
            return  # the hooks are global: another thread's model (a background thread's) is not this block's
        kind = cudnn_kind(module)
        if kind is not None:
            self.cudnn_calls[kind] = self.cudnn_calls.get(kind, 0) + 1
        name = self.name_of(module)
        owner = top_level(name)
        outermost = not self._running
        self._running.append(owner)
        if self.module_changed is not None:
            self.module_changed(owner)
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
        if parameter.requires_grad:
            known = self._hooked.get(id(parameter))
            if known is None or known() is not parameter:
                self._hooked[id(parameter)] = weakref.ref(parameter)
                parameter.register_post_accumulate_grad_hook(self._on_grad)

    def adopt_parameter(self, parameter: torch.nn.Parameter) -> None:
        """A parameter alive when a scope opens: a parameter, its ``.grad`` a gradient, its next grads hooked.

        A backward run in a cell of its own, the forward in the cell before,
        runs no module, so the forward hooks never meet these parameters.
        """
        owner = self._owner(parameter)
        self._parameter(parameter, owner)
        if parameter.grad is not None:
            self.tracker.classify(parameter.grad, "gradient", owner)

    def _on_forward_end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if _compiling() or threading.get_ident() != self._thread:
            return
        if self._running:
            self._running.pop()
        if self.module_changed is not None:
            self.module_changed(self.current_module())

    def _on_parameter(self, module: torch.nn.Module, name: str, parameter: Any) -> Any:
        if parameter is not None:
            self.tracker.classify(parameter, "parameter")
        return None

    def _on_buffer(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        if buffer is not None:
            self.tracker.classify(buffer, "buffer")
        return None

    def _owner(self, parameter: torch.Tensor) -> str | None:
        return self.tracker.module_of(parameter)

    def _on_grad(self, parameter: torch.Tensor) -> None:
        # a hook an interrupted removal left on a parameter does nothing
        if parameter.grad is not None and self.tracker._attribution is self:
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
        if type(tensor) in _PLAIN:
            # A view of a known storage, nothing to count: past the tracker's
            # dispatch mode, which would cost a whole op's 10-20 us for every
            # saved tensor. A subclass (a FakeTensor of an estimate, a DTensor)
            # must reach its own __torch_dispatch__ to stay what it is.
            with _NO_PYTHON_DISPATCH():
                return tensor.detach()
        return tensor.detach()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def remove_global_hooks(tracker: Accounts) -> None:
    """Take every hook of ``tracker``'s attributions out of torch's global tables (idempotent)."""
    for hooks in _GLOBAL_HOOKS:
        for hook_id, hook in list(hooks.items()):
            owner = _owner_of(hook)
            if owner is not None and owner.tracker is tracker:
                # register_module_forward_hook(always_call=True) notes the id here too: out first,
                # so that a repeat after an interrupt between the two still finds the hook
                nn_module._global_forward_hooks_always_called.pop(hook_id, None)
                hooks.pop(hook_id, None)


def _remove_saved_tensors_hooks(attribution: Attribution) -> None:
    """Pop ``attribution``'s saved-tensors hooks, leaving any pushed above them (a cell's own) in place."""
    above: list[tuple[Any, Any]] = []
    try:
        while (top := torch._C._autograd._top_saved_tensors_default_hooks(True)) is not None:
            if _owner_of(top[0]) is attribution:
                torch._C._autograd._pop_saved_tensors_default_hooks()
                break
            above.append(top)
            torch._C._autograd._pop_saved_tensors_default_hooks()
    finally:
        for pack, unpack in reversed(above):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


# -- code that turns saved-tensors hooks off --------------------------------------------------------------------------
# torch.func's grad, vjp, jacrev and hessian (torch/_functorch/vmap.py: doesnt_support_saved_tensors_hooks), and anyone's
# torch.autograd.graph.disable_saved_tensors_hooks, call torch._C._autograd._saved_tensors_hooks_disable(message), which
# raises that message when any hooks are pushed: under a tracker, nbmem's were, and the user's code failed only because
# it was tracked. While nbmem's hooks are in, that function is wrapped: when every hook pushed is nbmem's, it turns them
# off without failing (fail_if_non_empty=False, as aot_autograd's own runtime does), and the tensors autograd saves
# there count as "other" rather than "activation". With a hook of anyone else's pushed, torch's own check decides.

_DISABLE = torch._C._autograd._saved_tensors_hooks_disable


def _disable_unless_only_nbmems(message: str, fail_if_non_empty: bool = True) -> None:
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    owner = None if top is None else _owner_of(top[0])
    if owner is not None and owner._alone:
        fail_if_non_empty = False
    _DISABLE(message, fail_if_non_empty)


def hooks_disable_wrapped() -> bool:
    """Whether torch's ``_saved_tensors_hooks_disable`` is nbmem's wrapper now (only while nbmem's hooks are in)."""
    return torch._C._autograd._saved_tensors_hooks_disable is _disable_unless_only_nbmems


def _let_nbmems_hooks_be_disabled() -> None:
    torch._C._autograd._saved_tensors_hooks_disable = _disable_unless_only_nbmems


def _restore_hooks_disable() -> None:
    torch._C._autograd._saved_tensors_hooks_disable = _DISABLE


# Dynamo compiles any Python frame that starts while a compiled region runs: a hook that autograd or a module
# call runs there would be compiled (and recompiled, per tensor) on its own. Skipped, with what they call.
for _hook in ("_on_forward", "_on_forward_end", "_on_parameter", "_on_buffer", "_on_grad", "_on_step_begin", "_on_step_end"):
    skip_dynamo(getattr(Attribution, _hook))
