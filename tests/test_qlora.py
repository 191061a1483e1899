"""Issue 25: quantized fine-tuning traced through bitsandbytes' own code (``quantization=``, 8-bit and paged optimizers).

Every figure is checked against what bitsandbytes itself makes: its quantization state's sizes by their arithmetic,
an estimate on fake tensors against a tracked run of bitsandbytes' CPU kernels, to the byte. CI installs the quant
extra (NBMEM_REQUIRE_QUANT=1 turns a missing bitsandbytes into a failure).
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
from torch import nn

import nbmem
from _zoo import causal_lm_batch, llama, need
from nbmem.core.units import round_allocation
from nbmem import Quantization
from nbmem.estimation.quantization import parameter_count


@pytest.fixture(autouse=True, scope="module")
def bitsandbytes():
    need("bitsandbytes", env="NBMEM_REQUIRE_QUANT")
    need("transformers", "peft", "peft.tuners.loha", "peft.tuners.lokr", env="NBMEM_REQUIRE_ZOO")
    # bitsandbytes' CPU kernels keep a 1 KiB table from their first call on: made here, so that no tracked run
    # below counts it once
    nbmem.estimate(llama, causal_lm_batch, batch_size=1, quantization="nf4", optimizer="sgd", mode="tracked")


def linear(out_features: int = 4096, in_features: int = 1024) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, out_features, bias=False), nn.ReLU(), nn.Linear(out_features, 8))


def features(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 1024), torch.randint(0, 8, (n,))


def nf4_bytes(n: int) -> int:
    """One nf4 layer with double quantization, each tensor in 512 B blocks (bitsandbytes functional.quantize_4bit)."""
    return sum(round_allocation(size) for size in (
        n // 2,                      # the weight, two values per byte
        n // 64,                     # absmax, quantized to uint8 (blocks of 64)
        math.ceil(n / 64 / 256) * 4,  # the second stage's fp32 absmax (blocks of 256)
        16 * 4,                      # the nf4 code
        256 * 4,                     # the second stage's code, a copy per layer
        4,                           # the offset
    ))


def test_nf4_weight_and_its_state_have_bitsandbytes_sizes():
    quantization = Quantization("nf4", skip=("2",))  # the small output layer stays as it is
    result = nbmem.estimate(linear, features, batch_size=4, optimizer="sgd", quantization=quantization)
    # 4096 x 1024: 2,097,152 + 65,536 + 1,024 + 512 + 1,024 + 512; the output layer's fp32 weight and bias
    assert nf4_bytes(4096 * 1024) == 2165760
    assert result.breakdown.category("parameter") == 2165760 + round_allocation(8 * 4096 * 4) + 512
    assert result.parameters == 4096 * 1024 + 8 * 4096 + 8  # counted by their shape, not their packed bytes
    assert any("1 linear layers quantized to nf4, double quant, bf16 compute" in note for note in result.notes)


def test_int8_weight_is_one_byte_a_value_and_fp32_row_scales():
    result = nbmem.estimate(linear, features, batch_size=4, optimizer="sgd", quantization=Quantization("int8", skip=("2",)))
    # 4096 x 1024 int8, and one fp32 scale per output row (bitsandbytes int8_vectorwise_quant)
    assert result.breakdown.category("parameter") == 4096 * 1024 + 4096 * 4 + round_allocation(8 * 4096 * 4) + 512


@pytest.mark.parametrize("quantization", ["nf4", "fp4", "int8"])
@pytest.mark.parametrize("trainable", [None, "lora"])
def test_the_estimate_equals_a_tracked_run_of_bitsandbytes_cpu_kernels(quantization, trainable):
    figures = {}
    for mode in ("estimated", "tracked"):
        result = nbmem.estimate(llama, causal_lm_batch, batch_size=2, precision="bf16", optimizer="adamw",
                                quantization=quantization, trainable=trainable, mode=mode)
        trained = result.trained
        figures[mode] = (result.first_step, result.steady, result.parameters,
                         *(result.breakdown.category(name) for name in ("parameter", "gradient", "optimizer state")),
                         trained and (trained.parameter_bytes, trained.gradient_bytes, trained.state_bytes))
    assert figures["estimated"] == figures["tracked"]


def test_qlora_casts_what_is_not_quantized_to_fp32_as_peft_does():
    def bf16_llama():
        return llama().to(torch.bfloat16)

    def parameter_bytes(quantization):
        result = nbmem.estimate(bf16_llama, causal_lm_batch, batch_size=1, precision="bf16", trainable="lora",
                                quantization=quantization)
        return result.breakdown.category("parameter"), result.notes

    cast, notes = parameter_bytes("nf4")
    kept, _ = parameter_bytes(Quantization("nf4", kbit_casts=False))
    model = llama()
    left = [parameter for name, parameter in model.named_parameters() if "proj" not in name]
    # each parameter left unquantized (embeddings, norms, lm_head) doubles, bf16 to fp32, in 512 B blocks
    assert cast - kept == sum(round_allocation(p.numel() * 4) - round_allocation(p.numel() * 2) for p in left)
    assert any(f"{sum(p.numel() for p in left):,} fp16/bf16 parameters" in note for note in notes)


def test_a_bitsandbytes_config_is_read_as_from_pretrained_reads_it():
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16)
    assert Quantization.of(config) == Quantization("nf4")
    eight = Quantization.of(BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"]))
    assert (eight.method, eight.skip, eight.threshold) == ("int8", ("lm_head",), 6.0)
    result = nbmem.estimate(llama, causal_lm_batch, batch_size=1, optimizer="sgd", quantization=eight)
    assert any("outlier columns (llm_int8_threshold=6) depend on the data; the run assumes none" in note
               for note in result.notes)


def eight_bit_state(n: int) -> int:
    """bitsandbytes' 8-bit Adam state of one parameter of n >= 4,096 elements: two uint8 moments, two fp32 absmax."""
    blocks = math.ceil(n / 256)
    return 2 * round_allocation(n) + 2 * round_allocation(blocks * 4)


def embedded() -> nn.Module:
    return nn.Sequential(nn.Embedding(1000, 256), nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1000))


def token_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 1000, (n,)), torch.randint(0, 1000, (n,))


@pytest.mark.parametrize("mode", ["estimated", "tracked"])
def test_adamw_8bit_state_has_bitsandbytes_sizes_with_the_trainers_fp32_embeddings(mode):
    result = nbmem.estimate(embedded, token_batch, batch_size=4, optimizer="adamw_8bit", mode=mode)
    fp32 = lambda n: 2 * round_allocation(n * 4)  # noqa: E731  # two fp32 moments
    # the embedding's 256,000 values keep 32-bit state (the Trainer's rule); the biases are under 4,096 elements
    state = fp32(256000) + eight_bit_state(256 * 512) + fp32(512) + eight_bit_state(512 * 1000) + fp32(1000)
    maps = 2 * 256 * 4  # its two code maps, signed and unsigned, 256 fp32 values each
    assert result.breakdown.category("optimizer state") == state + maps
    assert any("bitsandbytes AdamW, 8-bit state" in note for note in result.notes)


def test_paged_state_is_managed_memory_outside_the_allocator_and_counts_against_the_device():
    plain = nbmem.estimate(embedded, token_batch, batch_size=4, optimizer="adamw_8bit", device="1GiB")
    paged = nbmem.estimate(embedded, token_batch, batch_size=4, optimizer="paged_adamw_8bit", device="1GiB")
    # parameters of 100,000 elements or more page their two uint8 moments (the absmax stays in the allocator);
    # the embedding's fp32 ones too
    managed = 2 * 256000 * 4 + 2 * (256 * 512) + 2 * (512 * 1000)
    assert paged.managed == managed
    assert plain.breakdown.category("optimizer state") - paged.breakdown.category("optimizer state") == (
        2 * round_allocation(256000 * 4) + 2 * round_allocation(256 * 512) + 2 * round_allocation(512 * 1000))
    assert "managed memory" in str(paged) and plain.managed is None
    tight = nbmem.estimate(embedded, token_batch, batch_size=4, optimizer="paged_adamw_8bit",
                           device=f"{paged.peak + managed - 1}B")
    assert tight.peak <= tight.capacity and tight.fits is False  # the managed state is what doesn't fit
    tracked = nbmem.estimate(embedded, token_batch, batch_size=4, optimizer="paged_adamw_8bit", mode="tracked")
    assert tracked.managed is None  # on a CPU bitsandbytes pages nothing
    assert any("falls back to ordinary tensors" in note for note in tracked.notes)


def test_qlora_7b_shaped_layers_count_their_parameters_by_shape():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=1, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=512)
    build = lambda: LlamaForCausalLM(config)  # noqa: E731
    result = nbmem.estimate(build, causal_lm_batch, batch_size=1, quantization="nf4", trainable="lora",
                            optimizer="paged_adamw_8bit", checkpointing=True, precision="bf16")
    assert result.parameters == parameter_count(build()) + result.trained.parameters
    assert result.trained.total_parameters == result.parameters


@pytest.mark.parametrize("value, message", [
    ("int4", "unknown quantization 'int4': use 'nf4', 'fp4', 'int8'"),
    (4, "quantization= takes 'nf4', 'fp4', 'int8', a transformers BitsAndBytesConfig"),
    (Quantization("nf4", skip=("0", "2")), "all 2 of the model's are left unquantized"),
])
def test_bad_quantization_says_what_to_pass(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        nbmem.estimate(linear, features, batch_size=4, optimizer="sgd", quantization=value)


def test_a_model_without_linear_layers_is_refused_and_the_session_goes_on():
    def convolutional():
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.LazyLinear(4) if False else nn.Identity())

    with pytest.raises(ValueError, match="the model has none \\(Sequential\\)"):
        nbmem.estimate(convolutional, lambda n: torch.randn(n, 3, 8, 8), batch_size=2, quantization="nf4")
    import bitsandbytes.functional as functional

    assert "dynamic" not in functional.name2qmap or not type(functional.name2qmap["dynamic"]).__name__ == "FakeTensor"
    assert nbmem.estimate(linear, features, batch_size=4, optimizer="sgd").peak > 0


def test_unknown_optimizer_names_every_one_nbmem_builds():
    with pytest.raises(ValueError, match="paged_adamw_8bit") as raised:
        nbmem.estimate(linear, features, batch_size=4, optimizer="adamw_torch_2bit")
    assert "adamw_torch_fused" in str(raised.value) and "adafactor" in str(raised.value)


def test_without_bitsandbytes_the_knob_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs bitsandbytes, an optional extra: pip install 'nbmem\[quant\]'"):
        nbmem.estimate(linear, features, batch_size=4, quantization="nf4")
    with pytest.raises(ValueError, match=r"optimizer='paged_adamw_8bit' needs bitsandbytes"):
        nbmem.estimate(linear, features, batch_size=4, optimizer="paged_adamw_8bit")


def test_training_arguments_optim_names_reach_bitsandbytes():
    from types import SimpleNamespace

    from nbmem.whatif.training_arguments import knobs_from_training_arguments

    args = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=1, bf16=False, fp16=False,
                           gradient_checkpointing=False, optim="paged_adamw_8bit")
    read = knobs_from_training_arguments(args)
    assert read.knobs["optimizer"] == "paged_adamw_8bit" and not read.not_understood


def test_a_model_bitsandbytes_already_quantized_is_estimated_as_it_is():
    import bitsandbytes as bnb

    model = nn.Sequential(bnb.nn.Linear4bit(1024, 4096, bias=False, quant_type="nf4", compute_dtype=torch.bfloat16),
                          nn.ReLU(), nn.Linear(4096, 8)).to("cpu")  # quantized by bitsandbytes' CPU kernels here
    given = nbmem.estimate(model, features, batch_size=4, optimizer="sgd")
    ours = nbmem.estimate(linear, features, batch_size=4, optimizer="sgd", quantization=Quantization("nf4", skip=("2",)))
    assert given.breakdown.category("parameter") == ours.breakdown.category("parameter") == (
        nf4_bytes(4096 * 1024) + round_allocation(8 * 4096 * 4) + 512)
    assert given.parameters == ours.parameters
    assert type(model[0].weight).__name__ == "Params4bit" and not type(model[0].weight.quant_state.absmax).__name__ == "FakeTensor"


def test_sweep_puts_full_weights_beside_4bit_and_8bit():
    table = nbmem.sweep(llama, causal_lm_batch, batch_size=1, trainable="lora", precision="bf16",
                        quantization=[None, "nf4", "int8"], progress=False)
    records = table.to_records()
    assert [record["quantization"] for record in records] == ["none", "nf4", "int8"]
    parameters = [row.result.breakdown.category("parameter") for row in table]
    assert parameters[0] > parameters[2] > parameters[1]  # fp32 weights, then one byte a value, then half a byte
    alone = nbmem.estimate(llama, causal_lm_batch, batch_size=1, trainable="lora", precision="bf16", quantization="nf4")
    assert table.rows[1].result.peak == alone.peak
    with pytest.raises(ValueError, match="unknown quantization 'nf3'"):
        nbmem.sweep(llama, causal_lm_batch, batch_size=1, quantization=["nf4", "nf3"], progress=False)


def test_a_sweep_over_compile_and_quantization_leaves_out_the_compiled_quantized_cell():
    """compile=True is estimated unquantized only: the sweep runs the other cells (it stopped before any, before),
    and a sweep with nothing else to run says why."""
    build = lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))  # noqa: E731
    make = lambda n: (torch.randn(n, 64), torch.randint(0, 8, (n,)))  # noqa: E731
    table = nbmem.sweep(build, make, batch_size=4, trainable="head", compile=[False, True],
                        quantization=[None, "int8"], progress=False)
    assert [(row["quantization"], row["compile"]) for row in table.to_records()] == [
        ("none", False), ("none", True), ("int8", False)]
    with pytest.raises(ValueError, match="quantized layers are estimated eagerly"):
        nbmem.sweep(build, make, batch_size=4, trainable="head", compile=True, quantization="int8", progress=False)


def test_max_batch_size_takes_the_quantization():
    full = nbmem.max_batch_size(llama, causal_lm_batch, device="64MiB", trainable="lora", precision="bf16", progress=False)
    quantized = nbmem.max_batch_size(llama, causal_lm_batch, device="64MiB", trainable="lora", precision="bf16",
                                     quantization="nf4", progress=False)
    # the prediction from estimates held in a tracked run of bitsandbytes' CPU kernels; on a model this small the
    # 4-bit layers' casts (input to bf16, output back to fp32) outweigh what their weights save, so fewer fit
    assert quantized.predicted == quantized.batch_size and quantized.batch_size < full.batch_size


def test_bitsandbytes_own_heuristic_chooses_the_kernel_for_the_gpu():
    from nbmem.estimation.quantized_kernels import QuantizedKernels

    shape = dict(out_features=4096, in_features=1024, blocksize=64)
    # bitsandbytes' _gemm_4bit_use_custom_cuda: a T4 (sm75) has fp16 MMA only: 64 rows fused in fp16 (n_blocks 64 >=
    # 40 SMs / 2), dequantized in bf16 (past 7 rows); an H100 at 64 rows of this shape dequantizes (64 < 132 / 2)
    assert QuantizedKernels("T4").fused(torch.float16, rows=64, **shape)
    assert not QuantizedKernels("T4").fused(torch.bfloat16, rows=64, **shape)
    assert not QuantizedKernels("H100-80GB").fused(torch.bfloat16, rows=64, **shape)
    # 11008 x 4096 on an H100 (172 blocks >= 132 SMs): fused up to 32 rows
    assert QuantizedKernels("H100-80GB").fused(torch.bfloat16, rows=32, out_features=11008, in_features=4096, blocksize=64)
    assert not QuantizedKernels("H100-80GB").fused(torch.bfloat16, rows=33, out_features=11008, in_features=4096,
                                                   blocksize=64)
    # without a GPU named: bitsandbytes' bounds, fused only up to 4 rows; past 1,536 rows never fused
    assert not QuantizedKernels(None).fused(torch.float16, rows=64, **shape)
    assert not QuantizedKernels("T4").fused(torch.float16, rows=2048, **shape)


def test_the_dequantize_fallback_holds_a_weight_copy_and_two_absmax_arrays(monkeypatch):
    from nbmem.estimation.quantized_kernels import QuantizedKernels

    def one_layer():
        return nn.Sequential(nn.Linear(1024, 4096, bias=False))

    def peak():
        # bf16 in, bf16 compute: no casts around the matmul, whose own output and temporaries make the peak
        return nbmem.estimate(one_layer, lambda n: torch.randn(n, 1024, dtype=torch.bfloat16), batch_size=2048,
                              task="inference", quantization="nf4", device="H100-80GB")

    dequantized = peak()
    monkeypatch.setattr(QuantizedKernels, "fused", lambda self, *args, **kwargs: True)
    fused = peak()
    # the bf16 copy of the 4096 x 1024 weight, and the fp32 absmax of its 65,536 blocks twice (dequantized, + offset)
    assert dequantized.peak - fused.peak == 4096 * 1024 * 2 + 2 * 65536 * 4
    assert any("1 dequantize the weight to a compute-dtype copy" in note and "for the H100-80GB (132 SMs, compute "
               "capability 9.0)" in note for note in dequantized.notes)


def test_int8_runs_cudas_autograd_function_and_its_int32_buffer():
    result = nbmem.estimate(linear, features, batch_size=4, optimizer="sgd", quantization=Quantization("int8", skip=("2",)))
    assert any("each of the 1 int8 matmuls per step holds an int32 buffer" in note for note in result.notes)


def test_an_estimate_leaves_bitsandbytes_as_it_found_it_even_when_the_step_fails():
    import bitsandbytes
    import bitsandbytes.functional as functional

    before = (bitsandbytes.matmul_4bit, bitsandbytes.matmul, functional.name2qmap.get("dynamic"))

    def broken_loss(output, batch):
        raise RuntimeError("the user's loss failed")

    quantization = Quantization("nf4", skip=("2",))
    with pytest.raises(RuntimeError, match="the user's loss failed"):
        nbmem.estimate(linear, features, batch_size=4, quantization=quantization, loss=broken_loss)
    assert (bitsandbytes.matmul_4bit, bitsandbytes.matmul, functional.name2qmap.get("dynamic")) == before
    assert nbmem.estimate(linear, features, batch_size=4, quantization=quantization).peak > 0  # the next one runs


def test_quantizing_every_weight_of_a_model_that_trains_as_built_says_what_to_do():
    with pytest.raises(ValueError, match="left nothing to train: .* Pass trainable='lora'"):
        nbmem.estimate(linear, features, batch_size=4, quantization="nf4")


@pytest.fixture()
def torchao():
    need("torchao", env="NBMEM_REQUIRE_QUANT")
    import torchao.quantization

    return torchao.quantization


def bf16_llama() -> nn.Module:
    return llama().to(torch.bfloat16)


@pytest.mark.parametrize("config", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"])
@pytest.mark.parametrize("trainable", [None, "lora"])
def test_torchao_weight_configs_estimate_as_a_tracked_run_of_torchao(torchao, config, trainable):
    figures = {}
    for mode in ("estimated", "tracked"):
        result = nbmem.estimate(bf16_llama, causal_lm_batch, batch_size=2, precision="bf16", mode=mode,
                                quantization=getattr(torchao, config)(), trainable=trainable)
        figures[mode] = (result.first_step, result.steady, result.parameters,
                         *(result.breakdown.category(name) for name in ("parameter", "gradient", "optimizer state")))
    assert figures["estimated"] == figures["tracked"]
    assert any(f"quantized to torchao {config} by torchao's own functions" in note for note in result.notes)


def test_torchao_int8_weight_is_a_byte_a_value_with_a_scale_and_zero_point_a_row(torchao):
    def one_layer():
        return nn.Sequential(nn.Linear(1024, 4096, bias=False, dtype=torch.bfloat16))

    result = nbmem.estimate(one_layer, lambda n: torch.randn(n, 1024, dtype=torch.bfloat16), batch_size=4,
                            task="inference", quantization=torchao.Int8WeightOnlyConfig())
    # torchao's Int8Tensor: int8 qdata, an fp32 scale and an int8 zero point per output row
    assert result.breakdown.category("parameter") == 4096 * 1024 + 4096 * 4 + 4096
    assert nbmem.estimate(one_layer, lambda n: torch.randn(n, 1024), batch_size=4, task="inference",
                          quantization=torchao.Float8WeightOnlyConfig()).parameters == 4096 * 1024


def test_torchao_configs_that_cant_run_say_why(torchao):
    with pytest.raises(ValueError, match="needs compute capability 8.9 or more .* the T4 has 7.5"):
        nbmem.estimate(bf16_llama, causal_lm_batch, batch_size=1, device="T4", trainable="lora",
                       quantization=torchao.Float8DynamicActivationFloat8WeightConfig())
    try:
        importable = importlib.util.find_spec("mslk") is not None
    except ValueError:
        importable = False
    if not importable:  # torchao's int4 kernels live in a package of their own
        with pytest.raises(ValueError, match="Int4WeightOnlyConfig needs a kernel package torchao could not import"):
            nbmem.estimate(bf16_llama, causal_lm_batch, batch_size=1, trainable="lora",
                           quantization=torchao.Int4WeightOnlyConfig())
    assert nbmem.estimate(bf16_llama, causal_lm_batch, batch_size=1, trainable="lora",
                          quantization=torchao.Int8WeightOnlyConfig()).peak > 0  # the session goes on


def nf4_config():
    from torchao.prototype._nf4tensor_api import NF4WeightOnlyConfig  # torchao 0.18's home for it

    return NF4WeightOnlyConfig()


def wide_bf16_llama() -> nn.Module:
    """Every projection holds a multiple of 64 x 256 values, as torchao's NF4 needs."""
    from transformers import LlamaForCausalLM

    config = llama().config
    config.update(dict(hidden_size=128, intermediate_size=256, num_key_value_heads=2, head_dim=64))
    return LlamaForCausalLM(config).to(torch.bfloat16)


def test_torchao_nf4_qlora_estimates_as_a_tracked_run_of_torchao(torchao):
    figures = {}
    for mode in ("estimated", "tracked"):
        result = nbmem.estimate(wide_bf16_llama, causal_lm_batch, batch_size=2, precision="bf16", mode=mode,
                                quantization=nf4_config(), trainable="lora")
        figures[mode] = (result.first_step, result.steady, result.parameters,
                         *(result.breakdown.category(name) for name in ("parameter", "gradient", "optimizer state")))
    assert figures["estimated"] == figures["tracked"]
    assert any("14 linear layers quantized to torchao NF4WeightOnlyConfig" in note for note in result.notes)


def test_torchao_nf4_weight_is_half_a_byte_a_value_with_int8_block_scales(torchao):
    def one_layer():
        return nn.Sequential(nn.Linear(1024, 4096, bias=False, dtype=torch.bfloat16))

    result = nbmem.estimate(one_layer, lambda n: torch.randn(n, 1024, dtype=torch.bfloat16), batch_size=4,
                            task="inference", quantization=nf4_config())
    n = 4096 * 1024
    # torchao's NF4Tensor: packed 4-bit data, an int8 scale per 64 values, a bf16 factor per 256 of those, a bf16
    # mean and the 16-value bf16 code book: five storages of 512-byte blocks
    inner = (n // 2, n // 64, n // 64 // 256 * 2, 2, 16 * 2)
    assert result.breakdown.category("parameter") == sum(map(round_allocation, inner)) == 2_164_224
    assert result.parameters == n


@pytest.mark.parametrize("config", ["nf4", "Int8WeightOnlyConfig"])
def test_a_model_torchao_already_quantized_is_copied_through_what_its_weights_wrap(torchao, config):
    from torchao.quantization import quantize_

    model = nn.Sequential(nn.Linear(1024, 4096, bias=False, dtype=torch.bfloat16), nn.ReLU(),
                          nn.Linear(4096, 8, dtype=torch.bfloat16))
    quantize_(model, nf4_config() if config == "nf4" else getattr(torchao, config)(),
              filter_fn=lambda module, name: name == "0")
    weight = model[0].weight
    figures = {}
    for mode in ("estimated", "tracked"):  # a tracked copy of a tensor subclass read its missing storage: SIGSEGV
        result = nbmem.estimate(model, lambda n: torch.randn(n, 1024, dtype=torch.bfloat16), batch_size=4, mode=mode)
        figures[mode] = (result.peak, result.steady, result.breakdown.at_peak)
    assert figures["estimated"] == figures["tracked"]
    assert model[0].weight is weight and type(weight).__name__ in ("NF4Tensor", "Int8Tensor")


def test_torchao_nf4_on_a_layer_too_small_for_its_blocks_names_the_layer_and_the_fix(torchao):
    with pytest.raises(ValueError, match=r"can't quantize layer 'model.layers.0.self_attn.q_proj'.* multiple of "
                                         r"block_size x scaler_block_size = 64 x 256 = 16,384 values"):
        nbmem.estimate(bf16_llama, causal_lm_batch, batch_size=1, quantization=nf4_config(), trainable="lora")


@pytest.fixture()
def forget_compiled_code():
    """torchao's compiled step ran here: later tests' "auto" scopes must not pick the native engine for it."""
    from nbmem.tracking import compiled

    yield
    compiled._seen = False


@pytest.mark.parametrize("name", ["adamw_torch_8bit", "adamw_torch_4bit"])
def test_torchao_low_bit_adamw_state_estimated_as_a_tracked_run_makes_it(torchao, forget_compiled_code, name):
    figures, peaks = {}, {}
    for mode in ("estimated", "tracked"):
        result = nbmem.estimate(linear, features, batch_size=4, optimizer=name, mode=mode)
        figures[mode] = result.breakdown.category("optimizer state")
        peaks[mode] = (result.first_step, result.steady)
        assert any(note.startswith(f"optimizer: torchao AdamW{name[-4:-3]}bit") and "runs it eagerly" in note
                   for note in result.notes)
    assert figures["estimated"] == figures["tracked"]
    # and the step's temporaries: torchao's state dequantizes, updates and quantizes inside its own
    # __torch_dispatch__, which the tracking mode sees through (the tracked step missed them before)
    assert peaks["estimated"] == peaks["tracked"]
    # 4,239,368 parameters: fp32 AdamW would keep 2 x 4 bytes of each; 8-bit about 2 x 1, 4-bit about 2 x 0.5
    full = nbmem.estimate(linear, features, batch_size=4, optimizer="adamw").breakdown.category("optimizer state")
    assert full / figures["estimated"] > (3.9 if name.endswith("8bit") else 7.5)


def test_with_compile_the_torchao_note_says_inductor_planned_its_step(torchao, forget_compiled_code):
    """torchao's step is torch.compile'd: eager in an estimate, planned with the model under compile=True, and the
    note says which (it said "runs it eagerly" for both, a review)."""
    notes = {}
    for planned in (False, True):
        result = nbmem.estimate(linear, features, batch_size=4, optimizer="adamw_torch_8bit", compile=planned)
        (notes[planned],) = [note for note in result.notes if note.startswith("optimizer: torchao")]
    assert "nbmem runs it eagerly" in notes[False] and "inductor planned it" not in notes[False]
    assert "with compile=True inductor planned it" in notes[True] and "runs it eagerly" not in notes[True]


def test_around_a_real_4bit_layer_the_native_engine_sees_what_bitsandbytes_cpu_kernel_allocates_inside():
    import bitsandbytes as bnb

    from nbmem.tracking.native import available

    if not available() and not os.environ.get("NBMEM_REQUIRE_NATIVE"):
        pytest.skip("the native engine needs a C++ compiler (CI has one)")

    layer = bnb.nn.Linear4bit(256, 1024, bias=False, quant_type="nf4", compute_dtype=torch.bfloat16).to("cpu")
    layer.train()  # in eval mode bitsandbytes would repack the weight for AVX-512 first
    inputs = torch.randn(64, 256, dtype=torch.bfloat16)
    peaks = {}
    with torch.no_grad():
        layer(inputs)
        for engine in ("dispatch", "native"):
            with nbmem.track(engine=engine) as tracked:
                layer(inputs)
            peaks[engine] = tracked.result.peak_allocated - tracked.result.allocated_before
    # the dispatch engine sees the matmul's output only (64 x 1024 bf16); bitsandbytes' CPU kernel runs below the
    # dispatch mode and dequantizes the weight there (1024 x 256 bf16, 524,288 B, and more), which the native engine
    # counts from the CPU allocator
    assert peaks["dispatch"] == 64 * 1024 * 2
    assert peaks["native"] - peaks["dispatch"] >= 1024 * 256 * 2


@pytest.mark.parametrize("knobs, message", [
    (dict(optimizer="adamw_8bit", optimizer_in_backward=True), "is not estimated when optimizer_in_backward=True"),
    (dict(optimizer="paged_adamw_8bit", parallel="zero1", world_size=2), "when parallel='zero1' wraps the optimizer"),
    (dict(optimizer="paged_adamw_8bit", mode="measured"), "never frees in this process .* 'adamw_8bit'"),
    (dict(optimizer="adamw_8bit", foreach=False), "has one implementation, which takes no foreach"),
    (dict(optimizer="adafactor", foreach=True), "has one implementation, which takes no foreach"),
    (dict(optimizer="adamw_torch_fused", foreach=True), "or use 'adamw_torch' with foreach="),
])
def test_library_optimizers_refuse_what_they_cant_be_estimated_with(knobs, message):
    from nbmem.estimation.plan import Plan

    with pytest.raises(ValueError, match=message):
        Plan(batch_size=4, **knobs)


def test_an_int8_model_that_already_ran_a_forward_is_estimated_with_its_state():
    import bitsandbytes as bnb

    layer = bnb.nn.Linear8bitLt(1024, 4096, bias=False, has_fp16_weights=False, threshold=0.0)
    layer.load_state_dict(nn.Linear(1024, 4096, bias=False).state_dict())
    model = nn.Sequential(layer, nn.ReLU(), nn.Linear(4096, 8)).to("cpu")
    model(torch.randn(2, 1024))  # bitsandbytes moves CB and SCB from the weight to layer.state
    assert model[0].weight.CB is None and model[0].state.CB is not None
    result = nbmem.estimate(model, features, batch_size=4, optimizer="sgd")
    # the int8 weight and its fp32 row scales, then the fp32 output layer and its bias
    assert result.breakdown.category("parameter") == 4096 * 1024 + 4096 * 4 + round_allocation(8 * 4096 * 4) + 512


def test_quantized_weights_never_train_even_when_everything_is_asked_to():
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=torch.bfloat16, llm_int8_skip_modules=[])
    result = nbmem.estimate(llama, causal_lm_batch, batch_size=1, trainable="all", quantization=config,
                            optimizer="sgd")
    # llm_int8_skip_modules=[] skips nothing, lm_head included (transformers adds its defaults only for None);
    # what trains is what stayed in full precision: the embeddings and the norms
    model = llama()
    unquantized = sum(p.numel() for name, p in model.named_parameters() if "proj" not in name and "lm_head" not in name)
    assert result.trained.parameters == unquantized
    assert any("15 linear layers quantized" in note for note in result.notes)


def test_which_weights_count_as_quantized_for_each_reach(torchao):
    import bitsandbytes
    from torchao.quantization import to_nf4

    from nbmem.estimation.libraries import quantized_weight

    four = bitsandbytes.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")._quantize("cpu")
    rows, scales, _ = bitsandbytes.functional.int8_vectorwise_quant(torch.randn(64, 64, dtype=torch.float16))
    eight = bitsandbytes.nn.Int8Params(rows, requires_grad=False, has_fp16_weights=False, CB=rows, SCB=scales)
    fake_four = nn.Parameter(torch.empty(8, dtype=torch.uint8), requires_grad=False)
    fake_four.quant_state = four.quant_state  # an estimate's fake 4-bit weight: a plain Parameter with the state
    nf4 = nn.Parameter(to_nf4(torch.randn(128, 128, dtype=torch.bfloat16)), requires_grad=False)
    plain = nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    table = {reach: [quantized_weight(weight, reach) for weight in (four, fake_four, eight, nf4, plain)]
             for reach in ("4bit", "bitsandbytes", "any")}
    assert table == {"4bit": [True, True, False, False, False],
                     "bitsandbytes": [True, True, True, False, False],
                     "any": [True, True, True, True, False]}
