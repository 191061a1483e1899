"""torch.compile'd code in measured blocks and estimates: never an eager figure called compiled (issue 23).

Under tracked mode's dispatch engine PyTorch runs no compiled frame, so a
compiled model runs its eager Python: the result must say so. The "auto"
engine (the default) takes the native engine where the block will run compiled
code, under which it runs compiled and inductor's buffers are counted.
Estimates run compiled code as eager on purpose (fake tensors must never reach
inductor's kernels) and say so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import nbmem
from nbmem.tracking import compiled
from nbmem.tracking.native import available
from nbmem.tracking.tracker import remove_every_tracker

MiB = 1024**2
needs_native = pytest.mark.skipif(
    not available() and not os.environ.get("NBMEM_REQUIRE_NATIVE"), reason="the native engine needs a C++ compiler"
)


@pytest.fixture(autouse=True)
def _forget_compiled_code():
    """What a test saw of compiled code must not steer later tests' engines (compiled.seen is process-wide)."""
    yield
    compiled._seen = False
    assert not compiled.probe_installed(), "a scope left the probe that counts compiled calls in Dynamo"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))


def step(model, x) -> None:
    model(x).sum().backward()


@pytest.fixture(scope="module")
def eager_compiled():
    """An MLP compiled with the "eager" backend: Dynamo's entry and guards, no inductor (cheap to compile)."""
    model = mlp()
    fast = torch.compile(model, backend="eager")
    step(fast, torch.randn(64, 256))  # compiled here, outside any scope
    return model, fast


def test_the_dispatch_engine_says_compiled_code_ran_eagerly(eager_compiled):
    _, fast = eager_compiled
    x = torch.randn(64, 256)
    with nbmem.track("cpu", engine="dispatch") as scope:
        step(fast, x)
    result = scope.result
    assert scope.compiled_calls == 1  # one OptimizedModule call
    assert result.compiled == "eager"
    assert "EAGER FIGURES" in result.text() and "ran EAGER" in result.summary()
    assert any("the native engine measures compiled code compiled" in note for note in result.notes)
    assert compiled.seen()  # later "auto" scopes pick the native engine


def test_no_compiled_code_no_word_about_it(eager_compiled):
    model, _ = eager_compiled
    with nbmem.track("cpu", engine="dispatch") as scope:
        step(model, torch.randn(64, 256))
    assert (scope.compiled_calls, scope.result.compiled) == (0, None)
    assert "compile" not in scope.result.text()
    assert not compiled.seen()


def test_a_compiled_function_is_counted_per_call():
    double = torch.compile(lambda t: t * 2, backend="eager")
    double(torch.ones(4))
    with nbmem.track("cpu", engine="dispatch") as scope:
        for _ in range(3):
            double(torch.ones(4))
    assert scope.compiled_calls == 3


def test_compiled_code_run_under_the_dispatch_engine_stays_compiled_afterwards():
    # PyTorch marks a frame it skipped under a dispatch mode skipped for good: without nbmem's care, one
    # tracked cell would have de-compiled the user's model for the rest of the session (torch 2.13)
    graph_runs = []

    def counting(graph, example_inputs):
        def run(*args):
            graph_runs.append(1)
            return graph(*args)

        return run

    fast = torch.compile(lambda t: t.sin() + 1, backend=counting)
    fast(torch.ones(4))
    assert len(graph_runs) == 1
    with nbmem.track("cpu", engine="dispatch") as scope:
        fast(torch.ones(4))
    assert (scope.compiled_calls, len(graph_runs)) == (1, 1)  # eager inside: the graph did not run
    fast(torch.ones(4))
    assert len(graph_runs) == 2  # compiled again outside


def test_guessing_from_names():
    net = nn.Linear(2, 2)
    fast = torch.compile(nn.Linear(2, 2), backend="eager")
    in_place = nn.Sequential(nn.Linear(2, 2))
    in_place[0].compile(backend="eager")
    code = lambda source: compile(source, "<cell>", "exec")  # noqa: E731
    assert compiled.expects_compiled(code("m = torch.compile(net)"))
    assert compiled.expects_compiled(code("net.compile()"))
    assert not compiled.expects_compiled(code("y = net(x)"), {"net": net})
    assert compiled.expects_compiled(code("y = fast(x)"), {"fast": fast})
    assert compiled.expects_compiled(code("y = model(x)"), {"model": in_place})  # a submodule compiled in place
    assert compiled.expects_compiled(code("def f():\n    return fast(x)\n"), {"fast": fast})  # inside a function
    # a local shadows a global of the same name
    assert not compiled.expects_compiled(code("y = fast(x)"), {"fast": net}, {"fast": fast})


def tracked_global_model() -> nbmem.MemoryScope:
    with nbmem.track("cpu") as scope:  # engine="auto": this function names `GLOBAL_MODEL`, an OptimizedModule
        step(GLOBAL_MODEL, torch.randn(64, 256))  # noqa: F821  (set by the test)
    return scope


@needs_native
def test_auto_takes_the_native_engine_for_a_block_that_names_compiled_code(eager_compiled):
    # a global: a function's locals are read only from Python 3.13 on (earlier, reading them keeps them alive)
    globals()["GLOBAL_MODEL"] = eager_compiled[1]
    try:
        scope = tracked_global_model()
    finally:
        del globals()["GLOBAL_MODEL"]
    assert (scope.engine, scope.chose_native, scope.result.compiled) == ("native", True, "compiled")
    assert any("ran compiled (1 call(s))" in note and "chosen for it" in note for note in scope.result.notes)
    assert not compiled.seen()  # it ran compiled: nothing to learn


def tracked_through(holder: dict) -> nbmem.MemoryScope:
    """A tracked step of ``holder["model"]``: no name here is bound to compiled code, so "auto" can't guess it."""
    with nbmem.track("cpu") as scope:
        step(holder["model"], torch.randn(8, 256))
    return scope


@needs_native
def test_after_an_eager_run_auto_scopes_take_the_native_engine(eager_compiled):
    holder = {"model": eager_compiled[1]}
    first = tracked_through(holder)
    assert (first.engine, first.result.compiled) == ("dispatch", "eager")
    second = tracked_through(holder)
    assert (second.engine, second.result.compiled) == ("native", "compiled")


@needs_native
def test_a_virtual_capacity_keeps_the_dispatch_engine_and_says_why(eager_compiled):
    _, fast = eager_compiled
    with nbmem.track("cpu", capacity="1GiB") as scope:
        step(fast, torch.randn(8, 256))
    assert (scope.engine, scope.result.compiled) == ("dispatch", "eager")
    assert any("--capacity, --timeline and --lines need every op" in note for note in scope.result.notes)


@pytest.mark.slow  # inductor builds C++ kernels: seconds
@needs_native
def test_inductor_measured_compiled_holds_what_the_native_engine_sees_not_the_eager_figure():
    model = mlp()
    fast = torch.compile(model)  # inductor
    x = torch.randn(512, 256)
    step(fast, x)
    for parameter in model.parameters():
        parameter.grad = None
    with nbmem.track("cpu", engine="native") as truth:
        step(fast, x)
    for parameter in model.parameters():
        parameter.grad = None
    with nbmem.track("cpu") as auto:  # names `fast`: the native engine, compiled
        step(fast, x)
    for parameter in model.parameters():
        parameter.grad = None
    with nbmem.track("cpu", engine="dispatch") as eager:
        step(fast, x)
    assert auto.result.compiled == "compiled" and eager.result.compiled == "eager"
    assert auto.result.peak == truth.result.peak  # the same compiled step, counted the same way, to the byte
    assert eager.result.peak != auto.result.peak  # the eager figure is another step's: it is not reported as this one


def test_the_probe_is_out_after_every_scope_and_after_unload(eager_compiled):
    _, fast = eager_compiled
    frames = sys.modules["torch._dynamo.eval_frame"]
    original = frames._callback_from_stance
    scope = nbmem.track("cpu", engine="dispatch").start()
    assert compiled.probe_installed()
    with nbmem.track("cpu", engine="dispatch"):  # nested: the inner one's end leaves the outer's probe in
        pass
    assert compiled.probe_installed()
    remove_every_tracker()  # as %unload_ext nbmem does, for a scope Ctrl-C cut off from its stop()
    assert frames._callback_from_stance is original
    scope.stop()
    assert frames._callback_from_stance is original


# -- the magics ---------------------------------------------------------------


@needs_native
def test_gpumem_cell_with_a_compiled_model_is_measured_compiled(shell, eager_compiled):
    shell.user_ns.update(fast=eager_compiled[1], torch=torch)
    shell.run_cell("%%gpumem -q --backend tracked --device cpu\nfast(torch.randn(8, 256)).sum().backward()")
    (entry,) = nbmem.history(shell)
    assert entry.compiled == "compiled"
    shell.run_cell("%%gpumem -q --backend tracked --device cpu --engine dispatch\nfast(torch.randn(8, 256)).sum().backward()")
    assert nbmem.history(shell)[-1].compiled == "eager"


@needs_native
def test_gpumem_on_measures_a_compiled_cell_compiled(shell, eager_compiled):
    shell.user_ns.update(fast=eager_compiled[1], torch=torch)
    shell.run_cell("%gpumem on -q --backend tracked --device cpu")
    shell.run_cell("fast(torch.randn(8, 256)).sum().backward()")
    shell.run_cell("%gpumem off -q")
    assert nbmem.history(shell)[-1].compiled == "compiled"


# -- estimates ----------------------------------------------------------------


def batch(n: int) -> tuple[torch.Tensor]:
    return (torch.randn(n, 256),)


def test_an_estimate_of_a_compiled_model_runs_it_eagerly_and_says_so():
    eager = nbmem.estimate(mlp, batch, batch_size=32)
    estimate = nbmem.estimate(lambda: torch.compile(mlp()), batch, batch_size=32)  # inductor, never reached
    assert (estimate.first_step, estimate.steady) == (eager.first_step, eager.steady)
    (note,) = [note for note in estimate.notes if note.startswith("estimated as eager")]
    assert "torch.compile'd code 2 time(s)" in note  # one forward a step, two steps


def test_an_estimate_with_a_compiled_step_or_loss_gives_a_result():
    def plain_step(model, inputs, optimizer):
        model(*inputs).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    eager = nbmem.estimate(mlp, batch, batch_size=32, step=plain_step)
    compiled_step = nbmem.estimate(mlp, batch, batch_size=32, step=torch.compile(plain_step))
    loss = torch.compile(lambda out: out.float().pow(2).mean())

    def step_with_compiled_loss(model, inputs, optimizer):
        loss(model(*inputs)).backward()
        optimizer.step()
        optimizer.zero_grad()

    compiled_loss = nbmem.estimate(mlp, batch, batch_size=32, step=step_with_compiled_loss)
    for result in (compiled_step, compiled_loss):
        assert result.steady == eager.steady
        assert any(note.startswith("estimated as eager") for note in result.notes)


@pytest.mark.slow  # a fresh interpreter: Dynamo first loaded inside the block
def test_compile_first_used_inside_a_block_is_said_to_be_unknown():
    source = textwrap.dedent(
        """
        import torch, nbmem
        hidden = {}
        with nbmem.track("cpu", engine="dispatch") as scope:
            hidden["f"] = getattr(torch, "com" + "pile")(lambda t: t + 1, backend="eager")
            hidden["f"](torch.ones(2))
        print(scope.result.compiled)
        """
    )
    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["unknown"]


@needs_native
def test_a_native_scope_around_a_dispatch_scope_says_its_compiled_calls_ran_eagerly(eager_compiled):
    _, fast = eager_compiled
    with nbmem.track("cpu", engine="native") as outer:
        with nbmem.track("cpu", engine="dispatch") as inner:
            step(fast, torch.randn(8, 256))
    assert inner.result.compiled == "eager"
    assert outer.result.compiled == "eager"  # the call ran eagerly for the inner scope: not the compiled figure
    assert any("because a scope with a dispatch mode" in note for note in outer.result.notes)
