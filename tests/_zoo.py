"""Tiny real models for tests/test_zoo.py, built from configs with random weights (nothing is downloaded),
and ``need``, which skips a test whose library is missing (the zoo's and notebook 08's tests).

Each entry of ``ZOO`` is ``name -> (build, make_batch, vision)``: ``build()``
returns a fresh model, ``make_batch(n)`` a batch nbmem's built-in step
understands, and ``vision`` says the model needs timm or torchvision, which
only the zoo's second CI environment has (see .ci/run). Sizes follow issue 11:
2 layers, hidden 64, sequences of 32 tokens, 64x64 images.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

import pytest
import torch
from torch import nn


def need(*modules: str, env: str) -> None:
    """Import ``modules`` or skip (fail when ``env`` is 1: CI must test them)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as error:  # torchvision's CUDA wheels also fail with RuntimeError; that should fail loudly
            if os.environ.get(env) == "1":
                pytest.fail(f"{env}=1 but {name} can't be imported: {error}")
            pytest.skip(f"{name} is not installed ({error}); CI has it (timm and torchvision in Binder's environment, "
                        "tests/test_binder.py)")


VOCABULARY = 256
SEQUENCE = 32
IMAGE = 64
CLASSES = 10


def tokens(n: int) -> torch.Tensor:
    return torch.randint(0, VOCABULARY, (n, SEQUENCE))


def causal_lm_batch(n: int) -> dict[str, torch.Tensor]:
    """input_ids and labels: the model computes its own loss (output.loss)."""
    ids = tokens(n)
    return {"input_ids": ids, "labels": ids}


def padded_batch(n: int, labels: bool = True) -> dict[str, torch.Tensor]:
    """input_ids, an attention mask with three padded positions, and labels unless ``labels=False``.

    With padding, transformers builds its 4D attention mask in a real run as it
    does on fake tensors, which can't show whether there is padding (see the
    note nbmem adds to Hugging Face estimates).
    """
    ids = tokens(n)
    mask = torch.ones_like(ids)
    mask[:, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask, **({"labels": ids} if labels else {})}


def logits_batch(n: int) -> dict[str, torch.Tensor]:
    """No labels: the model returns logits only, and nbmem's default loss takes their mean."""
    return padded_batch(n, labels=False)


def sequence_label_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(n), torch.randint(0, 3, (n,))


def image_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (n,))


def image_dict_batch(n: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 3, IMAGE, IMAGE), "labels": torch.randint(0, CLASSES, (n,))}


def segmentation_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, IMAGE, IMAGE), torch.randint(0, 4, (n, IMAGE, IMAGE))


_TEXT = dict(vocab_size=VOCABULARY, bos_token_id=0, eos_token_id=1, pad_token_id=0)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=SEQUENCE, **_TEXT))


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=SEQUENCE, **_TEXT)


def llama() -> nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


def mixtral() -> nn.Module:
    """A mixture of experts (4, two per token): transformers 5 runs them as grouped products (torch._grouped_mm)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQUENCE, **_TEXT,
    ))


def _bert_config(**extra: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                      max_position_embeddings=SEQUENCE, **_TEXT, **extra)


def bert_masked_lm() -> nn.Module:
    from transformers import BertForMaskedLM

    return BertForMaskedLM(_bert_config())


def bert_classifier() -> nn.Module:
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification(_bert_config(num_labels=3))


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=2, decoder_start_token_id=0,
        **_TEXT,
    ))


def hf_vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=IMAGE, patch_size=16, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, num_labels=CLASSES,
    ))


def hf_swin() -> nn.Module:
    """Swin: its patch merging hands layer norm's backward a transposed gradient (see FastKeyFakeTensorMode)."""
    from transformers import SwinConfig, SwinForImageClassification

    return SwinForImageClassification(SwinConfig(
        image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
        num_labels=CLASSES,
    ))


def lora_llama() -> nn.Module:
    """Llama with LoRA adapters on the attention's q and v projections: only the adapters train."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def _timm(name: str, **extra: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=CLASSES, **extra)

    build.__name__ = name
    return build


def lraspp() -> nn.Module:
    """torchvision's LR-ASPP segmentation model (returns {"out": (n, classes, h, w)}) on a half-width
    MobileNetV3-small, built as lraspp_mobilenet_v3_large builds its own (330,864 parameters, not 3.2 M)."""
    from torchvision.models import mobilenet_v3_small
    from torchvision.models.segmentation.lraspp import _lraspp_mobilenetv3

    return _lraspp_mobilenetv3(mobilenet_v3_small(width_mult=0.5, dilated=True), 4)


ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any], bool]] = {
    "gpt2": (gpt2, padded_batch, False),
    "llama": (llama, logits_batch, False),
    "bert-mlm": (bert_masked_lm, causal_lm_batch, False),
    "bert-classifier": (bert_classifier, sequence_label_batch, False),
    "t5": (t5, causal_lm_batch, False),
    "hf-vit": (hf_vit, image_dict_batch, False),
    "hf-swin": (hf_swin, image_dict_batch, False),
    "lora-llama": (lora_llama, padded_batch, False),
    "mixtral": (mixtral, causal_lm_batch, False),
    # timm's test_* models are its own tiny configurations of each family
    "timm-resnet": (_timm("test_resnet"), image_batch, True),
    "timm-vit": (_timm("test_vit", img_size=IMAGE), image_batch, True),
    "timm-convnext": (_timm("test_convnext"), image_batch, True),
    "timm-efficientnet": (_timm("test_efficientnet"), image_batch, True),
    "torchvision-lraspp": (lraspp, segmentation_batch, True),
}
