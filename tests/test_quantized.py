"""bitsandbytes under nbmem (issue 25, its first part): a clear error where an estimate can't run it, and what to run.

A stand-in package named bitsandbytes (a file under a ``bitsandbytes/`` folder) raises as bitsandbytes' 4-bit layer
does before it is quantized (a bare AssertionError), so the test runs without bitsandbytes installed; where it is
installed, the real layer is tried too.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import nbmem

MiB = 1024**2


def stand_in(tmp_path):
    folder = tmp_path / "bitsandbytes"
    folder.mkdir()
    (folder / "functional.py").write_text("def quantize(weight):\n    assert weight.device.type == 'cuda'\n    return weight\n")
    spec = importlib.util.spec_from_file_location("stand_in_bitsandbytes", folder / "functional.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failure_in_bitsandbytes_code_says_what_to_run_instead(tmp_path):
    quantize = stand_in(tmp_path).quantize

    class Quantized(nn.Linear):
        def forward(self, x):
            return nn.functional.linear(x, quantize(self.weight))

    make = lambda: nn.Sequential(Quantized(64, 64))  # noqa: E731
    with pytest.raises(ValueError, match="can't be estimated on fake tensors \\(AssertionError\\)") as estimated:
        nbmem.estimate(make, lambda n: torch.randn(n, 64), batch_size=4)
    assert "mode='tracked' with a factory that moves the model to the CPU" in str(estimated.value)
    with pytest.raises(ValueError, match="quantizes its weights only when the model moves to a device"):
        nbmem.estimate(make, lambda n: torch.randn(n, 64), batch_size=4, mode="tracked")


def test_other_failures_are_left_as_they_are():
    def broken():
        raise RuntimeError("not bitsandbytes")

    # the factory fails on real tensors too: its own error, as it is (nbmem's ValueError wrapped it until 2026-11-27)
    with pytest.raises(RuntimeError, match="^not bitsandbytes$"):
        nbmem.estimate(broken, lambda n: torch.randn(n, 64), batch_size=4)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed (an optional extra)")
def test_a_real_4bit_layer_tracked_on_the_cpu_after_moving_it():
    import bitsandbytes as bnb

    def make():
        return nn.Sequential(bnb.nn.Linear4bit(1024, 4096, quant_type="nf4", compute_dtype=torch.bfloat16)).to("cpu")

    with pytest.raises(ValueError, match="can't be estimated on fake tensors"):
        nbmem.estimate(make, lambda n: torch.randn(n, 1024), batch_size=4)
    tracked = nbmem.estimate(make, lambda n: torch.randn(n, 1024), batch_size=4, optimizer="sgd", mode="tracked")
    # 4096 x 1024 weights at 4 bits: 2 MiB of packed uint8 and its double-quantized state (65,536 B of uint8
    # absmax, the second stage's 1,024 B absmax and 1,024 B code, the nf4 code and the offset, 512 B each); the bias,
    # which bitsandbytes' forward re-makes in the compute dtype (bias.data = ...), is no longer the one built
    assert tracked.breakdown.category("parameter") == 2 * MiB + 65536 + 1024 + 1024 + 512 + 512
