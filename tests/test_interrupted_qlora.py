"""Ctrl-C at any line of a QLoRA estimate leaves nothing of it behind (tests/test_interrupted_estimates.py says how).

A Hugging Face Llama (transformers' mask checks wrapped), quantized by bitsandbytes' own code (nbmem's stand-ins for
its CUDA matmuls), LoRA on top. A module of its own so that CI's two workers take it and the other estimates apart:
its trials take 1.5 s each, so only the lines of the estimation's entries and exits are interrupted (the lines the
other estimates run are most of its lines too).
"""

from __future__ import annotations

import pytest

import nbmem
from _zoo import causal_lm_batch, llama, need
from test_interrupted_estimates import check_interrupts
from test_interrupts import one_failure_fails_one_test  # noqa: F401  (a fixture: autouse here too)

pytestmark = pytest.mark.interrupts  # skipped under coverage; .ci/run runs them without it (tests/conftest.py)


def test_an_interrupt_at_any_line_of_a_qlora_estimate_leaves_nothing_behind() -> None:
    need("bitsandbytes", env="NBMEM_REQUIRE_QUANT")
    need("transformers", "peft", env="NBMEM_REQUIRE_ZOO")
    check_interrupts(lambda: nbmem.estimate(llama, causal_lm_batch, batch_size=1, trainable="lora", precision="bf16",
                                            quantization="nf4"), 0, "qlora llama")
