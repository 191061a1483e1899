"""Issue 14, fine-tuning knobs: ``trainable=`` ("all", "head", "lora", a PEFT config, a predicate) on
estimate, sweep, max_batch_size and explore; each preset's estimate against a tracked run, to the byte."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import nbmem
from _zoo import ZOO, gpt2, llama, padded_batch
from nbmem.core.units import round_allocation
from nbmem.estimation.estimate import estimate
from nbmem.estimation.finetune import head_of
from test_zoo import need_zoo


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def classes(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 1024), torch.randint(0, 10, (n,))


#: the head nn.Linear(1024, 10): weight 1024 * 10 * 4 = 40960 B (80 blocks of 512); bias 40 B, rounded to 512
HEAD = 1024 * 10 * 4 + 512
#: the backbone nn.Linear(1024, 1024): weight 1024 * 1024 * 4 B, bias 1024 * 4 = 4096 B
BACKBONE = 1024 * 1024 * 4 + 4096


@pytest.mark.parametrize("mode", ["estimated", "tracked"])
def test_head_freezes_the_backbone_no_gradient_no_state(mode):
    result = estimate(mlp, classes, batch_size=4, optimizer="adam", foreach=False, trainable="head", mode=mode)
    categories = dict(result.breakdown.at_peak)
    assert categories["gradient"] == HEAD  # the peak is in Adam's update: the head's gradients only
    # exp_avg, exp_avg_sq; Adam's step counters are CPU tensors on a GPU, out of the figures
    assert categories["optimizer state"] == 2 * HEAD
    assert categories["parameter"] == BACKBONE + HEAD  # the frozen backbone is only a parameter
    trained = result.trained
    assert (trained.choice, trained.what, trained.parameters, trained.total_parameters) == (
        "head", "head", 1024 * 10 + 10, 1024 * 1024 + 1024 + 1024 * 10 + 10)
    assert (trained.parameter_bytes, trained.gradient_bytes, trained.state_bytes) == (HEAD, HEAD, 2 * HEAD)
    text = str(result)
    assert "trainable        head: 10,250 of 1,059,850 parameters (0.97%) train, the head" in text
    assert f"head           parameters 40.5 KiB, gradients 40.5 KiB, optimizer state 81.0 KiB ({mode}, allocated" in text


def test_all_is_today_behaviour_and_unfreezes_what_the_model_froze():
    default, everything = estimate(mlp, classes, batch_size=4), estimate(mlp, classes, batch_size=4, trainable="all")
    assert (everything.first_step, everything.steady) == (default.first_step, default.steady)
    assert default.trained is None and everything.trained.parameters == everything.parameters
    frozen = lambda: nn.Sequential(nn.Linear(1024, 1024).requires_grad_(False), nn.ReLU(), nn.Linear(1024, 10))
    assert estimate(frozen, classes, batch_size=4, trainable="all").steady == default.steady
    # a model built all frozen is refused as it comes, trained with a choice
    cold = lambda: mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="is frozen"):
        estimate(cold, classes, batch_size=4)
    assert estimate(cold, classes, batch_size=4, trainable="head").steady == estimate(
        mlp, classes, batch_size=4, trainable="head").steady


@pytest.mark.parametrize("mode", ["estimated", "tracked"])
def test_a_predicate_over_names_with_checkpointing(mode):
    """The first layer trains, behind frozen nothing; the last is frozen. With nbmem's non-reentrant checkpoint
    wrapper no input needs requires_grad (Hugging Face's enable_input_require_grads is for reentrant ones)."""
    build = lambda: nn.Sequential(nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()),
                                  nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()), nn.Linear(1024, 10))
    first = lambda name: name.startswith("0.")
    result = estimate(build, classes, batch_size=4, optimizer="sgd-momentum", checkpointing=True, trainable=first,
                      mode=mode)
    assert result.checkpointing == "on (Sequential)"
    # gradient and momentum of layer 0 alone: BACKBONE bytes each; the gradient flows back through the frozen layers
    assert (result.trained.gradient_bytes, result.trained.state_bytes) == (BACKBONE, BACKBONE)
    assert result.breakdown.category("optimizer state") == BACKBONE


def test_a_predicate_matching_nothing_lists_the_names():
    with pytest.raises(ValueError, match=r"matches none of the model's 4 parameters.*0.weight, 0.bias, 2.weight, 2.bias"):
        estimate(mlp, classes, batch_size=4, trainable=lambda name: name.startswith("encoder"))


@pytest.mark.parametrize(
    "trainable, message",
    [
        ("everything", "unknown trainable='everything': use 'all', 'head', 'lora'"),
        (["0.", "2."], "is a list: nbmem takes one choice.*lambda name: name.startswith"),
        (3, "trainable must be one of"),
    ],
)
def test_bad_choices_are_refused_before_anything_runs(trainable, message):
    with pytest.raises(ValueError, match=message):
        estimate(mlp, classes, batch_size=4, trainable=trainable)


def test_lora_without_peft_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(ValueError, match="pip install peft"):
        estimate(mlp, classes, batch_size=4, trainable="lora")


def test_lora_on_a_model_peft_has_no_defaults_for_names_its_layers():
    need_zoo(vision=False)
    with pytest.raises(ValueError, match="no default LoRA target modules for Sequential.*called 0, 2"):
        estimate(mlp, classes, batch_size=4, trainable="lora")
    from peft import LoraConfig

    result = estimate(mlp, classes, batch_size=4, trainable=LoraConfig(r=4, target_modules=["0"]))
    # lora_A 4 x 1024 and lora_B 1024 x 4 on layer 0: 16384 B each
    assert (result.trained.parameters, result.trained.parameter_bytes) == (2 * 4 * 1024, 2 * 16384)
    assert result.trained.what == "LoRA adapter"


#: the zoo's own batches: with padding, where transformers builds the attention mask in a real run as on fake
#: tensors (tests/_zoo.py, padded_batch)
ZOO_TEXT = ("gpt2", "bert-mlm", "bert-classifier", "llama", "t5", "hf-vit")


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO_TEXT)
@pytest.mark.parametrize("trainable", ["all", "head", "lora"])
@pytest.mark.parametrize("knobs", [{}, {"precision": "bf16", "checkpointing": True}], ids=["fp32", "bf16-checkpointing"])
def test_each_preset_on_the_zoo_agrees_with_a_tracked_run(name, trainable, knobs):
    need_zoo(vision=False)
    build, make, _ = ZOO[name]
    if name == "hf-vit" and trainable == "lora":
        # peft 0.21 lists no default targets for transformers 5's ViT (its attention is q_proj/k_proj/v_proj now)
        with pytest.raises(ValueError, match="no default LoRA target modules for ViTForImageClassification.*q_proj"):
            estimate(build, make, batch_size=2, trainable=trainable)
        from peft import LoraConfig

        trainable = LoraConfig(target_modules=["q_proj", "v_proj"])
    estimated = estimate(build, make, batch_size=2, trainable=trainable, **knobs)
    tracked = estimate(build, make, batch_size=2, trainable=trainable, mode="tracked", **knobs)
    assert (estimated.first_step, estimated.steady) == (tracked.first_step, tracked.steady)
    assert estimated.breakdown == tracked.breakdown
    assert estimated.trained == tracked.trained
    trained = estimated.trained
    # AdamW: exp_avg and exp_avg_sq as large as each trained parameter (its step counters are CPU tensors on a GPU)
    assert trained.gradient_bytes == trained.parameter_bytes
    assert trained.state_bytes == 2 * trained.parameter_bytes


def test_gpt2_head_is_tied_to_the_embeddings_and_says_so():
    need_zoo(vision=False)
    result = estimate(gpt2, padded_batch, batch_size=2, trainable="head")
    # lm_head is transformer.wte: one 256 x 64 fp32 matrix (65536 B) trains, gradient and AdamW state full-sized
    assert (result.trained.parameters, result.trained.parameter_bytes, result.trained.gradient_bytes) == (
        256 * 64, 65536, 65536)
    assert result.trained.state_bytes == 2 * 65536
    assert any("tied to transformer.wte.weight" in note for note in result.notes)


def test_lora_preset_equals_the_model_wrapped_by_the_user():
    need_zoo(vision=False)
    from peft import LoraConfig, get_peft_model

    from _zoo import lora_llama

    mine = estimate(llama, padded_batch, batch_size=2,
                    trainable=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    theirs = estimate(lora_llama, padded_batch, batch_size=2)
    assert (mine.first_step, mine.steady, mine.parameters) == (theirs.first_step, theirs.steady, theirs.parameters)
    preset = estimate(llama, padded_batch, batch_size=2, trainable="lora")
    wrapped = estimate(lambda: get_peft_model(llama(), LoraConfig()), padded_batch, batch_size=2)
    assert (preset.first_step, preset.steady) == (wrapped.first_step, wrapped.steady)
    # peft's defaults for llama: q_proj and v_proj, r=8; lora_A 8 x 64 and lora_B (64 or 32) x 8, in 2 layers
    assert preset.trained.parameters == 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)
    with pytest.raises(ValueError, match="already a PEFT model"):
        estimate(lora_llama, padded_batch, batch_size=2, trainable="lora")


def test_lora_with_hugging_face_checkpointing_keeps_the_adapters_training():
    """transformers' checkpointing calls enable_input_require_grads for text models: the embeddings' output
    requires grad, so gradients reach the adapters inside checkpointed layers even with the embeddings frozen."""
    need_zoo(vision=False)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    for mode in ("estimated", "tracked"):
        result = estimate(llama, padded_batch, batch_size=2, checkpointing=True, trainable="lora", mode=mode)
        assert result.checkpointing.startswith("on (Hugging Face")
        assert result.trained.gradient_bytes == result.trained.parameter_bytes > 0
    # nbmem's own wrapper is non-reentrant: the adapters get their gradients without the embeddings' output
    # requiring grad, and (at this size) the same peaks; the extra input gradient is not alive at the peak
    wrapped = estimate(llama, padded_batch, batch_size=2, checkpointing=lambda m: isinstance(m, LlamaDecoderLayer),
                       trainable="lora")
    assert wrapped.checkpointing == "on (your predicate)"
    assert wrapped.trained == result.trained and (wrapped.first_step, wrapped.steady) == (result.first_step, result.steady)


def test_sweep_over_what_trains():
    table = nbmem.sweep(mlp, classes, batch_size=4, optimizer="adam", trainable=["all", "head"])
    assert table.axes == ("trainable",)
    peaks = {row.value("trainable"): row.peak for row in table.rows}
    # Adam with foreach: the backbone's gradient and two states are gone with it frozen, three BACKBONE-sized
    # tensors, and more in foreach's temporaries; at least that much less
    assert peaks["all"] - peaks["head"] >= 3 * BACKBONE
    assert [record["trainable"] for record in table.to_records()] == ["all", "head"]
    assert str(table).splitlines()[1].split() == ["trainable", "peak"]

    def first_layer(name: str) -> bool:
        return name.startswith("0.")

    named = nbmem.sweep(mlp, classes, batch_size=4, trainable=[None, first_layer])
    assert [row.value("trainable") for row in named.rows] == ["as built", "first_layer"]
    with pytest.raises(ValueError, match="share a name"):
        nbmem.sweep(mlp, classes, batch_size=4, trainable=[lambda n: True, lambda n: False])


def test_max_batch_size_for_a_frozen_backbone_is_larger():
    full = nbmem.max_batch_size(mlp, classes, device="24MiB", optimizer="adam", verify="tracked")
    head = nbmem.max_batch_size(mlp, classes, device="24MiB", optimizer="adam", verify="tracked", trainable="head")
    assert head.batch_size > full.batch_size


@pytest.mark.slow
def test_launched_ranks_train_what_the_estimate_trains():
    """Two real DDP ranks (gloo, forked): each rank's peak and trained bytes are the estimate's."""
    knobs = dict(batch_size=4, parallel="ddp", world_size=2, optimizer="adam", foreach=False, trainable="head")
    estimated = estimate(mlp, classes, **knobs)
    launched = nbmem.launch(mlp, classes, **knobs)
    assert [rank.peak for rank in launched.ranks] == [estimated.peak] * 2
    assert [rank.trained for rank in launched.ranks] == [estimated.trained] * 2
    assert estimated.trained.state_bytes == 2 * HEAD
    with pytest.raises(ValueError, match="unknown trainable"):  # refused before any rank starts
        nbmem.launch(mlp, classes, **{**knobs, "trainable": "heads"})


def test_explorer_offers_what_trains():
    pytest.importorskip("ipywidgets")
    from nbmem.frontend.explorer import Explorer

    panel = Explorer(mlp, classes, batch_size=4, device="T4")
    menu = panel.controls["trainable"]
    assert [label for label, _ in menu.options][:3] == ["as built", "all", "head"]
    assert panel.last.trained is None
    menu.value = "head"
    assert panel.last.trained.what == "head" and "the head" in panel.chart.value


@pytest.mark.vision
def test_timm_head_is_its_classifier():
    need_zoo(vision=True)
    build, make, _ = ZOO["timm-resnet"]
    # on an Intel GPU (no cuDNN: its convolutions take no cuDNN workspace, as the tracked run's take none)
    estimated = estimate(build, make, batch_size=2, trainable="head", device="Arc-A770-16GB")
    tracked = estimate(build, make, batch_size=2, trainable="head", mode="tracked", device="Arc-A770-16GB")
    assert (estimated.first_step, estimated.steady) == (tracked.first_step, tracked.steady)
    assert estimated.trained == tracked.trained
    name, classifier = head_of(build())
    assert isinstance(classifier, nn.Linear) and name == "fc"
    # timm's get_classifier() (fc): its weight (and bias) train, and nothing else has a gradient
    weight, bias = classifier.weight, classifier.bias
    assert estimated.trained.parameter_bytes == round_allocation(weight.numel() * 4) + round_allocation(bias.numel() * 4)
    assert estimated.trained.gradient_bytes == estimated.trained.parameter_bytes
