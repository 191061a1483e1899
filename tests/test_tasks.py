"""task="inference" and task="generate" (nbmem.estimation.tasks): estimates against tracked runs of the same loop, exact bytes,
the KV cache's arithmetic, bad input, and sweeps over the task and the context length."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nbmem
from nbmem.core.results import CATEGORIES

from test_zoo import need

KiB = 1024


@pytest.fixture(autouse=True)
def _transformers():
    need("transformers", env="NBMEM_REQUIRE_ZOO")


def llama(positions: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    # grouped-query attention: 4 query heads share 2 key/value heads of 64 / 4 = 16 dimensions
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=256, max_position_embeddings=positions))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=2, n_positions=64, vocab_size=256))


def bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                      vocab_size=256, max_position_embeddings=64))


def tokens(n, length):
    ids = torch.randint(0, 256, (n, length))
    return {"input_ids": ids, "labels": ids}


def padded(n):
    ids = torch.randint(0, 256, (n, 24))
    mask = torch.ones_like(ids)
    mask[:, -3:] = 0  # padding: transformers builds its 4D mask in a real run as on fake tensors
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize(("build", "per_token"), [
    # layers x 2 (keys, values) x kv_heads x head_dim x 4 bytes (fp32) x batch 3
    (llama, 2 * 2 * 2 * 16 * 4 * 3),   # = 1536
    (gpt2, 3 * 2 * 2 * 32 * 4 * 3),    # = 4608
])
def test_generate_estimate_equals_a_tracked_run_of_the_same_loop(build, per_token):
    estimated = nbmem.estimate(build, batch_size=3, task="generate", prompt_length=16, new_tokens=5)
    tracked = nbmem.estimate(build, batch_size=3, task="generate", prompt_length=16, new_tokens=5, mode="tracked")
    assert estimated.peak == tracked.peak and estimated.reserved == tracked.reserved
    assert estimated.breakdown.at_peak == tracked.breakdown.at_peak
    assert estimated.kv_cache_per_token == tracked.kv_cache_per_token == per_token
    # 5 tokens from 5 forwards: the last one is never fed back, so the cache ends at 16 + 5 - 1 = 20 positions
    assert estimated.kv_cache == tracked.kv_cache == 20 * per_token
    assert estimated.breakdown.category("gradient") == estimated.breakdown.category("optimizer state") == 0
    assert estimated.breakdown.category("activation") == 0  # inference_mode: nothing saved for backward
    assert 0 < estimated.breakdown.category("kv cache") <= estimated.kv_cache
    assert estimated.first_step == estimated.steady == estimated.peak and estimated.optimizer == "none"
    text = str(estimated)
    assert text.startswith("gpumem generate estimate (estimated on fake tensors")
    assert f"per position for the whole batch ({per_token:,} B, " in text and "kv cache" in text


def test_generate_against_transformers_own_generate_tracked():
    """The same shapes through transformers' GenerationMixin.generate, run for real and tracked: it holds a few
    small tensors more (its growing attention mask, cache positions, finished-sequence flags), never less."""
    estimated = nbmem.estimate(llama, batch_size=3, task="generate", prompt_length=16, new_tokens=5)
    model = llama().eval()
    prompt = torch.randint(2, 256, (3, 16))
    with nbmem.track() as tracked:
        generated = model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert generated.shape == (3, 21)
    weights = estimated.breakdown.category("parameter") + estimated.breakdown.category("buffer")
    ours = estimated.peak - weights  # the model was built before track() opened
    assert tracked.result is not None
    extra = tracked.result.peak - ours
    assert 0 <= extra <= 32 * 512, extra  # measured here: 13 blocks of 512 B (6,656 B)


def test_generate_bf16_weights_halves_the_cache():
    result = nbmem.estimate(llama, batch_size=2, task="generate", prompt_length=8, new_tokens=3, precision="bf16-weights")
    assert result.kv_cache_per_token == 2 * 2 * 2 * 16 * 2 * 2  # layers x 2 x kv_heads x head_dim x 2 bytes x batch 2
    assert result.kv_cache == (8 + 3 - 1) * result.kv_cache_per_token


def test_inference_estimate_equals_tracked_and_holds_no_training_state():
    estimated = nbmem.estimate(llama, padded, batch_size=4, task="inference")
    tracked = nbmem.estimate(llama, padded, batch_size=4, task="inference", mode="tracked")
    assert estimated.peak == tracked.peak and estimated.breakdown.at_peak == tracked.breakdown.at_peak
    # parameters: embedding and head 256 x 64 x 4 = 65536 each; per layer q,o 64 x 64, k,v 32 x 64, MLP 3 x 64 x 128
    # (4 B each: 16384 + 16384 + 8192 + 8192 + 3 x 32768 = 147456) and two norms 256; the final norm 256
    assert estimated.breakdown.category("parameter") == 2 * 65536 + 2 * (147456 + 2 * 512) + 512
    for category in ("gradient", "optimizer state", "activation", "kv cache"):
        assert estimated.breakdown.category(category) == 0
    trained = nbmem.estimate(llama, lambda n: {**padded(n), "labels": padded(n)["input_ids"]}, batch_size=4)
    assert trained.peak > estimated.peak
    assert "inference: one forward pass in eval mode under torch.inference_mode()" in "\n".join(estimated.notes)


def test_context_length_calls_the_batch_with_two_arguments():
    lengths = []

    def make(n, length):
        lengths.append(length)
        return tokens(n, length)

    short = nbmem.estimate(llama, make, batch_size=2, prompt_length=16, task="inference")
    long = nbmem.estimate(llama, make, batch_size=2, prompt_length=64, task="inference")
    assert lengths == [16, 64] and long.peak > short.peak
    assert short.prompt_length == 16


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(model=bert, task="generate", prompt_length=8, new_tokens=2),
     "task='generate' needs a causal language model with a KV cache"),
    (dict(model=lambda: llama(positions=32), task="generate", prompt_length=30, new_tokens=3),
     "30 + 3 = 33 tokens is beyond the model's maximum position, LlamaConfig.max_position_embeddings = 32"),
    (dict(model=llama, task="generate", new_tokens=3), "needs prompt_length"),
    (dict(model=llama, task="generate", prompt_length=8), "needs new_tokens"),
    (dict(model=llama, task="generate", prompt_length=8, new_tokens=0), "a whole number >= 1, got 0"),
    (dict(model=llama, batch=padded, task="inference", new_tokens=3), "new_tokens is for task='generate'"),
    (dict(model=llama, batch=padded, task="inference", checkpointing=True), "checkpointing= is for training"),
    (dict(model=llama, batch=padded, task="serve"), "unknown task 'serve'"),
    (dict(model=llama, task="inference"), "task='inference' needs batch"),
    (dict(model=llama, batch=padded, task="inference", prompt_length=8), "batch(batch_size, prompt_length)"),
])
def test_bad_input_says_what_to_do(kwargs, message):
    with pytest.raises(ValueError, match=None) as error:
        nbmem.estimate(kwargs.pop("model"), kwargs.pop("batch", None), batch_size=2, **kwargs)
    assert message in str(error.value)


def test_kv_cache_is_a_category():
    assert CATEGORIES.index("kv cache") == CATEGORIES.index("other") - 1


def test_sweep_over_task_and_context_length():
    table = nbmem.sweep(llama, tokens, batch_size=2, task=["train", "inference", "generate"], prompt_length=[16, 32],
                        new_tokens=4, optimizer=["sgd", "adamw"], device="4MiB")
    # train: 2 optimizers x 2 lengths; inference and generate build no optimizer: 2 lengths each
    assert len(table) == 8 and table.axes == ("optimizer", "task", "prompt_length")
    for row in table:
        knobs = {key: value for key, value in row.config if value != "none"}  # no optimizer: estimate's own default
        alone = nbmem.estimate(llama, tokens, **knobs)
        assert row.peak == alone.peak
    header, body = table.table_rows()
    assert header[0] == "prompt_length" and [line[0] for line in body] == ["16", "32"]
    assert header[1:] == ("optimizer=sgd, task=train", "optimizer=none, task=inference",
                          "optimizer=none, task=generate", "optimizer=adamw, task=train")
    figure = table.plot()
    axes = figure.axes[0]
    assert axes.get_xlabel() == "context length (prompt tokens)"
    labels = [line.get_label() for line in axes.get_lines()]
    assert labels == [*header[1:], "capacity 4MiB"]  # a line per variant, and the capacity
    inference = [line for line in axes.get_lines() if line.get_label() == "optimizer=none, task=inference"][0]
    assert list(inference.get_xdata()) == [16, 32]


def test_default_train_is_unchanged():
    build = lambda: nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))  # noqa: E731
    make = lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,)))  # noqa: E731
    result = nbmem.estimate(build, make, batch_size=64, optimizer="sgd")
    assert result.task == "train" and result.kv_cache is None
    assert result.breakdown.category("parameter") == 4198400 + 40960 + 512  # the estimate docstring's figure


def test_bf16_weights_keep_tied_weights_tied():
    """GPT-2's head is its token embedding: cast to bf16 it stays one tensor, as module.to() keeps it."""
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    unique = list(model.parameters())  # parameters() yields a tied tensor once
    expected = sum(-(-p.numel() * 2 // 512) * 512 for p in unique)  # 2 bytes each, in 512 B blocks
    for mode in ("estimated", "tracked"):
        result = nbmem.estimate(gpt2, batch_size=2, task="generate", prompt_length=8, new_tokens=2,
                                precision="bf16-weights", mode=mode)
        assert result.parameters == sum(p.numel() for p in unique)
        assert result.breakdown.category("parameter") == expected


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert-mlm", "bert-classifier", "t5", "hf-vit", "lora-llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_inference_across_the_zoo_equals_a_tracked_run(name, precision):
    from _zoo import ZOO
    from test_zoo import need_zoo

    need_zoo(vision=False)
    build, make, _ = ZOO[name]
    estimated = nbmem.estimate(build, make, batch_size=2, task="inference", precision=precision)
    tracked = nbmem.estimate(build, make, batch_size=2, task="inference", precision=precision, mode="tracked")
    assert estimated.peak == tracked.peak and estimated.breakdown.at_peak == tracked.breakdown.at_peak
    for category in ("gradient", "optimizer state", "activation"):
        assert estimated.breakdown.category(category) == 0  # inference_mode: no autograd state at all


@pytest.mark.parametrize("name", ["gpt2", "llama", "lora-llama"])
def test_generate_across_the_zoo_equals_a_tracked_run(name):
    from _zoo import ZOO, SEQUENCE
    from test_zoo import need_zoo

    need_zoo(vision=False)
    build = ZOO[name][0]
    knobs = dict(batch_size=2, task="generate", prompt_length=SEQUENCE - 4, new_tokens=4, precision="bf16")
    estimated = nbmem.estimate(build, **knobs)
    tracked = nbmem.estimate(build, mode="tracked", **knobs)
    assert estimated.peak == tracked.peak and estimated.breakdown.at_peak == tracked.breakdown.at_peak
    assert estimated.kv_cache == tracked.kv_cache == (SEQUENCE - 1) * estimated.kv_cache_per_token


class PaddedEncoder(nn.Module):
    """nn.TransformerEncoder with a padding mask: in inference PyTorch's fast path packs the tokens in a nested
    tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(32, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=ids == 0))


def padded_ids(n: int) -> torch.Tensor:
    ids = torch.randint(1, 64, (n, 16))
    ids[:, 12:] = 0
    return ids


def test_an_encoders_fast_path_with_a_padding_mask_is_tracked_and_estimated():
    """Found by a fuzz of estimates against tracked runs: the nested tensor the fast path makes crashed a tracked
    block (the tracker read its sizes, which it has none of) and both modes of an inference estimate (fake tensors
    can't describe it either). A tracked block counts its buffer; an estimate turns the fast path off, says so, and
    leaves PyTorch's setting as it was."""
    model = PaddedEncoder().eval()
    ids = padded_ids(4)
    with torch.no_grad(), nbmem.track("cpu") as scope:
        out = model(ids)
    assert out.shape == (4, 16, 4) and scope.result.peak > 0
    assert torch.backends.mha.get_fastpath_enabled()
    fake = nbmem.estimate(PaddedEncoder, padded_ids, batch_size=4, task="inference")
    real = nbmem.estimate(PaddedEncoder, padded_ids, batch_size=4, task="inference", mode="tracked")
    assert fake.peak == real.peak and fake.breakdown == real.breakdown
    assert any(note.startswith("inference: PyTorch's fast path for nn.TransformerEncoder") for note in fake.notes)
    assert torch.backends.mha.get_fastpath_enabled()
    plain = nbmem.estimate(lambda: nn.Sequential(nn.Linear(8, 8)), lambda n: torch.randn(n, 8), batch_size=2,
                           task="inference")
    assert not any("fast path" in note for note in plain.notes)  # only where the model has such layers
