"""Which block checkpointing wraps and FSDP shards (issue 24, part 1): chosen as a person would, or named.

The models here copy torchvision's ViT and ResNet structure (torchvision is not
a test dependency): their heads and stages are bare ``nn.Sequential`` containers,
which the old rule, "the outermost repeated module type", chose as the block,
making the whole encoder one checkpoint and one FSDP unit.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import nbmem
from nbmem.estimation.building import repeated_blocks


class MLPBlock(nn.Sequential):  # torchvision.models.vision_transformer.MLPBlock is a Sequential too
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


class EncoderBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.self_attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLPBlock(width, 4 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.self_attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(OrderedDict((f"encoder_layer_{index}", EncoderBlock(width, 4))
                                                for index in range(layers)))
        self.ln = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(x))


class VisionTransformer(nn.Module):
    LAYERS, WIDTH = 6, 64

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder(self.LAYERS, self.WIDTH)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(self.WIDTH, 10)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads(self.encoder(x)[:, 0])


class Bottleneck(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.downsample = nn.Sequential(nn.Conv2d(width, width, 1), nn.BatchNorm2d(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)) + self.downsample(x))


def resnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Sequential(Bottleneck(8), Bottleneck(8)),
                         nn.Sequential(Bottleneck(8), Bottleneck(8), Bottleneck(8)), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 10))


def tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 197, VisionTransformer.WIDTH), torch.randint(0, 10, (n,))


def test_the_block_is_the_layer_not_a_bare_container():
    assert repeated_blocks(VisionTransformer()) is EncoderBlock  # not the Sequential that holds the head
    assert repeated_blocks(resnet()) is Bottleneck  # not a stage
    assert repeated_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))) is None
    # made of Sequentials and nothing else that repeats: then the Sequential is the block
    layers = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert repeated_blocks(layers) is nn.Sequential


def test_checkpointing_and_fsdp_use_the_chosen_block():
    checkpointed = nbmem.estimate(VisionTransformer, tokens, batch_size=4, checkpointing=True)
    assert checkpointed.checkpointing == "on (EncoderBlock)"
    sharded = nbmem.estimate(VisionTransformer, tokens, batch_size=4, parallel="fsdp", world_size=2)
    assert any(note.startswith("FSDP units: each EncoderBlock (6), then the rest") for note in sharded.notes)
    # the old choice, the outermost Sequential, checkpoints the whole encoder as one block: its backward holds
    # every layer's recomputed activations at once
    whole_encoder = nbmem.estimate(VisionTransformer, tokens, batch_size=4, checkpointing=True,
                                   block=lambda module: type(module) is nn.Sequential)
    assert whole_encoder.checkpointing == "on (where <lambda> says)"
    assert checkpointed.peak < whole_encoder.peak


@pytest.mark.parametrize("block", [EncoderBlock, "EncoderBlock", lambda module: isinstance(module, EncoderBlock)])
def test_the_block_can_be_named_as_a_class_a_name_or_a_predicate(block):
    named = nbmem.estimate(VisionTransformer, tokens, batch_size=4, checkpointing=True, block=block)
    chosen = nbmem.estimate(VisionTransformer, tokens, batch_size=4, checkpointing=True)
    assert named.peak == chosen.peak and named.breakdown == chosen.breakdown
    sharded = nbmem.estimate(VisionTransformer, tokens, batch_size=4, parallel="fsdp", world_size=2, block=block)
    assert any("(6), then the rest" in note for note in sharded.notes)


@pytest.mark.parametrize("checkpointing, fix", [
    ("no", "pass checkpointing=False"), ("off", "pass checkpointing=False"), ("yes", "pass checkpointing=True"),
    ("EncoderBlock", "pass checkpointing=True, block='EncoderBlock' to checkpoint each block of that class"),
    (EncoderBlock, "checkpointing=EncoderBlock is a class: to checkpoint each such block, pass checkpointing=True, "
                   "block=EncoderBlock"),
    (2, "pass True (each repeated block), False, or a predicate")])
def test_checkpointing_is_true_false_or_a_predicate_and_anything_else_says_what_to_pass(checkpointing, fix):
    # a newcomer's walk through the docs: checkpointing="no" estimated with every block checkpointed
    with pytest.raises(ValueError) as caught:
        nbmem.estimate(VisionTransformer, tokens, batch_size=2, checkpointing=checkpointing)
    assert fix in str(caught.value)


def test_a_block_that_is_not_there_or_not_a_block_says_what_to_pass():
    with pytest.raises(ValueError, match=r"block='DecoderLayer' names no module of this model; .*EncoderBlock"):
        nbmem.estimate(VisionTransformer, tokens, batch_size=2, checkpointing=True, block="DecoderLayer")
    with pytest.raises(ValueError, match="pass a module class"):
        nbmem.estimate(VisionTransformer, tokens, batch_size=2, checkpointing=True, block=42)
    assert "block EncoderBlock" in nbmem.estimate(VisionTransformer, tokens, batch_size=2, block="EncoderBlock").plan.describe()
