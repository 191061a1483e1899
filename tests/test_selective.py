"""Selective activation checkpointing (issue 24, part 6): what checkpointed blocks keep, estimated as PyTorch runs it.

Each policy's estimate (fake tensors) equals a real run of the same step on
this CPU under PyTorch's own selective checkpointing, to the byte.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nbmem


class Block(nn.Module):
    def __init__(self, width: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def build() -> nn.Module:
    return nn.Sequential(nn.Sequential(*[Block() for _ in range(4)]), nn.Linear(256, 10))


def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 256), torch.randint(0, 10, (n,))


POLICIES = [None, "matmuls", "every-other-matmul", [torch.ops.aten.addmm], [torch.ops.aten.addmm.default]]


@pytest.mark.parametrize("saves", POLICIES, ids=["inputs only", "matmuls", "every-other", "addmm", "addmm.default"])
def test_the_estimate_of_each_policy_is_the_real_run(saves):
    options = dict(batch_size=1024, optimizer="sgd", checkpointing=True, checkpoint_saves=saves)
    estimated = nbmem.estimate(build, make, **options)
    tracked = nbmem.estimate(build, make, mode="tracked", **options)
    assert (estimated.first_step, estimated.steady) == (tracked.first_step, tracked.steady)
    assert estimated.breakdown == tracked.breakdown


def test_what_the_blocks_keep_orders_the_peaks():
    def peak(**options):
        return nbmem.estimate(build, make, batch_size=4096, optimizer="sgd", **options).steady

    inputs_only = peak(checkpointing=True)
    every_other = peak(checkpointing=True, checkpoint_saves="every-other-matmul")
    matmuls = peak(checkpointing=True, checkpoint_saves="matmuls")
    # keeping every matmul's output here keeps the up projection's 16 MiB per block, which plain autograd keeps as
    # ReLU's output anyway, and the down projection's 4 MiB, which it does not need: more than no checkpointing
    assert inputs_only < every_other <= peak() < matmuls
    estimate = nbmem.estimate(build, make, batch_size=8, checkpointing=True, checkpoint_saves="matmuls")
    assert estimate.checkpointing == "on (Block, keeping matmuls)"
    assert any(note.startswith("checkpointing: selective") for note in estimate.notes)
    assert "keeping matmuls" in estimate.plan.describe()


@pytest.mark.parametrize(("saves", "checkpointing", "message"), [
    ("matmuls", False, "add checkpointing=True"),
    ("all", True, "unknown checkpoint_saves 'all'"),
    (["mm"], True, "is not an op"),
    (42, True, "is not a policy"),
])
def test_a_policy_that_cant_work_says_what_to_pass(saves, checkpointing, message):
    with pytest.raises(ValueError, match=message):
        nbmem.estimate(build, make, batch_size=2, checkpointing=checkpointing, checkpoint_saves=saves)


def test_a_hugging_face_model_gets_the_policy_through_its_own_switch():
    from _zoo import need

    need("transformers", env="NBMEM_REQUIRE_ZOO")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)

    def tokens(n):
        return {"input_ids": torch.randint(0, 128, (n, 32)), "labels": torch.randint(0, 128, (n, 32))}

    def run(mode, saves):
        return nbmem.estimate(lambda: GPT2LMHeadModel(config), tokens, batch_size=4, optimizer="sgd",
                              checkpointing=True, checkpoint_saves=saves, mode=mode)

    estimated, tracked = run("estimated", "matmuls"), run("tracked", "matmuls")
    assert estimated.checkpointing.startswith("on (Hugging Face") and estimated.checkpointing.endswith("keeping matmuls)")
    # what the kept matmuls add is the same in the estimate and in the real run (the two differ, with or without the
    # policy, by the attention mask Hugging Face builds for fake tensors: see the estimate's notes)
    kept = estimated.steady - run("estimated", None).steady
    assert kept > 0 and kept == tracked.steady - run("tracked", None).steady


def test_a_sweep_applies_the_policy_where_it_checkpoints():
    table = nbmem.sweep(build, make, batch_size=1024, checkpointing=[False, True], checkpoint_saves="matmuls",
                        optimizer="sgd", progress=False)
    off, on = table.rows
    assert off.result.checkpointing == "off" and on.result.checkpointing == "on (Block, keeping matmuls)"
    alone = nbmem.estimate(build, make, batch_size=1024, optimizer="sgd", checkpointing=True, checkpoint_saves="matmuls")
    assert on.peak == alone.peak


def test_the_attention_implementation_is_a_knob_for_hugging_face_models():
    from _zoo import need

    need("transformers", env="NBMEM_REQUIRE_ZOO")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=1000, n_positions=512, bos_token_id=0,
                        eos_token_id=0)

    def tokens(n):
        return {"input_ids": torch.randint(0, 1000, (n, 512)), "labels": torch.randint(0, 1000, (n, 512))}

    def run(attention, mode="estimated"):
        return nbmem.estimate(lambda: GPT2LMHeadModel(config), tokens, batch_size=4, optimizer="sgd",
                              attention=attention, mode=mode)

    eager, sdpa, flash = run("eager"), run("sdpa"), run("flash_attention_2")
    # eager keeps each layer's 4 x 4 x 512 x 512 attention matrix (16 MiB in fp32) and what softmax and dropout made
    assert eager.steady > sdpa.steady + 2 * 16 * 1024**2
    assert (eager.first_step, eager.steady) == (lambda real: (real.first_step, real.steady))(run("eager", "tracked"))
    assert flash.steady == sdpa.steady and any("estimated as sdpa" in note for note in flash.notes)
    with pytest.raises(ValueError, match="unknown attention 'flex'"):
        run("flex")
    with pytest.raises(ValueError, match="has none: leave attention out"):
        nbmem.estimate(build, make, batch_size=2, attention="eager")
