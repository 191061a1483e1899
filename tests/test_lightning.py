"""Lightning (issue 24): estimates read from its Trainer and the module's own training_step, and a callback.

A tiny LightningModule trained for real on the CPU for a few steps. lightning
is an optional dependency (nbmem[lightning]).
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import nbmem
from _zoo import need

need("lightning", env="NBMEM_REQUIRE_LIGHTNING")

import lightning as L  # noqa: E402


@pytest.fixture(autouse=True)
def _collect_lightnings_cycles():
    """A Lightning run leaves its Trainer, module and loaders in reference cycles (5.5 MB of tensors here), which a
    garbage collection in some later test would free in the middle of that test's measurement: collected here."""
    yield
    gc.collect()


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.cross_entropy(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def batch(n):
    return torch.randn(n, 256), torch.randint(0, 10, (n,))


def trainer(**options):
    options = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
               "enable_progress_bar": False, "enable_model_summary": False, **options}
    return L.Trainer(**options)


def test_the_trainer_and_the_modules_own_step_are_estimated():
    plain = nbmem.estimate_lightning(trainer(), Classifier, batch, batch_size=64)
    # the same step written by hand, in Lightning's order: the loss, zero_grad, backward, the optimizer's step
    def by_hand(model, data, optimizer):
        loss = nn.functional.cross_entropy(model.net(data[0]), data[1])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        del loss
        optimizer.step()

    # configure_optimizers' AdamW sets neither foreach nor fused: foreach, CUDA's default (fake CPU tensors loop)
    same = nbmem.estimate(Classifier, batch, batch_size=64,
                          optimizer=lambda parameters: torch.optim.AdamW(parameters, foreach=True), step=by_hand)
    assert (plain.first_step, plain.steady) == (same.first_step, same.steady)
    assert plain.breakdown.category("optimizer state") == same.breakdown.category("optimizer state") > 0
    mixed = nbmem.estimate_lightning(trainer(precision="bf16-mixed", accumulate_grad_batches=2), Classifier, batch,
                                     batch_size=64)
    assert mixed.precision == "bf16" and mixed.accumulation == 2 and mixed.effective_batch == 128
    assert "batch 64 x 2 micro-batches = 128, bf16" in str(mixed).splitlines()[0]  # as the Trainer's headline says
    assert any(note.startswith("from the Lightning trainer: accumulate_grad_batches=2") for note in mixed.notes)
    tracked = nbmem.estimate_lightning(trainer(), Classifier, batch, batch_size=64, mode="tracked")
    assert (tracked.first_step, tracked.steady) == (plain.first_step, plain.steady)


def test_settings_nbmem_does_not_estimate_are_named():
    with pytest.raises(ValueError, match=r"precision='64-true'"):
        nbmem.estimate_lightning(trainer(precision="64-true"), Classifier, batch, batch_size=8)
    with pytest.raises(ValueError, match=r"world_size=4 with SingleDeviceStrategy"):
        nbmem.estimate_lightning(trainer(), Classifier, batch, batch_size=8, world_size=4)


def test_a_fabric_is_read_and_anything_else_refused():
    """A Fabric keeps its precision in its strategy's plugin (it has no precision attribute); None, a string or a
    dict were estimated as fp32 before (a review)."""
    from lightning.fabric import Fabric

    fabric = nbmem.estimate_lightning(Fabric(accelerator="cpu", devices=1, precision="bf16-true"), Classifier, batch,
                                      batch_size=8)
    assert fabric.precision == "bf16-weights"
    for wrong in (None, "bf16-mixed", {"precision": "bf16-mixed"}):
        with pytest.raises(TypeError, match="estimate_lightning reads a lightning Trainer or Fabric"):
            nbmem.estimate_lightning(wrong, Classifier, batch, batch_size=8)


def test_ddp_runs_the_modules_step_through_the_wrapper():
    """The step reaches training_step and configure_optimizers through DDP's wrapper (it raised AttributeError)."""
    single = nbmem.estimate_lightning(trainer(), Classifier, batch, batch_size=8)
    ddp = nbmem.estimate_lightning(trainer(strategy="ddp", devices=2), Classifier, batch, batch_size=8)
    assert (ddp.parallel, ddp.world_size) == ("ddp", 2) and ddp.steady > single.steady  # DDP's gradient buckets


class _Two(Classifier):
    def configure_optimizers(self):
        return [torch.optim.AdamW(self.net[0].parameters()), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


class _Nothing(Classifier):
    def configure_optimizers(self):
        return None


class _Manual(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize("module, said", [(_Two, "several optimizers"), (_Nothing, "gives NoneType"),
                                          (_Manual, "optimizes manually")])
def test_what_automatic_optimization_cant_run_says_to_pass_your_step(module, said):
    with pytest.raises(ValueError, match=rf"{said}.*step=your_step"):
        nbmem.estimate_lightning(trainer(), module, batch, batch_size=8)


def test_the_callback_records_each_batch_and_closes_on_an_exception():
    from nbmem.tracking.tracker import default_tracker

    callback = nbmem.LightningMemoryCallback(backend="tracked", device="cpu", quiet=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*batch(64)), batch_size=16)
    trainer(max_steps=3, callbacks=[callback]).fit(Classifier(), loader)
    steps = list(callback.history)
    assert [result.label for result in steps] == ["training batch 1", "training batch 2", "training batch 3"]
    assert all(result.mode == "tracked" for result in steps)
    parameters = (256 * 1024 + 1024 + 1024 * 10 + 10)
    assert steps[0].retained >= 2 * parameters * 4  # AdamW's two moments appear in the first step and stay

    class Broken(Classifier):
        def training_step(self, data, batch_idx):
            raise RuntimeError("stand-in")

    # a callback kept to read its history keeps no model alive (Lightning gave it the module's bound log)
    import weakref

    module = Classifier()
    held = weakref.ref(module)
    kept = nbmem.LightningMemoryCallback(backend="tracked", device="cpu", quiet=True)
    trainer(max_steps=1, callbacks=[kept]).fit(module, loader)
    del module
    gc.collect()
    assert held() is None and len(kept.history) == 1

    closed = nbmem.LightningMemoryCallback(backend="tracked", device="cpu", quiet=True)
    with pytest.raises(RuntimeError, match="stand-in"):
        trainer(max_steps=2, callbacks=[closed]).fit(Broken(), loader)
    assert not default_tracker("cpu").active and len(closed.history) == 0  # on_exception closed the open step
