"""Demonstrates the nbmemdev test device: builds it, then checks its statistics, training and OOMs.

Run from the repository root: ``python tests/_testdevice/check.py``; tests/on_device/test_device.py runs it too.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `import _testdevice`

import torch  # noqa: E402

import _testdevice  # noqa: E402

DEVICE = _testdevice.NAME
MiB = 1 << 20


def build_and_load() -> None:
    started = time.perf_counter()
    path = _testdevice.build()
    built = time.perf_counter() - started
    started = time.perf_counter()
    module = _testdevice.load()
    assert _testdevice.load() is module and torch.nbmemdev is module  # idempotent
    print(f"build: {built:.1f} s ({path}); load: {time.perf_counter() - started:.2f} s")


def accelerator() -> None:
    current = torch.accelerator.current_accelerator()
    print("current_accelerator:", current, "is_available:", torch.accelerator.is_available(),
          "device_count:", torch.accelerator.device_count(), "index:", torch.accelerator.current_device_index())
    assert current == torch.device(DEVICE) and current.type == DEVICE
    assert torch.accelerator.is_available() and torch.accelerator.device_count() == 1
    torch.accelerator.synchronize()


def statistics() -> None:
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    base = torch.accelerator.memory_allocated(0)
    x = torch.empty(1000, device=DEVICE)  # 4000 bytes -> 4096 (512-byte rounding)
    assert x.device == torch.device(DEVICE, 0) and x.is_nbmemdev
    allocated = torch.accelerator.memory_allocated(0) - base
    print("empty(1000) allocated:", allocated, "max:", torch.accelerator.max_memory_allocated(0),
          "reserved:", torch.accelerator.memory_reserved(0))
    assert allocated == 4096

    y = torch.empty(2 * MiB // 4, device=DEVICE)  # a large-pool block
    peak = torch.accelerator.max_memory_allocated(0)
    del y
    after = torch.accelerator.memory_allocated(0)
    reserved = torch.accelerator.memory_reserved(0)
    print(f"after freeing 2 MiB: allocated {after}, peak {peak}, reserved {reserved} (freed block cached)")
    assert after == base + 4096 and peak == base + 4096 + 2 * MiB and reserved >= after + 2 * MiB
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated(0) == after
    assert torch.accelerator.max_memory_reserved(0) == reserved

    # a same-size request reuses the cached block: reserved doesn't grow
    y = torch.empty(2 * MiB // 4, device=DEVICE)
    assert torch.accelerator.memory_reserved(0) == reserved
    del y

    stats = torch.accelerator.memory_stats()
    keys = ["allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
            "requested_bytes.all.current", "active_bytes.all.current", "allocation.all.current",
            "segment.all.current", "allocated_bytes.large_pool.allocated", "num_ooms"]
    print("memory_stats:", {key: stats[key] for key in keys})
    assert stats["allocated_bytes.all.current"] == after and stats["requested_bytes.all.current"] <= after

    free, total = torch.accelerator.get_memory_info()
    print(f"get_memory_info: free {free}, total {total}")
    assert total == _testdevice.capacity() == 1 << 30 and free == total - reserved

    torch.accelerator.empty_cache()
    print("after empty_cache: reserved", torch.accelerator.memory_reserved(0),
          "cached", _testdevice.cached_bytes())
    assert torch.accelerator.memory_reserved(0) == after and _testdevice.cached_bytes() == 0
    torch.accelerator.reset_accumulated_memory_stats()
    assert torch.accelerator.memory_stats()["allocated_bytes.all.allocated"] == 0
    del x


def operations() -> None:
    a = torch.randn(4, 5)
    b = torch.randn(5, 3)
    d = a.to(DEVICE) @ b.to(DEVICE)
    assert torch.allclose(d.cpu(), a @ b)
    t = torch.arange(12.0, device=DEVICE).view(3, 4).t()  # non-contiguous view
    assert torch.equal(t.contiguous().cpu(), torch.arange(12.0).view(3, 4).t())
    assert torch.equal(t.clone().cpu(), t.cpu())  # device -> device copy of strided data
    assert t.sum().item() == 66.0
    z = torch.zeros(3, device=DEVICE).fill_(2.5)
    assert z.tolist() == [2.5, 2.5, 2.5]
    r = torch.empty(0, device=DEVICE)
    r.resize_(10)
    assert r.numel() == 10
    image, kernel = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    assert torch.allclose(torch.conv2d(image.to(DEVICE), kernel.to(DEVICE)).cpu(), torch.conv2d(image, kernel), atol=1e-5)
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(5, 3)
    sequence = torch.randn(6, 2, 5)
    expected = lstm(sequence)[0]
    assert torch.allclose(lstm.to(DEVICE)(sequence.to(DEVICE))[0].cpu(), expected, atol=1e-6)
    # like CUDA's (and CPU's) kernel, mse_loss's scalar keeps an input-sized storage
    prediction, target = torch.randn(32, 10), torch.randn(32, 10)
    loss = torch.nn.functional.mse_loss(prediction.to(DEVICE), target.to(DEVICE))
    assert loss.untyped_storage().nbytes() == torch.nn.functional.mse_loss(prediction, target).untyped_storage().nbytes()
    print("operations: matmul, views, copies, fill_, resize_, conv2d, LSTM, mse_loss ok")


def autocast() -> None:
    layer = torch.nn.Linear(8, 8).to(DEVICE)
    inputs = torch.randn(4, 8, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = layer(inputs)
        probabilities = out.softmax(-1)
    print("autocast(bfloat16): linear ->", out.dtype, "softmax ->", probabilities.dtype, "(CUDA's policy)")
    assert out.dtype == torch.bfloat16 and probabilities.dtype == torch.float32


def training(optimizer_name: str, **options) -> float:
    def run(device: str) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(device)
        optimizer = getattr(torch.optim, optimizer_name)(model.parameters(), lr=0.05, **options)
        inputs, targets = torch.randn(32, 8).to(device), torch.randn(32, 1).to(device)
        losses = []
        for _ in range(3):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    on_cpu, on_device = run("cpu"), run(DEVICE)
    print(f"training {optimizer_name}{options or ''}: cpu {on_cpu} / {DEVICE} {on_device}")
    assert all(abs(x - y) < 1e-5 for x, y in zip(on_cpu, on_device)), (on_cpu, on_device)
    return on_device[-1]


def measured_training() -> None:
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    before = torch.accelerator.memory_allocated(0)
    model = torch.nn.Linear(1024, 1024).to(DEVICE)  # 4 MiB weight + 4 KiB bias
    optimizer = torch.optim.AdamW(model.parameters())
    loss = model(torch.randn(64, 1024, device=DEVICE)).square().mean()
    loss.backward()
    optimizer.step()
    parameters = torch.accelerator.memory_allocated(0) - before
    print(f"Linear(1024,1024)+AdamW after a step: {parameters / MiB:.2f} MiB allocated "
          f"(weights+grads+2 moments = 4 x 4 MiB), peak {torch.accelerator.max_memory_allocated(0) / MiB:.2f} MiB")
    assert parameters >= 4 * (4 * MiB + 4096)


def out_of_memory() -> None:
    torch.accelerator.empty_cache()
    saved = _testdevice.capacity()
    _testdevice.set_capacity(8 * MiB)
    try:
        keep = torch.empty(MiB // 4, device=DEVICE)
        ooms = torch.accelerator.memory_stats()["num_ooms"]
        try:
            torch.empty(16 * MiB // 4, device=DEVICE)
        except torch.OutOfMemoryError as error:
            print("OOM:", str(error).splitlines()[0])
            assert "nbmemdev out of memory. Tried to allocate 16.00 MiB" in str(error)
        else:
            raise AssertionError("no OutOfMemoryError")
        assert torch.accelerator.memory_stats()["num_ooms"] == ooms + 1
        # an OOM inside an op (CPU fallback copying its output back) is the same error
        try:
            torch.ones(1024, 1024, device=DEVICE) @ torch.ones(1024, 1024, device=DEVICE)  # 3 x 4 MiB
        except torch.OutOfMemoryError:
            pass
        else:
            raise AssertionError("no OutOfMemoryError from an op")
        # the cache is emptied and retried before an OOM: 4 cached MiB come back
        block = torch.empty(4 * MiB // 4, device=DEVICE)
        del block
        torch.empty(6 * MiB // 4, device=DEVICE)
        assert torch.accelerator.memory_stats()["num_alloc_retries"] >= 1
        still = (keep.fill_(1.0) + 1).sum().item()
        assert still == 2 * (MiB // 4)
        print("device usable after OOM; num_ooms:", torch.accelerator.memory_stats()["num_ooms"])
        del keep
    finally:
        _testdevice.set_capacity(saved)


def main() -> None:
    build_and_load()
    accelerator()
    statistics()
    operations()
    training("SGD", momentum=0.9)
    training("SGD", momentum=0.9, foreach=True)
    training("AdamW", foreach=False)
    training("AdamW", foreach=True)
    training("AdamW")  # default: torch picks foreach for a PrivateUse1 backend
    training("AdamW", fused=True)
    autocast()
    measured_training()
    out_of_memory()
    print("all checks passed")


if __name__ == "__main__":
    main()
