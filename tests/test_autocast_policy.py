"""CUDA's autocast lists on CPU tensors (nbmem.estimation.autocast_policy), against a fake-CUDA oracle and in exact bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from nbmem.estimation.autocast_policy import CPU_LOWER_PRECISION, CUDA_POLICY, CudaAutocastPolicy, registered_ops
from nbmem.estimation.estimate import estimate
from nbmem.tracking.scope import track

# Each case builds its inputs on DEVICE (low: the autocast dtype) and returns the op's output, forward only.
# The oracle runs them on fake "cuda" tensors with CUDA autocast on (DESIGN.md: a CPU-only build still
# answers CUDA's dtype choice there); nbmem runs them on fake "cpu" tensors under CudaAutocastPolicy.
_PROBE = r'''
import json, sys
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from nbmem.estimation.autocast_policy import CudaAutocastPolicy

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}[sys.argv[1]]

def cases(device):
    def f(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=device, dtype=dtype)
    long = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)
    return {
        "matmul": lambda: torch.matmul(f(4, 8), f(8, 8)),
        "linear": lambda: F.linear(f(4, 8), f(8, 8), f(8)),
        "addmm": lambda: torch.addmm(f(8), f(4, 8), f(8, 8)),
        "bmm": lambda: torch.bmm(f(2, 4, 8), f(2, 8, 4)),
        "baddbmm": lambda: torch.baddbmm(f(2, 4, 4), f(2, 4, 8), f(2, 8, 4)),
        "mv": lambda: torch.mv(f(4, 8), f(8)),
        "einsum": lambda: torch.einsum("ij,jk->ik", f(4, 8), f(8, 8)),
        "lstm_cell": lambda: torch.lstm_cell(f(2, 4), (f(2, 3), f(2, 3)), f(12, 4), f(12, 3), f(12), f(12))[0],
        "layer_norm": lambda: F.layer_norm(f(4, 8, dtype=LOW), (8,), f(8), f(8)),
        "rms_norm": lambda: F.rms_norm(f(4, 8, dtype=LOW), (8,)),
        "group_norm": lambda: F.group_norm(f(2, 4, 3, dtype=LOW), 2),
        "softmax": lambda: F.softmax(f(4, 8, dtype=LOW), -1),
        "log_softmax": lambda: F.log_softmax(f(4, 8, dtype=LOW), -1),
        "softmax(dtype given)": lambda: F.softmax(f(4, 8, dtype=LOW), -1, dtype=LOW),
        "cross_entropy": lambda: F.cross_entropy(f(4, 8, dtype=LOW), long(4)),
        "mse_loss": lambda: F.mse_loss(f(4, 8, dtype=LOW), f(4, 8, dtype=LOW)),
        "bce_with_logits": lambda: F.binary_cross_entropy_with_logits(f(4, dtype=LOW), f(4, dtype=LOW)),
        "sum": lambda: f(4, 8, dtype=LOW).sum(),
        "sum(dim)": lambda: f(4, 8, dtype=LOW).sum(0),
        "cumsum": lambda: torch.cumsum(f(4, 8, dtype=LOW), 0),
        "norm": lambda: torch.norm(f(4, 8, dtype=LOW)),
        "exp": lambda: torch.exp(f(4, 8, dtype=LOW)),
        "pow": lambda: torch.pow(f(4, dtype=LOW), 2),
        "gelu(low in)": lambda: F.gelu(f(4, 8, dtype=LOW)),
        "gelu(fp32 in)": lambda: F.gelu(f(4, 8)),
        "addcmul(mixed)": lambda: torch.addcmul(f(4, dtype=LOW), f(4), f(4, dtype=LOW)),
        "addcmul(low)": lambda: torch.addcmul(f(4, dtype=LOW), f(4, dtype=LOW), f(4, dtype=LOW)),
        "cat(mixed)": lambda: torch.cat([f(4, dtype=LOW), f(4)]),
        "interpolate": lambda: F.interpolate(f(1, 1, 2, 2, dtype=LOW), scale_factor=2),
        # policy only: convolutions fail on fake cuda tensors ("not linked with support for cuda devices")
        # and SDPA on them aborts the process (DESIGN.md), so the oracle skips these two
        "conv2d": lambda: F.conv2d(f(1, 2, 5, 5), f(3, 2, 3, 3), f(3)),
        "sdpa": lambda: F.scaled_dot_product_attention(f(1, 2, 4, 8), f(1, 2, 4, 8), f(1, 2, 4, 8)),
    }

NOT_ON_FAKE_CUDA = {"conv2d", "sdpa"}
found = {"cuda": {}, "policy": {}, "cpu": {}}
with FakeTensorMode():
    for name, case in cases("cuda").items():
        if name in NOT_ON_FAKE_CUDA:
            continue
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", LOW)
        try:
            found["cuda"][name] = str(case().dtype)
        finally:
            torch.set_autocast_enabled("cuda", False)
            torch.clear_autocast_cache()
    for name, case in cases("cpu").items():
        with CudaAutocastPolicy() as policy, policy.region("cpu", dtype=LOW):
            found["policy"][name] = str(case().dtype)
        with torch.autocast("cpu", dtype=LOW):
            found["cpu"][name] = str(case().dtype)
print(json.dumps(found))
'''


@pytest.fixture(scope="module", params=["bf16", "fp16"])
def oracle(request: pytest.FixtureRequest) -> tuple[str, dict[str, dict[str, str]]]:
    # a subprocess: a mistake on fake cuda tensors aborts the process (DESIGN.md), never pytest's
    done = subprocess.run([sys.executable, "-c", _PROBE, request.param], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return request.param, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_each_op_gets_the_dtype_cuda_autocast_gives_it(oracle: tuple[str, dict[str, dict[str, str]]]) -> None:
    name, found = oracle
    low = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[name]
    mismatches = {op: (dtype, found["policy"][op]) for op, dtype in found["cuda"].items() if found["policy"][op] != dtype}
    assert not mismatches, f"op: (CUDA's dtype, nbmem's) {mismatches}"
    assert len(found["cuda"]) == 29  # every case but the two the oracle can't run
    # the cases where the lists differ, so this test can fail: CPU autocast keeps these in the low precision,
    # CUDA computes them in float32 (layer norm: the example DESIGN.md gives), or the reverse (mv, lstm_cell)
    differ = {op for op in found["cuda"] if found["cpu"][op] != found["cuda"][op]}
    assert {"layer_norm", "softmax", "log_softmax", "sum", "exp", "norm", "rms_norm", "mv"} <= differ
    assert found["cuda"]["layer_norm"] == "torch.float32" and found["cpu"]["layer_norm"] == low
    assert found["cuda"]["matmul"] == found["cuda"]["linear"] == found["cuda"]["addmm"] == low
    assert found["cuda"]["gelu(low in)"] == low and found["cuda"]["gelu(fp32 in)"] == "torch.float32"
    assert found["cuda"]["softmax(dtype given)"] == low  # a dtype the caller gave is kept (fp32_set_opt_dtype)
    # policy only: convolution and SDPA are in CUDA's low-precision list and keep PyTorch's own CPU kernel
    assert CUDA_POLICY["conv2d"] == CUDA_POLICY["scaled_dot_product_attention"] == "lower_precision_fp"
    assert found["policy"]["conv2d"] == found["policy"]["sdpa"] == low


def test_the_table_is_exactly_what_this_torch_registers_for_cuda_autocast() -> None:
    # a new torch that adds or drops an op from CUDA's lists fails here, so the table is never silently stale
    assert set(CUDA_POLICY) == registered_ops("AutocastCUDA")
    assert CPU_LOWER_PRECISION <= registered_ops("AutocastCPU")


def test_the_policy_is_undone_on_exit_even_after_ctrl_c() -> None:
    def registered() -> bool:
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::layer_norm", "AutocastCPU")

    assert not registered()
    with pytest.raises(KeyboardInterrupt):
        with CudaAutocastPolicy():
            assert registered()
            raise KeyboardInterrupt
    assert not registered()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert nn.functional.layer_norm(x, (8,)).dtype == torch.bfloat16  # CPU autocast's own list again
    with CudaAutocastPolicy():  # the lock was released: a second policy can start
        pass


def test_a_leaf_weight_is_cast_once_per_region_and_not_kept_after() -> None:
    weight = nn.Parameter(torch.randn(256, 256))  # a float32 leaf that requires grad: CUDA caches its cast
    vector = torch.randn(256)
    policy = CudaAutocastPolicy()
    with track("cpu") as scope:
        with policy, policy.region("cpu", dtype=torch.bfloat16):
            outputs = [torch.mv(weight, vector) for _ in range(3)]  # mv: CUDA's list, not CPU's
        casts = {output.grad_fn.next_functions[0][0] for output in outputs}
        assert len(casts) == 1  # one ToCopyBackward: the three mv's share the cached cast
        del outputs, casts
    assert scope.result is not None
    # one cast weight 256 * 256 * 2 = 131072, and three times the vector's cast (256 * 2 = 512) and the output
    # (256 * 2 = 512), each one 512 B block; uncached it would be 3 * 131072 + 3072 = 396288
    assert scope.result.peak == 131072 + 3 * (512 + 512)
    assert scope.result.retained == 0  # the cache let go of the cast when the region ended
    # outside a region (checkpointing's recomputation enters autocast by itself) nothing is cached: no cast
    # outlives the block that made it
    with policy, torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = [torch.mv(weight, vector) for _ in range(2)]
    assert len({output.grad_fn.next_functions[0][0] for output in outputs}) == 2


def test_an_estimate_follows_cuda_for_layer_norm() -> None:
    # a bf16 batch into a LayerNorm(1024) with bf16 autocast: CUDA casts the input to float32 and computes in
    # float32, CPU autocast computes in bf16. N = 256 rows: A = 256 * 1024 * 4 = 1048576 bytes (float32),
    # H = 256 * 1024 * 2 = 524288 (bf16); the loss and its gradient seed are one 512 B block each; the
    # parameters 2 * 1024 * 4 = 8192; the input itself needs no gradient.
    def build() -> nn.Module:
        return nn.LayerNorm(1024)

    def make(n: int) -> torch.Tensor:
        return torch.randn(n, 1024, dtype=torch.bfloat16)

    cuda = estimate(build, make, batch_size=256, optimizer="sgd", precision="bf16")
    cpu = estimate(build, make, batch_size=256, optimizer="sgd", precision="bf16", autocast_policy="cpu")
    # CUDA's peak, in the layer norm's backward: the batch H, its float32 cast A (saved), the output A (held
    # through backward), the incoming gradient A; mean and rstd 256 * 4 = 1024 each; parameters 8192 and
    # their gradients 8192; loss and seed 2 * 512
    assert cuda.peak == 524288 + 3 * 1048576 + 2 * 1024 + 8192 + 8192 + 2 * 512 == 3689472
    # CPU's, at the cast of the gradient to bf16: the batch H, the bf16 output H, the float32 gradient A and
    # its bf16 cast H; mean and rstd 256 * 2 = 512 each; parameters 8192; loss and seed 2 * 512
    assert cpu.peak == 3 * 524288 + 1048576 + 2 * 512 + 8192 + 2 * 512 == 2631680
    assert any("follows CUDA's op lists" in note for note in cuda.notes)
    assert any("autocast_policy='cpu'" in note for note in cpu.notes)
    with pytest.raises(ValueError, match="unknown autocast_policy 'gpu'"):
        estimate(build, make, batch_size=2, precision="bf16", autocast_policy="gpu")


def test_what_a_policy_registers_is_worked_out_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import nbmem.estimation.autocast_policy as policy

    asked = []
    monkeypatch.setattr(policy, "registered_ops", lambda key: asked.append(key) or set())
    policy._registrations.cache_clear()
    try:
        for _ in range(2):
            with CudaAutocastPolicy():
                assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::layer_norm", "AutocastCPU")
        assert asked == ["AutocastCPU"]  # about 20 ms of dispatcher queries, once
    finally:
        policy._registrations.cache_clear()  # the next policy asks the real dispatcher again
