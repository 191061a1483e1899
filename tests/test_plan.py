"""The plan (issue 22): every knob in one frozen object, checked once, handed down, said in the result."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import nbmem
from nbmem.estimation.estimate import estimate_plan
from nbmem.estimation.plan import KNOBS, Plan


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def make(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 64), torch.randint(0, 4, (size,))


def test_estimate_takes_exactly_the_plans_knobs():
    # a knob is one field of the plan and one keyword of estimate: they can't drift apart. timeline= is no knob
    # of the step (it changes what is kept of the run, not the run), so a plan leaves it out
    import inspect

    keywords = [name for name, parameter in inspect.signature(nbmem.estimate).parameters.items()
                if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
    assert sorted(keywords) == sorted([*KNOBS, "timeline"])


def test_the_plan_is_in_the_result_and_says_itself():
    result = nbmem.estimate(build, make, batch_size=8, precision="bf16", checkpointing=True, foreach=True)
    assert result.plan == Plan(batch_size=8, precision="bf16", checkpointing=True, foreach=True)
    assert result.plan.describe() == "batch 8, bf16, checkpointing per block, adamw foreach"


@pytest.mark.parametrize(
    "knobs, said",
    [
        (dict(batch_size=4, accumulation=2, optimizer="sgd", foreach=False), "batch 4 x 2 micro-batches, fp32, sgd for-loop"),
        (dict(global_batch_size=64, parallel="fsdp", world_size=8), "batch 8, fp32, adamw, fsdp on 8 GPUs"),
        (dict(batch_size=2, task="inference", prompt_length=16), "inference, batch 2, fp32, 16 prompt tokens"),
        (dict(batch_size=2, trainable="head"), "batch 2, fp32, adamw, training head"),
    ],
)
def test_describe(knobs, said):
    assert Plan(**knobs).describe() == said


def test_global_batch_size_resolves_per_device():
    plan = Plan(global_batch_size=96, parallel="ddp", world_size=4, accumulation=3)
    assert plan.per_device_batch == 8  # 96 / (4 ranks x 3 micro-batches)


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(batch_size=0), "batch_size must be a positive whole number, got 0"),
        (dict(batch_size=8, global_batch_size=64), "exactly one of them"),
        (dict(batch_size=8, precision="fp8"), "unknown precision 'fp8'"),
        (dict(batch_size=8, optimizer="lion"), "unknown optimizer 'lion'"),
        (dict(batch_size=8, accumulation=0), "accumulation must be a positive whole number"),
        (dict(batch_size=8, mode="guessed"), "unknown mode 'guessed'"),
        (dict(batch_size=8, autocast_policy="tpu"), "unknown autocast_policy 'tpu'"),
        (dict(batch_size=8, parallel="ddp", world_size=2, rank=2), "rank must be one of the 2 ranks"),
        (dict(batch_size=8, task="inference", checkpointing=True), "checkpointing= is for training"),
        (dict(batch_size=8, task="inference", trainable="head"), "trainable= chooses what a training step updates"),
        (dict(batch_size=8, optimizer=None), "optimizer=None means your own step brings its optimizer"),
    ],
)
def test_a_bad_knob_is_refused_when_the_plan_is_made(knobs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Plan(**knobs)


def test_replacing_a_knob_checks_the_new_plan_again():
    plan = Plan(batch_size=8)
    assert plan.varied(batch_size=16).per_device_batch == 16
    with pytest.raises(ValueError, match="unknown precision 'int3'"):
        dataclasses.replace(plan, precision="int3")


def test_estimate_plan_equals_estimate():
    plan = Plan(batch_size=16, optimizer="sgd")
    assert estimate_plan(build, make, plan).peak == nbmem.estimate(build, make, batch_size=16, optimizer="sgd").peak


def test_a_sweep_checks_every_configuration_before_running_any(monkeypatch):
    ran = []
    import nbmem.whatif.sweep as sweeping

    monkeypatch.setattr(sweeping, "estimate_plan", lambda *args: ran.append(args))
    # the third configuration's accumulation can't go with the user's step: refused before the first runs
    def own_step(model, batch, optimizer):
        model(batch[0]).sum().backward()

    with pytest.raises(ValueError, match="accumulation=2 with step="):
        nbmem.sweep(build, make, batch_size=8, accumulation=[1, 2], step=own_step, progress=False)
    assert ran == []


def test_max_batch_size_varies_one_plan():
    found = nbmem.max_batch_size(build, make, device="4MiB", optimizer="sgd", verify="tracked", progress=False)
    # the estimates' prediction, the real trials' answer and a single estimate's verdict agree
    assert found.predicted == found.batch_size > 1
    assert nbmem.estimate(build, make, batch_size=found.batch_size, optimizer="sgd", device="4MiB").fits
    assert not nbmem.estimate(build, make, batch_size=found.batch_size + 1, optimizer="sgd", device="4MiB").fits
