"""The user's own training step (issue 11, point 2): estimate(model, batch, step=train_step).

Every figure here is exact: an estimate on fake tensors against the same step
run for real and tracked, to the byte, and differences between steps against
the arithmetic of the tensor that makes them (CUDA's 512 B blocks).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_estimate import Transformer  # the transformer family nbmem's estimate is checked on
from torch import nn

import nbmem
from nbmem.estimation.estimate import estimate
from nbmem.estimation.step import _default_loss
from nbmem.estimation.userstep import BUILT_IN

CLASSES = 1000


def build():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def make(n):
    return torch.randn(n, 64), torch.randint(0, CLASSES, (n,))


# parameters: 64*128*4 = 32768, 128*4 = 512, 128*1000*4 = 512000, 1000*4 = 4000 -> 4096 (512 B blocks)
PARAMETER_BYTES = 32768 + 512 + 512000 + 4096  # 549376


def make_tokens(n):
    return torch.randint(0, 100, (n, 24)), torch.randint(0, 100, (n, 24))


def like_the_built_in(model, batch, optimizer, scaler=None):
    """nbmem.estimation.step.run_step written as a user would: output and loss held through backward, then dropped."""
    output = model(batch[0])
    loss = _default_loss(output, batch)
    (loss if scaler is None else scaler.scale(loss)).backward()
    del output, loss, batch  # the built-in drops the batch too: nbmem holds no reference to it
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)


def holding(model, batch, optimizer):
    """The logits and the loss held to the end of the step."""
    inputs, targets = batch
    logits = model(inputs)
    loss = F.cross_entropy(logits, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def dropping(model, batch, optimizer):
    """The logits die inside cross_entropy: nothing of the output is held through backward."""
    inputs, targets = batch
    F.cross_entropy(model(inputs), targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def clipping_with_ema(model, batch, optimizer):
    inputs, targets = batch
    F.cross_entropy(model(inputs), targets).backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        if not hasattr(model, "ema"):  # made on the first call, kept on nbmem's fresh model
            model.ema = [parameter.detach().clone() for parameter in model.parameters()]
        torch._foreach_lerp_(model.ema, list(model.parameters()), 0.01)


def deepcopy_ema(model, batch, optimizer):
    dropping(model, batch, optimizer)
    if "ema" not in vars(model):
        vars(model)["ema"] = copy.deepcopy(model)  # an attribute, not a submodule; deepcopy works on fake tensors


def averaged_model_ema(model, batch, optimizer):
    dropping(model, batch, optimizer)
    if "ema" not in vars(model):
        vars(model)["ema"] = torch.optim.swa_utils.AveragedModel(model)  # PyTorch's own EMA/SWA copy
    vars(model)["ema"].update_parameters(model)


def both_ways(step, **knobs):
    """The same step estimated on fake tensors and run for real, tracked."""
    torch.manual_seed(0)
    estimated = estimate(build, make, batch_size=10, step=step, **knobs)
    torch.manual_seed(0)
    tracked = estimate(build, make, batch_size=10, step=step, mode="tracked", **knobs)
    assert (estimated.first_step, estimated.steady) == (tracked.first_step, tracked.steady)
    return estimated


@pytest.mark.parametrize("knobs", [
    {},
    {"optimizer": "sgd"},
    {"precision": "bf16"},
    {"precision": "fp16"},
    {"precision": "bf16-weights"},
    {"checkpointing": lambda module: isinstance(module, nn.Linear)},
    {"parallel": "ddp", "world_size": 4},
    {"parallel": "fsdp", "world_size": 4},
], ids=lambda knobs: ",".join(f"{key}={getattr(value, '__name__', value)}" for key, value in knobs.items()) or "fp32")
def test_a_step_written_like_the_built_in_gives_its_figures_to_the_byte(knobs):
    built_in = estimate(build, make, batch_size=8, **knobs)
    mine = estimate(build, make, batch_size=8, step=like_the_built_in, **knobs)
    assert (mine.first_step, mine.steady, mine.reserved) == (built_in.first_step, built_in.steady, built_in.reserved)
    assert mine.breakdown == built_in.breakdown
    assert built_in.step == BUILT_IN and mine.step == "yours: like_the_built_in, run as written"
    assert "\n  step             yours: like_the_built_in, run as written\n" in str(mine)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_autocast_and_checkpointing_around_a_step_match_the_built_in(precision):
    # autocast's cache of low-precision weights is emptied where forward (and, in backward, each
    # recomputed block) ends, as where the built-in's autocast region ends: exact, checkpointed or not
    knobs = {"precision": precision, "checkpointing": True, "optimizer": "sgd"}
    built_in = estimate(Transformer, make_tokens, batch_size=8, **knobs)
    mine = estimate(Transformer, make_tokens, batch_size=8, step=like_the_built_in, **knobs)
    assert (mine.first_step, mine.steady) == (built_in.first_step, built_in.steady)
    assert built_in.checkpointing == mine.checkpointing == "on (TransformerEncoderLayer)"


def test_holding_the_logits_through_backward_costs_exactly_their_size():
    held, dropped = both_ways(holding, optimizer="sgd"), both_ways(dropping, optimizer="sgd")
    # SGD without momentum peaks in backward, where only the holding step still has the logits:
    # 10 * 1000 * 4 bytes = 40000, in 512 B blocks 79 * 512 = 40448
    assert held.peak - dropped.peak == 40448
    held, dropped = both_ways(holding), both_ways(dropping)
    # AdamW peaks in its first step, where the holding step still has the logits and the loss (a 512 B block)
    assert held.first_step - dropped.first_step == 40448 + 512


def test_clipping_and_an_ema_copy_are_counted_to_the_byte():
    plain = both_ways(dropping)
    for step in (clipping_with_ema, deepcopy_ema):
        with_ema = both_ways(step)
        # the EMA copy is made after the first step's peak, and lives through the second step: one more
        # copy of the parameters, 549376 bytes; clip_grad_norm_'s norms (512 B each) are below the peak
        assert with_ema.first_step == plain.first_step
        assert with_ema.steady - plain.steady == PARAMETER_BYTES
    with_averaged_model = both_ways(averaged_model_ema)
    # AveragedModel: the copy, and its n_averaged counter (a scalar buffer, one 512 B block)
    assert with_averaged_model.steady - plain.steady == PARAMETER_BYTES + 512


def test_a_step_that_accumulates_over_micro_batches_of_its_own():
    def accumulating(model, batch, optimizer):
        for inputs, targets in zip(batch[0].chunk(2), batch[1].chunk(2)):  # views: the whole batch stays
            F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    whole, halves = both_ways(dropping, optimizer="sgd"), both_ways(accumulating, optimizer="sgd")
    # the second backward makes each gradient anew beside the first's, to add them: at this size that
    # costs more than the half of the activations it saves (the head's 512000 B gradient alone)
    assert halves.peak - whole.peak >= 512000


def test_a_step_with_two_optimizers_of_its_own():
    def two_optimizers(model, batch, optimizer):
        assert optimizer is None  # optimizer=None: nbmem builds none
        if "optimizers" not in vars(model):
            vars(model)["optimizers"] = (torch.optim.AdamW(model[0].parameters()),
                                         torch.optim.SGD(model[2].parameters(), lr=0.1))
        dropping_loss = F.cross_entropy(model(batch[0]), batch[1])
        dropping_loss.backward()
        for each in vars(model)["optimizers"]:
            each.step()
            each.zero_grad(set_to_none=True)

    result = both_ways(two_optimizers, optimizer=None)
    assert result.optimizer == "your step's own optimizer"
    # AdamW on the first layer only: exp_avg and exp_avg_sq of 32768 + 512 bytes each (its step counters are CPU
    # tensors on a GPU, out of the figures: the step's own optimizer too); SGD keeps nothing
    assert dict(result.breakdown.after)["optimizer state"] == 2 * 33280
    assert any("AdamW's step counters" in note for note in result.notes)


def test_fp16_passes_nbmems_scaler_to_a_step_that_takes_one():
    # nbmem's scaler always steps: the tracked run steps at the initial scale too, and the two agree
    mine = both_ways(like_the_built_in, precision="fp16")
    built_in = estimate(build, make, batch_size=10, precision="fp16")
    assert (mine.first_step, mine.steady) == (built_in.first_step, built_in.steady)
    assert any("GradScaler as its 4th argument" in note for note in mine.notes)
    assert any("torch.autocast('cpu', fp16)" in note for note in mine.notes)
    without = estimate(build, make, batch_size=8, precision="fp16", step=dropping)
    assert any("no GradScaler ran" in note for note in without.notes)


def test_logging_guarded_by_estimating_runs_only_for_real(capsys):
    seen = []

    def logging_step(model, batch, optimizer):
        seen.append(nbmem.estimating())
        inputs, targets = batch
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        if not nbmem.estimating():
            print(f"loss {loss.item():.3f}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    both_ways(logging_step)
    assert seen == [True, True, False, False]  # two estimated steps, then two tracked ones
    assert capsys.readouterr().out.count("loss ") == 2
    assert nbmem.estimating() is False


def test_reading_a_value_on_fake_tensors_names_the_users_line():
    def item_step(model, batch, optimizer):
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        print(loss.item())  # the line the error names

    with pytest.raises(ValueError, match=r"your step item_step read a tensor's value at .*test_user_step.py:\d+ "
                                         r"\(`print\(loss.item\(\)\)  # the line the error names`\).*nbmem.estimating\(\).*mode='tracked'"):
        estimate(build, make, batch_size=8, step=item_step)

    def report(loss):
        return float(loss)

    def helper_step(model, batch, optimizer):
        loss = F.cross_entropy(model(batch[0]), batch[1])
        report(loss)

    with pytest.raises(ValueError, match=r"\(`return float\(loss\)`\), reached from .*\(`report\(loss\)`\)"):
        estimate(build, make, batch_size=8, step=helper_step)


def test_a_real_tensor_from_outside_gets_advice_naming_its_line():
    class_weights = torch.ones(CLASSES)

    def weighted(model, batch, optimizer):
        F.cross_entropy(model(batch[0]), batch[1], weight=class_weights).backward()

    with pytest.raises(ValueError, match=r"a real tensor, made before the estimate, met nbmem's fake ones at "
                                         r".*test_user_step.py:\d+ \(`F.cross_entropy\(.*weight=class_weights"):
        estimate(build, make, batch_size=8, step=weighted)
    data = torch.randn(32, 64), torch.randint(0, CLASSES, (32,))
    with pytest.raises(ValueError, match=r"\(`estimate\(build, lambda n: \(data\[0\]\[:n\].*inside your step or the batch"):
        estimate(build, lambda n: (data[0][:n], data[1][:n]), batch_size=8)  # the factory slices a dataset


def test_the_steps_own_errors_and_interrupts_pass_unchanged_and_leave_nothing_on():
    def failing(model, batch, optimizer):
        model(batch[0])
        raise RuntimeError("the user's own bug")

    with pytest.raises(RuntimeError, match="the user's own bug"):
        estimate(build, make, batch_size=8, step=failing, precision="bf16")

    def interrupted(model, batch, optimizer):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        estimate(build, make, batch_size=8, step=interrupted, precision="bf16")
    assert not torch.is_autocast_enabled("cpu") and not nbmem.estimating()
    assert torch._C._len_torch_function_stack() == 0  # the deepcopy mode is gone


def test_the_batch_is_handed_over_as_the_factory_made_it():
    from collections import namedtuple

    Batch = namedtuple("Batch", "inputs targets names")
    seen = []

    def step(model, batch, optimizer):
        seen.append((type(batch).__name__, batch.inputs.dtype, batch.targets.dtype, batch.names))
        model(batch.inputs).float().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def named(n):
        return Batch(torch.randn(n, 64), torch.randint(0, CLASSES, (n,)), ["a"] * n)

    estimate(build, named, batch_size=2, step=step, precision="bf16-weights", optimizer="sgd")
    # floats cast for "-weights", integers and strings as they were
    assert seen == [("Batch", torch.bfloat16, torch.int64, ["a", "a"])] * 2


def test_in_a_notebook_the_error_names_the_cells_line(shell):
    shell.run_cell(
        "import torch, nbmem\n"
        "def cell_step(model, batch, optimizer):\n"
        "    loss = model(batch[0]).mean()\n"
        "    if loss > 0:\n"
        "        loss.backward()\n"
        "try:\n"
        "    nbmem.estimate(lambda: torch.nn.Linear(4, 2), lambda n: (torch.randn(n, 4),), batch_size=2, step=cell_step)\n"
        "except ValueError as error:\n"
        "    message = str(error)\n"
    )
    assert "your step cell_step read a tensor's value at " in shell.user_ns["message"]
    assert ":4 (`if loss > 0:`)" in shell.user_ns["message"]


@pytest.mark.parametrize("arguments, message", [
    ({"step": "train_step"}, "step must be your training step, a function step"),
    ({"step": lambda model, batch: None}, r"must accept three positional arguments, \(model, batch, optimizer\)"),
    ({"step": lambda model, batch, optimizer, scaler: None}, r"give it a default, scaler=None"),
    ({"step": dropping, "accumulation": 2}, "your step owns its loop, so accumulation is its own: call backward N"),
    ({"step": dropping, "loss": F.mse_loss}, "your step computes its own loss"),
    ({"optimizer": None}, "optimizer=None means your own step brings its optimizer: pass step="),
    ({"step": dropping, "optimizer": None, "parallel": "zero1", "world_size": 2}, "build the ZeroRedundancyOptimizer"),
])
def test_bad_input_says_what_to_do(arguments, message):
    with pytest.raises(ValueError, match=message):
        estimate(build, make, batch_size=8, **arguments)


def test_sweep_and_max_batch_size_run_the_step():
    table = nbmem.sweep(build, make, batch_size=[8, 16], optimizer=["sgd", "adamw"], step=holding)
    for row in table:
        options = dict(row.config)
        alone = estimate(build, make, batch_size=options["batch_size"], optimizer=options["optimizer"], step=holding)
        assert row.peak == alone.peak and row.result.step == "yours: holding, run as written"
    assert str(table).splitlines()[0] == "gpumem sweep: peak allocated in MiB, estimated; step yours: holding, run as written"
    with pytest.raises(ValueError, match="accumulation is its own"):
        nbmem.sweep(build, make, batch_size=8, accumulation=[1, 2], step=holding)

    found = nbmem.max_batch_size(build, make, device="3MiB", optimizer="sgd", step=holding)
    trials = dict(found.trials)
    assert found.step == "yours: holding, run as written" and "  step: yours: holding" in str(found)
    assert trials[found.batch_size] is not None and trials[found.batch_size + 1] is None  # both sides ran
    # the verdict is the user's step's: its estimate fits at the answer and not one above
    assert estimate(build, make, batch_size=found.batch_size, optimizer="sgd", step=holding, device="3MiB").fits
    assert not estimate(build, make, batch_size=found.batch_size + 1, optimizer="sgd", step=holding,
                        device="3MiB").fits
    built_in = nbmem.max_batch_size(build, make, device="3MiB", optimizer="sgd")
    lean = nbmem.max_batch_size(build, make, device="3MiB", optimizer="sgd", step=dropping)
    assert lean.batch_size > built_in.batch_size  # no logits held through backward: more samples fit


def test_explore_answers_with_the_step():
    pytest.importorskip("ipywidgets")
    from nbmem.frontend.explorer import OWN_OPTIMIZER, Explorer

    def flexible(model, batch, optimizer):
        if optimizer is None:  # "your step's own": built once, on nbmem's fresh model
            optimizer = vars(model).setdefault("own", torch.optim.Adagrad(model.parameters()))
        holding(model, batch, optimizer)

    panel = Explorer(build, make, batch_size=16, device="T4", step=flexible, optimizer="sgd")
    first = estimate(build, make, batch_size=16, device="T4", optimizer="sgd", step=flexible)
    assert (panel.last.peak, panel.last.step) == (first.peak, first.step)
    assert panel.controls["accumulation"].disabled and "step: yours: flexible, run as written" in panel.chart.value
    panel.controls["optimizer"].value = OWN_OPTIMIZER
    own = estimate(build, make, batch_size=16, device="T4", optimizer=None, step=flexible)
    assert (panel.last.optimizer, panel.last.peak) == ("your step's own optimizer", own.peak)
    # Adagrad's state: a sum per parameter, as large as it (549376); its step counts, made in its constructor,
    # are CPU tensors on a GPU: out of the figures from its first step
    assert dict(own.breakdown.after)["optimizer state"] == PARAMETER_BYTES


@pytest.mark.slow
def test_launched_ranks_run_the_step():
    ranks = nbmem.launch(build, make, batch_size=8, parallel="ddp", world_size=2, optimizer="sgd", step=holding)
    estimated = estimate(build, make, batch_size=8, parallel="ddp", world_size=2, optimizer="sgd", step=holding)
    assert ranks.ranks[0].step == "yours: holding, run as written"
    # to the byte, but for a 512 B block a real gloo rank sometimes keeps a moment longer: seen here
    # for the built-in step too (1691648 against 1691136 in 1 launch of 6; 4 launches of 12 on 2026-11-27), and
    # two such blocks once in CI, under coverage (rank 0 +1,024 B); test_parallel allows 2 %
    assert all(0 <= rank.peak - estimated.peak <= 1024 for rank in ranks.ranks)
