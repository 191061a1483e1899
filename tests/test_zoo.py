"""Real models (Hugging Face transformers, PEFT, timm, torchvision): every what-if estimate against a tracked run.

The models are tiny configurations with random weights (tests/_zoo.py);
nothing is downloaded. transformers and peft come with the ``zoo`` extra;
timm and torchvision need torch 2.14.1 with torchvision 0.29.1, which CI has
in Binder's environment: Binder's test runs the tests marked ``vision`` there
(tests/test_binder.py).
A missing library skips its tests, unless NBMEM_REQUIRE_ZOO=1 (transformers,
peft) or NBMEM_REQUIRE_VISION=1 (timm, torchvision) says it must be there:
then it fails.
"""

from __future__ import annotations

import functools
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from _zoo import ZOO, causal_lm_batch, gpt2, image_batch, need, padded_batch
from nbmem.core.units import round_allocation
from nbmem.estimation.estimate import estimate


def need_zoo(vision: bool) -> None:
    need("transformers", "peft", env="NBMEM_REQUIRE_ZOO")
    # peft imports some submodules only when first used; under fake tensors their
    # import-time constants would become fake (and be counted): import them here
    need("peft.tuners.loha", "peft.tuners.lokr", env="NBMEM_REQUIRE_ZOO")
    if vision:
        need("timm", "torchvision", env="NBMEM_REQUIRE_VISION")


#: A covering set, not the cross product: every precision, optimizer, checkpointing
#: and accumulation value once per model, and checkpointing with each mixed precision.
CONFIGURATIONS = [
    {},                                                                     # fp32, adamw
    {"precision": "bf16", "optimizer": "sgd", "accumulation": 2},
    {"precision": "fp16", "optimizer": "sgd-momentum", "checkpointing": True},
    {"optimizer": "adam", "checkpointing": True},
    {"precision": "bf16-weights", "optimizer": "adagrad"},
    {"precision": "bf16", "optimizer": "rmsprop", "checkpointing": True, "accumulation": 2},
]

ZOO_PARAMETERS = [
    pytest.param(name, marks=[pytest.mark.vision] if vision else []) for name, (_, _, vision) in ZOO.items()
]


@pytest.mark.parametrize("name", ZOO_PARAMETERS)
@pytest.mark.parametrize(
    "knobs", CONFIGURATIONS, ids=lambda knobs: ",".join(f"{k}={v}" for k, v in knobs.items()) or "fp32-adamw"
)
def test_real_model_estimate_agrees_with_a_tracked_run(name, knobs):
    """GPT-2, Llama, BERT (masked LM, classifier), T5, a ViT, a Swin, a LoRA Llama, a Mixtral (mixture of experts: its
    grouped products, which torch 2.13's meta function refuses in fp32) (transformers + peft); timm's ResNet,
    ViT, ConvNeXt and EfficientNet; torchvision's LR-ASPP segmentation, each in the six CONFIGURATIONS: the
    estimate on fake tensors gives the tracked run's bytes, both steps, to the byte; vision models under
    mixed precision to within 0.2 % (not the 0.1 % aimed at), for the reason given below."""
    build, make, vision = ZOO[name]
    need_zoo(vision)
    # an Intel GPU runs no cuDNN: a CNN's estimate compares with its tracked run (PyTorch's kernels) there; for an
    # NVIDIA GPU its convolutions take cuDNN's workspaces (tests/test_cudnn_conv.py)
    where = {"device": "Arc-A770-16GB"} if vision else {}
    torch.manual_seed(0)
    estimated = estimate(build, make, batch_size=2, **knobs, **where)
    torch.manual_seed(0)
    tracked = estimate(build, make, batch_size=2, mode="tracked", **knobs, **where)
    expected, got = (tracked.first_step, tracked.steady), (estimated.first_step, estimated.steady)
    if vision and knobs.get("precision") in ("bf16", "fp16"):
        # Under CPU autocast, batch and layer norms keep their saved mean and rstd in fp32 for bf16/fp16
        # inputs; PyTorch's meta kernels, which fake tensors run, give them the input's dtype: a few 512 B
        # blocks less in the estimate (tracked more by 0.04 % on ResNet, 0.13 % on ConvNeXt, 0.14 % on LR-ASPP,
        # measured here; transformers' models, whose norms autocast runs in fp32, agree exactly)
        for estimated_bytes, tracked_bytes in zip(got, expected):
            assert 0 <= tracked_bytes - estimated_bytes <= tracked_bytes * 0.002
    else:
        assert got == expected
    assert estimated.checkpointing == tracked.checkpointing
    if knobs.get("checkpointing"):
        assert estimated.checkpointing.startswith("on (")


def test_frozen_backbone_counts_gradients_and_state_of_the_head_only():
    head_bytes = 1024 * 10 * 4 + 512  # weight 40960 B (a multiple of 512); bias 40 B, rounded to 512
    build = lambda: nn.Sequential(nn.Linear(1024, 1024).requires_grad_(False), nn.ReLU(), nn.Linear(1024, 10))
    make = lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,)))
    for mode in ("estimated", "tracked"):
        result = estimate(build, make, batch_size=4, optimizer="adam", foreach=False, mode=mode)
        categories = dict(result.breakdown.at_peak)
        # the peak is in Adam's update, every gradient alive: the head's only
        assert categories["gradient"] == head_bytes
        # exp_avg and exp_avg_sq per trainable parameter (Adam's step counters are CPU tensors on a GPU)
        assert categories["optimizer state"] == 2 * head_bytes
        # the frozen backbone is only a parameter: 1024 * 1024 * 4 + 4096 B
        assert categories["parameter"] == 1024 * 1024 * 4 + 4096 + head_bytes


def test_lora_trains_only_its_adapters():
    need_zoo(vision=False)
    from _zoo import lora_llama

    model = lora_llama()
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    adapter_bytes = sum(round_allocation(parameter.numel() * 4) for parameter in trainable)
    assert len(trainable) == 8  # lora_A and lora_B on q_proj and v_proj in 2 layers
    for mode in ("estimated", "tracked"):
        result = estimate(lora_llama, padded_batch, batch_size=2, optimizer="sgd-momentum", mode=mode)
        # SGD's momentum buffer: one per trainable parameter, none for the frozen base model
        assert result.breakdown.category("optimizer state") == adapter_bytes


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: nn.Linear(16, 16).requires_grad_(False), "every parameter of the model \\(Linear\\) is frozen"),
        (lambda: nn.ReLU(), "has no parameters"),
    ],
)
def test_a_model_with_nothing_to_train_gets_a_clear_message(build, message):
    with pytest.raises(ValueError, match=message):
        estimate(build, lambda n: torch.randn(n, 16), batch_size=4)
    with pytest.raises(ValueError, match=message):
        estimate(build(), lambda n: torch.randn(n, 16), batch_size=4, mode="tracked")


class Returns(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(16, 4)

    def forward(self, x):
        out = self.linear(x)
        return {"none": None, "dict": {"out": out}, "two": {"a": out, "b": out}, "int": out.long()}[self.kind]


def test_outputs_the_default_loss_can_and_cannot_use():
    make = lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,)))
    # a dict's "out" pairs with integer targets by cross-entropy: the same step as a plain tensor output
    plain = estimate(nn.Linear(16, 4), make, batch_size=8, optimizer="sgd")
    assert estimate(Returns("dict"), make, batch_size=8, optimizer="sgd").peak == plain.peak
    for kind, message in [
        ("none", "returned None.*pass loss="),
        ("two", "keys \\['a', 'b'\\].*pass loss="),
        ("int", "torch.int64 tensor.*pass loss="),
    ]:
        with pytest.raises(ValueError, match=message):
            estimate(Returns(kind), make, batch_size=8)


def test_segmentation_targets_and_unpairable_shapes():
    seg = lambda: nn.Conv2d(3, 4, 1)
    make = lambda n: (torch.randn(n, 3, 8, 8), torch.randint(0, 4, (n, 8, 8)))
    estimated = estimate(seg, make, batch_size=2, optimizer="sgd")
    assert estimated.peak == estimate(seg, make, batch_size=2, optimizer="sgd", mode="tracked").peak
    with pytest.raises(ValueError, match="can't pair the model's output of shape \\(2, 4, 8, 8\\).*\\(2, 5\\)"):
        estimate(seg, lambda n: (torch.randn(n, 3, 8, 8), torch.randint(0, 4, (n, 5))), batch_size=2)


def test_hugging_face_checkpointing_is_its_own_and_leaves_the_users_model_alone():
    """GPT-2 keeps its default use_cache=True: nbmem's copy turns the cache off, the user's model keeps it."""
    need_zoo(vision=False)
    model = gpt2()
    assert model.config.use_cache
    results = [estimate(model, padded_batch, batch_size=2, checkpointing=True, mode=mode)
               for mode in ("estimated", "tracked")]
    assert results[0].peak == results[1].peak
    assert results[0].checkpointing == "on (Hugging Face activation_checkpointing_enable, use_cache=False)"
    assert any("the model's own switch" in note for note in results[0].notes)
    assert any("attention mask on fake tensors" in note for note in results[0].notes)
    assert model.config.use_cache and not model.transformer.h[0].gradient_checkpointing
    # less than without checkpointing, which keeps every block's activations
    assert results[0].peak < estimate(model, padded_batch, batch_size=2).peak
    # nbmem's own choice of blocks turns the cache off too: with it on, the recomputed forward appended to the
    # KV cache a second time ("Attempting to broadcast a dimension of length 32", issue 11)
    block = type(model.transformer.h[0])
    chosen = [estimate(model, padded_batch, batch_size=2, checkpointing=lambda module: isinstance(module, block),
                       mode=mode) for mode in ("estimated", "tracked")]
    assert chosen[0].peak == chosen[1].peak
    assert any("use_cache=False" in note for note in chosen[0].notes) and model.config.use_cache


def test_checkpointing_leaves_the_cache_of_a_factorys_shared_config_alone():
    """A factory that builds every model from one config (`lambda: LlamaForCausalLM(config)`): checkpointing
    turned the cache off in that config, so every later model built from it, a sweep's next configuration
    included, ran without its KV cache (found by notebook 08: its sweep's batch 2 was 1 MiB low)."""
    need_zoo(vision=False)
    from transformers import LlamaForCausalLM

    from _zoo import llama_config

    config = llama_config()
    build = lambda: LlamaForCausalLM(config)  # noqa: E731

    def holding_step(model, batch, optimizer):  # holds the outputs (logits and KV cache) through the update
        outputs = model(**batch)
        outputs.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    knobs = dict(batch_size=2, optimizer="sgd", step=holding_step)
    before = estimate(build, causal_lm_batch, **knobs)
    checkpointed = estimate(build, causal_lm_batch, checkpointing=True, **knobs)
    assert config.use_cache is True
    assert checkpointed.checkpointing == "on (Hugging Face activation_checkpointing_enable, use_cache=False)"
    # the same step again gives the bytes it gave before (notebook 08 checks the KV cache's share in bytes)
    assert estimate(build, causal_lm_batch, **knobs).peak == before.peak


def test_an_instance_and_a_factory_give_the_same_bytes():
    """Issue 11, point 4: a module instance run tracked counted the user's own parameters a second time."""
    need_zoo(vision=False)
    peaks = {
        (how, mode): estimate(model, causal_lm_batch, batch_size=2, mode=mode).peak
        for how, model in (("factory", gpt2), ("instance", gpt2()))
        for mode in ("estimated", "tracked")
    }
    assert len(set(peaks.values())) == 1, peaks


@pytest.mark.vision
def test_timm_instance_factory_and_own_checkpointing():
    need_zoo(vision=True)
    build = ZOO["timm-resnet"][0]
    peaks = {estimate(model, image_batch, batch_size=2, mode=mode).peak
             for model in (build, build()) for mode in ("estimated", "tracked")}
    assert len(peaks) == 1
    checkpointed = estimate(build, image_batch, batch_size=2, checkpointing=True)
    assert checkpointed.checkpointing == "on (timm set_grad_checkpointing)"


class DropPathRates(nn.Module):
    """Reads tensor values in its constructor, as timm's ViT and ConvNeXt do for their drop-path rates."""

    def __init__(self) -> None:
        super().__init__()
        rates = torch.linspace(0, 0.1, 3).tolist()
        self.blocks = nn.Sequential(*[nn.Linear(64, 64) for _ in rates])
        self.register_buffer("scale", torch.ones(64))

    def forward(self, x):
        return self.blocks(x) * self.scale


def test_a_constructor_that_reads_values_is_built_with_empty_weights():
    make = lambda n: torch.randn(n, 64)
    estimated = estimate(DropPathRates, make, batch_size=4, optimizer="adam")
    tracked = estimate(DropPathRates, make, batch_size=4, optimizer="adam", mode="tracked")
    assert (estimated.first_step, estimated.steady) == (tracked.first_step, tracked.steady)
    # 3 weights of 64 * 64 * 4 = 16384 B, 3 biases of 256 B rounded to 512
    assert estimated.breakdown.category("parameter") == 3 * (16384 + 512)
    assert estimated.breakdown.category("buffer") == 512
    assert any("aten._local_scalar_dense" in note and "meta device" in note for note in estimated.notes)


class Gate(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum().item() > 0 else x


class ReadsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.linear(x))


def test_a_step_that_reads_values_names_the_op_and_the_module():
    with pytest.raises(ValueError) as caught:
        estimate(ReadsInForward, lambda n: torch.randn(n, 8), batch_size=4)
    message = str(caught.value)
    assert "training step can't run on fake tensors" in message
    assert "aten._local_scalar_dense" in message and "in module gate (Gate)" in message
    assert "test_zoo.py:" in message and "mode='tracked'" in message
    assert estimate(ReadsInForward, lambda n: torch.randn(n, 8), batch_size=4, mode="tracked").peak > 0


def test_a_downloading_factory_points_to_from_config(tmp_path, monkeypatch):
    need_zoo(vision=False)
    import huggingface_hub.constants
    from transformers import AutoModelForCausalLM

    # offline, as this project's machines are: without it transformers 5 still asks the Hub for an adapter
    # config (five retries, 23 s here) and, on a laptop with a network, would reach it
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def download():
        return AutoModelForCausalLM.from_pretrained("gpt2", cache_dir=tmp_path, local_files_only=True)

    with pytest.raises(ValueError, match="from_config") as caught:
        estimate(download, causal_lm_batch, batch_size=2)
    assert isinstance(caught.value.__cause__, OSError)


def test_grouped_query_attention_in_fp32_runs_the_math_kernel_as_on_cuda():
    """Llama's 2 query heads share 1 key/value head. Without a mask, transformers passes enable_gqa=True (on fake
    tensors too: the position ids it made itself are one sequence per row, as on real ones), which CUDA's fused
    kernels refuse in fp32: the estimate runs the math kernel, attention matrix kept, and says so; the tracked run
    (real tensors) the same, to the byte. bf16 (flash attention) and GPT-2 (no grouping) say nothing."""
    need_zoo(vision=False)
    from _zoo import causal_lm_batch, gpt2, llama

    def grouped(build, precision, mode="estimated"):
        result = estimate(build, causal_lm_batch, batch_size=2, precision=precision, mode=mode)
        return result, [note for note in result.notes if "grouped-query calls per step in fp32" in note]

    (estimated, notes), (tracked, tracked_notes) = grouped(llama, "fp32"), grouped(llama, "fp32", "tracked")
    assert len(notes) == 1 and "attention: 2 grouped-query calls per step in fp32 (2 query heads, 1 key/value head" in notes[0]
    assert (estimated.first_step, estimated.steady) == (tracked.first_step, tracked.steady) and tracked_notes == notes
    assert not any(note.startswith("Hugging Face builds") for note in estimated.notes)  # no mask: none built
    assert grouped(llama, "bf16")[1] == [] and grouped(gpt2, "fp32")[1] == []


def test_position_ids_the_model_makes_build_no_mask_on_fake_tensors_either():
    """transformers' packing check can't read fake position ids; those the model made (an arange per row) are one
    sequence per row, as on real tensors: no 4-D mask, and the grouped key/value heads are not repeated."""
    need_zoo(vision=False)
    from transformers import LlamaConfig, LlamaForCausalLM

    from nbmem.estimation import attention

    config = LlamaConfig(num_hidden_layers=1, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=256, use_cache=False)

    def make(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 256, (n, 256))
        return {"input_ids": ids, "labels": ids}

    def peak(mode: str = "estimated") -> int:
        return estimate(lambda: LlamaForCausalLM(config), make, batch_size=2, precision="bf16", mode=mode).peak

    tracked, estimated = peak("tracked"), peak()
    assert estimated == tracked
    as_before = {"find_packed_sequence_indices": lambda _, check, ids: check(ids)}  # fake ids: "packed"
    with mock.patch.dict(attention._CHECKS, as_before):
        assert peak() - tracked == 360_448  # the (2, 1, 256, 256) mask and the key/value heads repeated 4 times


def test_position_ids_the_batch_brings_are_left_to_transformers_even_as_a_view():
    """Packed documents of 64 tokens, their position ids a view of a 1-D tensor: transformers' own check decides
    (on fake tensors it can't read them, and builds the packed mask, as a real run does)."""
    need_zoo(vision=False)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=1, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=256, use_cache=False)

    def packed(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 256, (n, 256))
        return {"input_ids": ids, "labels": ids, "position_ids": (torch.arange(256) % 64).unsqueeze(0).expand(n, -1)}

    def estimated(mode: str = "estimated") -> Any:
        return estimate(lambda: LlamaForCausalLM(config), packed, batch_size=2, precision="bf16", mode=mode)

    fake, real = estimated(), estimated("tracked")
    assert fake.peak == real.peak
    assert any(note.startswith("Hugging Face builds a (batch, 1, sequence, sequence)") for note in fake.notes)


def test_the_mask_note_comes_only_where_unreadable_values_built_the_mask():
    """A padded batch's attention_mask is fake: transformers can't see that it has no padding and builds the mask a
    real run skips (the note says so, and by how much it is high). A sliding window builds one on real tensors too:
    equal to the tracked run, and no note."""
    need_zoo(vision=False)
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    shape = dict(num_hidden_layers=1, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=1, vocab_size=256, use_cache=False)

    def padded(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 256, (n, 256))
        return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones(n, 256, dtype=torch.long)}

    def plain(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 256, (n, 256))
        return {"input_ids": ids, "labels": ids}

    def run(build: Any, make: Any, mode: str = "estimated") -> tuple[int, list[str]]:
        result = estimate(build, make, batch_size=2, precision="bf16", mode=mode)
        return result.peak, [note for note in result.notes if note.startswith("Hugging Face builds")]

    llama = functools.partial(LlamaForCausalLM, LlamaConfig(**shape))
    (fake, notes), (real, _) = run(llama, padded), run(llama, padded, "tracked")
    assert fake - real == 360_448 and len(notes) == 1 and "a real batch with neither skips it" in notes[0]
    windowed = functools.partial(MistralForCausalLM, MistralConfig(sliding_window=64, **shape))
    for make in (plain, padded):
        (fake, notes), (real, _) = run(windowed, make), run(windowed, make, "tracked")
        assert fake == real and notes == []


def test_an_encoders_unpadded_mask_and_an_inference_step_say_the_mask_was_built():
    """Found by a fuzz of estimates against tracked runs: BERT's all-ones attention_mask built a bidirectional mask on
    fake tensors (transformers' _ignore_bidirectional_mask_sdpa can't read them) with no note, and a causal LM's
    inference step gave none either (no autograd kernel runs there to count the masked calls)."""
    need_zoo(vision=False)
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    bert = functools.partial(BertForSequenceClassification, BertConfig(
        num_hidden_layers=1, hidden_size=64, num_attention_heads=2, intermediate_size=128, vocab_size=128))

    def unpadded(n: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, 128, (n, 16)), "attention_mask": torch.ones(n, 16, dtype=torch.long),
                "labels": torch.randint(0, 2, (n,))}

    gpt2 = functools.partial(GPT2LMHeadModel, GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128, n_positions=64))

    def text(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (n, 16))
        return {"input_ids": ids, "attention_mask": torch.ones(n, 16, dtype=torch.long), "labels": ids}

    for build, make, task in ((bert, unpadded, "train"), (bert, unpadded, "inference"), (gpt2, text, "inference")):
        fake = estimate(build, make, batch_size=8, optimizer="sgd", task=task)
        real = estimate(build, make, batch_size=8, optimizer="sgd", task=task, mode="tracked")
        notes = [note for note in fake.notes if note.startswith("Hugging Face builds a (batch, 1, sequence, sequence)")]
        assert fake.peak > real.peak and len(notes) == 1, (build, task, fake.peak, real.peak)
        assert not any(note.startswith("Hugging Face builds") for note in real.notes)


def test_fused_attention_wraps_transformers_mask_checks_only_while_active():
    """Both checks wrapped inside, transformers' own again after (an error in the block too); a wrapper an interrupted
    exit left is not wrapped again, and the next exit puts the original back."""
    need_zoo(vision=False)
    import transformers.masking_utils as masking

    from nbmem.estimation.attention import _CHECKS, FusedAttention

    originals = {name: getattr(masking, name) for name in _CHECKS}
    with pytest.raises(KeyError):
        with FusedAttention():
            inside = {name: getattr(masking, name) for name in _CHECKS}
            raise KeyError("the user's error")
    assert all(inside[name].args[1] is originals[name] for name in _CHECKS)
    assert {name: getattr(masking, name) for name in _CHECKS} == originals
    masking.find_packed_sequence_indices = inside["find_packed_sequence_indices"]  # what a cut-short exit leaves
    try:
        with FusedAttention():
            assert masking.find_packed_sequence_indices is inside["find_packed_sequence_indices"]
        assert {name: getattr(masking, name) for name in _CHECKS} == originals
    finally:
        masking.find_packed_sequence_indices = originals["find_packed_sequence_indices"]


def test_a_mixture_of_experts_runs_its_grouped_products_in_fp32_and_says_so():
    """transformers 5 runs Mixtral's experts as torch._grouped_mm in the weights' dtype (fp32 here): the estimate
    makes its outputs as the kernel does (torch 2.13's meta function takes bf16 only), counts each call, recomputed
    ones too, and equals a tracked run of the same step."""
    need_zoo(False)
    build, make, _ = ZOO["mixtral"]
    plain = estimate(build, make, batch_size=4)
    checkpointed = estimate(build, make, batch_size=4, checkpointing=True)
    tracked = estimate(build, make, batch_size=4, mode="tracked")
    assert (plain.first_step, plain.steady) == (tracked.first_step, tracked.steady)
    # 2 layers x (up, down) forward = 4, their backward's two products each = 8; checkpointing runs the forward's again
    notes = [[note for note in result.notes if note.startswith("mixture of experts")] for result in (plain, checkpointed)]
    assert [note[0].split(" grouped")[0] for note in notes] == ["mixture of experts: 12", "mixture of experts: 16"]
    assert not [note for note in tracked.notes if note.startswith("mixture of experts")]
