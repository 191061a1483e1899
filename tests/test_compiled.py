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
    assert any("--capacity and --timeline need every op" in note for note in scope.result.notes)


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
def test_gpumem_lines_of_a_compiled_cell_are_measured_compiled(shell, eager_compiled):
    shell.user_ns.update(fast=eager_compiled[1], torch=torch)
    cell = shell.run_cell("%%gpumem -o -q --lines --backend tracked --device cpu\nx = torch.randn(8, 256)\nfast(x).sum().backward()")
    result = cell.result
    assert result.compiled == "compiled"
    rows = {line.where: line for line in result.lines}
    count = cell.execution_count
    assert rows[f"cell [{count}], line 1"].allocated == 8 * 256 * 4  # 8 KiB: one block, a multiple of 512 B
    assert rows[f"cell [{count}], line 2"].allocated > 0
    assert sum(line.at_peak for line in result.lines) == result.peak_allocated
    assert "by line of your code" in result.text()
    shell.run_cell("del x")


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


@pytest.mark.slow  # a fresh interpreter: Dynamo first loaded inside the block, nothing compiled
def test_dynamo_imported_inside_a_block_without_compiling_is_no_compiled_code():
    """transformers, torch.utils.flop_counter and an estimate load Dynamo without compiling anything: no claim."""
    source = textwrap.dedent(
        """
        import sys, torch, nbmem
        assert "torch._dynamo" not in sys.modules
        with nbmem.track("cpu", engine="dispatch") as scope:
            import torch._dynamo
            torch.ones(2) + 1
        print(scope.result.compiled, [note for note in scope.result.notes if "compile" in note])
        """
    )
    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "[]"]


@needs_native
def test_a_native_scope_around_a_dispatch_scope_says_its_compiled_calls_ran_eagerly(eager_compiled):
    _, fast = eager_compiled
    with nbmem.track("cpu", engine="native") as outer:
        with nbmem.track("cpu", engine="dispatch") as inner:
            step(fast, torch.randn(8, 256))
    assert inner.result.compiled == "eager"
    assert outer.result.compiled == "eager"  # the call ran eagerly for the inner scope: not the compiled figure
    assert any("because a scope with a dispatch mode" in note for note in outer.result.notes)


# -- compile=True estimates: inductor's own plan on fake tensors (issue 23, part 3) --------------------------------


def _forward_backward(model, inputs, optimizer):
    optimizer.zero_grad(set_to_none=True)
    model(*inputs).float().pow(2).mean().backward()


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                         nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _images(n):
    return (torch.randn(n, 3, 32, 32),)


def _resident(build, batch, size: int) -> int:
    """What a measured block's start already holds: the parameters and the input, each block rounded as CUDA does."""
    from nbmem.core.units import round_allocation

    held = [*build().parameters(), *build().buffers(), *batch(size)]
    return sum(round_allocation(tensor.numel() * tensor.element_size()) for tensor in held)


@pytest.mark.slow  # the truth needs a real inductor compile (C++ kernels): seconds
@needs_native
@pytest.mark.parametrize(("build", "batch", "size"), [(mlp, batch, 512), (_cnn, _images, 64)], ids=["mlp", "cnn"])
def test_a_compile_estimate_equals_the_compiled_step_measured_by_the_native_engine(build, batch, size, fresh_dynamo):
    model = build()
    fast = torch.compile(model)
    inputs = batch(size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # compiled, and recompiled for the second step's gradients, outside the measurement
        _forward_backward(fast, inputs, optimizer)
    model.zero_grad(set_to_none=True)
    with nbmem.track("cpu", engine="native") as truth:
        _forward_backward(fast, inputs, optimizer)
    model.zero_grad(set_to_none=True)
    with nbmem.track("cpu", engine="native") as eager_truth:
        _forward_backward(model, inputs, optimizer)
    assert truth.result.compiled == "compiled"
    planned = nbmem.estimate(build, batch, batch_size=size, optimizer="sgd", step=_forward_backward, compile=True)
    eager = nbmem.estimate(build, batch, batch_size=size, optimizer="sgd", step=_forward_backward)
    # the estimate counts the parameters and the batch too; above them, the compiled step to the byte
    assert planned.steady - _resident(build, batch, size) == truth.result.peak
    # inductor's fused forward and backward hold less than eager's, and the estimates say so
    assert truth.result.peak < eager_truth.result.peak and planned.steady < eager.steady
    assert any(note.startswith("compiled: torch.compile (inductor) ran on the fake tensors") for note in planned.notes)
    assert not any(note.startswith("estimated as eager") for note in planned.notes)
    assert "torch.compile" in planned.plan.describe()


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied: the tests above compiled Sequential.forward many times (its recompile limit is 8)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_estimates_never_use_up_the_recompile_limit_of_the_users_model(fresh_dynamo):
    # (found this session) each estimate compiled the model through code every module shares: after 8 (Dynamo's
    # recompile limit) the 9th estimate gave eager figures, and the user's own compile of that model ran eagerly
    from torch._dynamo.utils import counters

    limit = torch._dynamo.config.recompile_limit
    for size in range(1, limit + 2):
        planned = nbmem.estimate(mlp, batch, batch_size=8 * size, optimizer="sgd", compile=True)
        assert not any("EAGER FIGURES" in note for note in planned.notes), size
    graphs = counters["stats"]["unique_graphs"]
    fast = torch.compile(mlp())
    step(fast, torch.randn(8, 256))
    assert counters["stats"]["unique_graphs"] > graphs  # compiled, not run eagerly


def test_a_compile_estimate_builds_no_kernel_and_leaves_inductor_as_it_was(fresh_dynamo):
    from torch._inductor import async_compile, compile_fx
    from torch._inductor.codecache import PyCodeCache

    before = (PyCodeCache.__dict__["load_by_key_path"], compile_fx.compile_fx, async_compile.AsyncCompile)
    planned = nbmem.estimate(mlp, batch, batch_size=512, optimizer="sgd", compile=True)
    eager = nbmem.estimate(mlp, batch, batch_size=512, optimizer="sgd")
    assert planned.steady < eager.steady
    assert (PyCodeCache.__dict__["load_by_key_path"], compile_fx.compile_fx, async_compile.AsyncCompile) == before
    # the planned wrappers never entered inductor's module cache, where a real compile could find them
    assert not any(module.__name__.startswith("nbmem_planned_") for module in PyCodeCache.modules_no_attr.values())
    # a real model of the same class compiled afterwards runs its real kernels
    model = mlp()
    x = torch.randn(8, 256)
    torch.testing.assert_close(torch.compile(model)(x), model(x))


def test_compile_refuses_what_it_cannot_plan():
    with pytest.raises(ValueError, match=r"compile=True can't be estimated here: a tracked run's dispatch mode"):
        nbmem.estimate(mlp, batch, batch_size=8, compile=True, mode="tracked")
    with pytest.raises(ValueError, match=r"parallel='fsdp' is estimated eagerly"):
        nbmem.estimate(mlp, batch, batch_size=8, compile=True, parallel="fsdp", world_size=2)
    with pytest.raises(ValueError, match="compile must be True or False, got 'inductor'"):
        nbmem.estimate(mlp, batch, batch_size=8, compile="inductor")


def test_a_compile_estimate_whose_graphs_never_ran_says_its_figures_are_eager(fresh_dynamo):
    with torch.compiler.set_stance("force_eager"):  # as a recompile limit reached, or a skipped frame, would
        result = nbmem.estimate(mlp, batch, batch_size=512, optimizer="sgd", compile=True)
    eager = nbmem.estimate(mlp, batch, batch_size=512, optimizer="sgd")
    assert result.steady == eager.steady
    assert result.notes[0].startswith("EAGER FIGURES: compile=True, but no compiled graph of the model ran")
    assert not any(note.startswith("compiled: torch.compile (inductor) ran") for note in result.notes)


def test_a_sweep_puts_the_eager_step_beside_the_compiled_one_and_a_compiled_loss_is_planned_too(fresh_dynamo):
    table = nbmem.sweep(mlp, batch, batch_size=512, optimizer="sgd", step=_forward_backward, compile=[False, True],
                        progress=False)
    eager, planned = (row.result for row in table.rows)
    assert [row.value("compile") for row in table.rows] == [False, True] and str(table).splitlines()[1].startswith("compile")
    assert planned.steady < eager.steady
    assert any(note.startswith("compiled: torch.compile (inductor) ran") for note in planned.notes)
    loss = torch.compile(lambda out: out.float().pow(2).mean())  # inductor: planned as the model is

    def step_with_compiled_loss(model, inputs, optimizer):
        optimizer.zero_grad(set_to_none=True)
        loss(model(*inputs)).backward()

    with_loss = nbmem.estimate(mlp, batch, batch_size=512, optimizer="sgd", step=step_with_compiled_loss, compile=True)
    assert not any(note.startswith(("estimated as eager", "EAGER FIGURES")) for note in with_loss.notes)


def test_max_batch_size_refuses_compile_before_any_estimate(monkeypatch):
    """Its real trials can't run compiled code compiled: refused at once, not after the estimates (a review)."""
    import nbmem.whatif.batchsize as batchsize

    monkeypatch.setattr(batchsize, "estimate_plan", lambda *args, **kwargs: pytest.fail("estimated first"))
    with pytest.raises(ValueError, match=r"max_batch_size checks its answer by running the step for real.*sweep"):
        nbmem.max_batch_size(mlp, batch, device="200MiB", optimizer="sgd", compile=True)


def test_compile_refuses_measured_and_generate():
    from nbmem.estimation.plan import Plan

    with pytest.raises(ValueError, match="a measured run's breakdown tracker makes PyTorch run compiled code eagerly"):
        Plan(batch_size=8, compile=True, mode="measured")
    with pytest.raises(ValueError, match="generation calls the model's generate"):
        Plan(batch_size=1, compile=True, task="generate", prompt_length=8, new_tokens=2)


def _head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()  # as transformers' loss function breaks (logger.warning_once)
    return (hidden @ weight).tanh()


class _Breaking(nn.Module):
    """A model whose forward breaks Dynamo's graph inside a module-level function its class shares."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.w = nn.Linear(256, 512), nn.Parameter(torch.randn(512, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _head(self.a(x).relu(), self.w)


def test_compile_estimates_past_a_graph_break_leave_no_planned_graph_behind(fresh_dynamo):
    """Past a graph break Dynamo compiles the frames it resumes in (forward, _head) in their own, shared caches,
    under guards the next estimate's fake tensors pass: the second estimate called the first one's planned graph
    and raised, and after 8 the recompile limit gave eager figures and left the user's compile eager (a review)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    make = lambda n: (torch.randn(n, 256), torch.randn(n, 256))  # noqa: E731
    first, again = (nbmem.estimate(_Breaking, make, batch_size=32, optimizer="sgd", compile=True) for _ in range(2))
    assert first.steady == again.steady
    for size in range(1, torch._dynamo.config.recompile_limit + 2):
        planned = nbmem.estimate(_Breaking, make, batch_size=8 * size, optimizer="sgd", compile=True)
        assert not any("EAGER FIGURES" in note for note in planned.notes), size
    assert [len(_debug_get_cache_entry_list(code)) for code in (_head.__code__, _Breaking.forward.__code__)] == [0, 0]
    graphs = counters["stats"]["unique_graphs"]
    torch.compile(_Breaking())(torch.randn(8, 256)).sum().backward()
    assert counters["stats"]["unique_graphs"] > graphs  # the user's own compile compiles


def test_a_compile_estimate_is_the_same_whenever_pythons_collector_runs(fresh_dynamo):
    """Past transformers' graph break (its loss function) Dynamo traces the resumed frame with the model's output as
    a local, and its tracing structures, reference cycles, kept the output's logits once the compile was done: the
    estimate held them until Python's next full collection (a tiny GPT-2: 3,942,400 B with none, 3,284,480 B with
    one; bench_compiled_replay's GPT-2 624 MB against 523 MB). Collected before each planned graph first runs, the
    figures are the same with full collections put off as with a collection forced first."""
    import gc

    from _zoo import need

    need("transformers", env="NBMEM_REQUIRE_ZOO")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=512, n_positions=64)

    def make(n):
        ids = torch.randint(0, 512, (n, 32))
        return {"input_ids": ids, "labels": ids}

    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 2**31 - 1)  # young collections only, as between full ones
    try:
        put_off = nbmem.estimate(lambda: GPT2LMHeadModel(config), make, batch_size=8, optimizer="sgd", compile=True)
    finally:
        gc.set_threshold(*thresholds)
    torch._dynamo.reset()
    gc.collect()
    collected = nbmem.estimate(lambda: GPT2LMHeadModel(config), make, batch_size=8, optimizer="sgd", compile=True)
    assert (put_off.peak, put_off.steady) == (collected.peak, collected.steady)
    assert dict(put_off.breakdown.after)["activation"] == 0  # nothing of the step outlives it


def test_compiled_code_that_ran_eagerly_is_not_said_to_have_run_compiled(fresh_dynamo):
    """Under the user's set_stance("force_eager") a compiled call runs its eager Python: no compiled claim. Past
    Dynamo's recompile limit, calls with new shapes run eagerly: the result says it can't tell (a review found
    both reported as "ran compiled", with the eager figure)."""
    if not available():
        pytest.skip("the native engine's library is not built here")
    double = torch.compile(lambda t: (t * 2).sin(), backend="eager", dynamic=False)
    double(torch.ones(4))
    with torch.compiler.set_stance("force_eager"), nbmem.track("cpu", engine="native") as stanced:
        double(torch.ones(4))
    assert stanced.result.compiled is None and not any("compile" in note for note in stanced.result.notes)
    with nbmem.track("cpu", engine="native") as within:
        double(torch.ones(4))
    assert within.result.compiled == "compiled"
    for size in range(5, 5 + torch._dynamo.config.recompile_limit):
        double(torch.ones(size))
    with nbmem.track("cpu", engine="native") as past:
        double(torch.ones(64))
    assert past.result.compiled == "unknown"
    assert any(note.startswith("torch.compile'd code in this process has reached Dynamo's recompile limit")
               for note in past.result.notes)


class _Attending(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 16, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).sum(1)


def test_a_compile_estimates_attention_note_counts_no_traces(fresh_dynamo):
    """Under compile=True the attention kernel runs while Dynamo and AOTAutograd trace, not per step: no count (a
    review found 7 "calls per step" for 2)."""
    make = lambda n: (torch.randn(n, 16, 64), torch.randn(n, 16, 64))  # noqa: E731
    eager = nbmem.estimate(_Attending, make, batch_size=4, optimizer="sgd")
    planned = nbmem.estimate(_Attending, make, batch_size=4, optimizer="sgd", compile=True)
    (said,) = [note for note in eager.notes if "scaled_dot_product_attention calls" in note]
    assert said.startswith("attention: 1 scaled_dot_product_attention calls per step modelled as a fused kernel")
    (said,) = [note for note in planned.notes if note.startswith("attention:")]  # no workspace: inductor's own plan
    assert said.startswith("attention: scaled_dot_product_attention calls modelled as a fused kernel")


def test_a_model_compiled_in_place_is_said_to_lose_it_in_the_copy():
    """Module.compile() sets a compiled call on the module, which deepcopy drops: said, not silent (a review)."""
    model = mlp()
    model[0].compile()
    result = nbmem.estimate(model, batch, batch_size=8, optimizer="sgd")
    assert any(note.startswith("compiled in place (Module.compile()): 0; a copy of a module does not keep that")
               for note in result.notes)
    assert not any(note.startswith("compiled in place") for note in nbmem.estimate(mlp(), batch, batch_size=8).notes)


def test_a_compile_estimate_leaves_the_users_own_compiled_code_compiled(fresh_dynamo):
    """The user compiled the model class first: its graphs stay (no recompile under fail_on_recompile), and the
    estimate's graphs left beside them are planned with again by a later estimate (a review found the user's cache
    wiped by the fix above)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    model = _Breaking()
    compiled_model = torch.compile(model)
    inputs = torch.randn(8, 256)
    compiled_model(inputs).sum().backward()
    make = lambda n: (torch.randn(n, 256), torch.randn(n, 256))  # noqa: E731
    first, again = (nbmem.estimate(model, make, batch_size=32, optimizer="sgd", compile=True) for _ in range(2))
    assert first.steady == again.steady and not any("EAGER" in note for note in again.notes)
    assert all(_debug_get_cache_entry_list(code) for code in (_head.__code__, _Breaking.forward.__code__))
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled_model(inputs).sum().backward()  # raises if the user's graphs were gone


def test_a_compiled_optimizer_step_traces_none_of_nbmems_accounting(fresh_dynamo):
    """torch.compile(opt.step) traces the step's pre-hooks and _init_group: nbmem's host-counter hooks stay out of
    the user's graph (Dynamo traced the tracker's lru_cache'd code before, a review)."""
    import warnings

    def make_optimizer(parameters):
        optimizer = torch.optim.AdamW(parameters, lr=torch.tensor(0.01))
        optimizer.step = torch.compile(optimizer.step)
        return optimizer

    def train(model, inputs, optimizer):
        model(*inputs).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nbmem.estimate(mlp, batch, batch_size=8, optimizer=make_optimizer, step=train, compile=True)
    assert not [str(warning.message) for warning in caught if "lru_cache" in str(warning.message)]


def test_a_planned_graph_refuses_to_run_after_its_estimate(tmp_path):
    from nbmem.estimation.compiled_plan import OUTSIDE_ESTIMATE, Planning, _load_planned
    from nbmem.estimation.fakemode import new_fake_mode

    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text("def call(args):\n    return [len(args)]\n", encoding="utf-8")
    planning = Planning(new_fake_mode())
    module = _load_planned(planning, "key", str(wrapper))
    assert module.call([1, 2]) == [2] and planning.calls == 1
    planning.active = False  # the estimate is over: Dynamo may still hold the graph
    with pytest.raises(RuntimeError, match="outside its estimate"):
        module.call([1])
    assert "torch._dynamo.reset()" in OUTSIDE_ESTIMATE


def test_a_compile_estimate_leaves_dynamos_shape_state_and_inductors_settings(fresh_dynamo):
    import copy

    from torch._dynamo import pgo
    from torch._inductor import config as inductor_config

    before = copy.deepcopy(pgo._CODE_STATE)
    with inductor_config.patch(cpp_wrapper=True):  # a C++ wrapper would run real kernels on fake tensors
        for size in (256, 512):  # a second batch size would mark the batch dimension dynamic
            result = nbmem.estimate(mlp, batch, batch_size=size, optimizer="sgd", compile=True)
            assert any(note.startswith("compiled: torch.compile (inductor) ran") for note in result.notes)
        assert inductor_config.cpp_wrapper is True
    assert pgo._CODE_STATE == before


def test_a_compile_estimate_lets_its_model_go(fresh_dynamo):
    # (found this session) Dynamo keeps the globals of code it compiled, and the estimate's entry held the model in
    # its globals: every compile=True estimate left its whole (fake) model alive
    import gc
    import weakref

    built = []

    def build():
        model = mlp()
        built.append(weakref.ref(model))
        return model

    nbmem.estimate(build, batch, batch_size=8, optimizer="sgd", compile=True)
    gc.collect()
    assert len(built) == 1 and built[0]() is None
