"""nbmem.estimate on fake tensors against the same step run for real, tracked."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

import nbmem
from nbmem.estimation.estimate import estimate, repeated_blocks
from nbmem.estimation.plan import Plan


def mlp():
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(64, 100)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


FAMILIES = {
    "mlp": (mlp, lambda n: (torch.randn(n, 256), torch.randint(0, 10, (n,)))),
    "cnn": (cnn, lambda n: (torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,)))),
    "transformer": (Transformer, lambda n: (torch.randint(0, 100, (n, 24)), torch.randint(0, 100, (n, 24)))),
    "lstm": (Recurrent, lambda n: (torch.randn(n, 12, 32), torch.randint(0, 5, (n,)))),
}

KNOBS = [
    {},
    {"precision": "bf16"},
    {"precision": "fp16"},
    {"precision": "bf16-weights"},
    {"checkpointing": True},
    {"optimizer": "sgd-momentum", "foreach": False},
    {"optimizer": "adam", "foreach": True},
    {"optimizer": "adagrad"},
    {"optimizer": "rmsprop"},
    {"accumulation": 3},
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("knobs", KNOBS, ids=lambda knobs: ",".join(f"{k}={v}" for k, v in knobs.items()) or "fp32")
def test_estimate_agrees_with_a_tracked_real_run(family, knobs):
    build, make = FAMILIES[family]
    if family == "lstm" and knobs.get("precision") == "fp16":
        pytest.skip("CPU autocast has no fp16 LSTM kernel")
    # an Intel GPU runs no cuDNN: an LSTM's estimate compares with its tracked run (PyTorch's kernels) there; for an
    # NVIDIA GPU it follows cuDNN's kernel (tests/test_cudnn_rnn.py)
    where = {"device": "Arc-A770-16GB"} if family == "lstm" else {}
    torch.manual_seed(0)
    estimated = estimate(build, make, batch_size=8, **knobs, **where)
    torch.manual_seed(0)
    tracked = estimate(build, make, batch_size=8, mode="tracked", **knobs, **where)
    assert (estimated.mode, tracked.mode) == ("estimated", "tracked")
    assert estimated.peak == pytest.approx(tracked.peak, rel=0.01)
    assert estimated.steady == pytest.approx(tracked.steady, rel=0.01)
    assert sum(size for _, size in estimated.breakdown.at_peak) == estimated.peak


def test_each_mode_says_how_it_was_made():
    build, make = FAMILIES["mlp"]
    estimated = str(estimate(build, make, batch_size=4))
    tracked = str(estimate(build, make, batch_size=4, mode="tracked"))
    assert estimated.startswith("gpumem estimate (estimated on fake tensors, no data, nothing allocated)")
    assert "simulated caching allocator" in estimated
    assert tracked.startswith("gpumem step (tracked: run for real on the cpu, every tensor accounted)")
    with pytest.raises(ValueError, match="unknown mode 'real'"):
        estimate(build, make, batch_size=4, mode="real")


def test_exact_parameters_and_state_for_an_mlp():
    result = estimate(mlp, FAMILIES["mlp"][1], batch_size=32, optimizer="adamw")
    parameters = 256 * 512 * 4 + 512 * 4 + 512 * 10 * 4 + 512  # 10 float32 biases -> one 512 B block
    assert result.parameters == 256 * 512 + 512 + 512 * 10 + 10
    assert result.breakdown.category("parameter") == parameters
    # exp_avg and exp_avg_sq; AdamW's 4 step counters are CPU tensors on a GPU (torch.tensor(0.0)), not counted
    assert dict(result.breakdown.after)["optimizer state"] == 2 * parameters
    assert any("AdamW's step counters" in note for note in result.notes)


@pytest.mark.parametrize("mode", ["estimated", "tracked"])
def test_step_counters_are_device_memory_only_where_the_gpu_makes_them_there(mode):
    # fused (and capturable) groups make each counter with torch.zeros((), device=p.device): 512 B each, counted
    parameters = 256 * 512 * 4 + 512 * 4 + 512 * 10 * 4 + 512
    fused = estimate(mlp, FAMILIES["mlp"][1], batch_size=32, optimizer="adamw-fused", mode=mode)
    assert dict(fused.breakdown.after)["optimizer state"] == 2 * parameters + 4 * 512
    assert not any("step counters" in note for note in fused.notes)
    # Adagrad makes its counters (and its sums) in its constructor: the counters are host memory there too
    adagrad = estimate(mlp, FAMILIES["mlp"][1], batch_size=32, optimizer="adagrad", mode=mode)
    assert dict(adagrad.breakdown.after)["optimizer state"] == parameters
    # SGD with momentum keeps no counter, and says nothing of them
    momentum = estimate(mlp, FAMILIES["mlp"][1], batch_size=32, optimizer="sgd-momentum", mode=mode)
    assert dict(momentum.breakdown.after)["optimizer state"] == parameters
    assert not any("step counters" in note for note in momentum.notes)


def test_an_estimate_leaves_no_optimizer_hook_behind():
    import torch.optim.optimizer as optimizer_module

    hooks = dict(optimizer_module._global_optimizer_pre_hooks)
    outside = nn.Parameter(torch.ones(4))
    kept = torch.optim.AdamW([outside])  # made before the estimate, stepped in its step

    def step(model, batch, optimizer):
        nn.functional.mse_loss(model(batch[0]), torch.zeros(len(batch[0]), 10)).backward()
        outside.grad = torch.ones(4)
        kept.step()

    result = estimate(mlp, FAMILIES["mlp"][1], batch_size=4, optimizer=None, step=step, mode="tracked")
    assert any("AdamW's step counters" in note for note in result.notes)  # the user's own optimizer was seen
    assert float(kept.state[outside]["step"]) == 2.0 and "_init_group" not in vars(kept)
    assert dict(optimizer_module._global_optimizer_pre_hooks) == hooks

    def failing(model, batch, optimizer):
        kept.step()
        raise RuntimeError("the user's step failed")

    with pytest.raises(RuntimeError, match="the user's step failed"):
        estimate(mlp, FAMILIES["mlp"][1], batch_size=4, optimizer=None, step=failing, mode="tracked")
    assert dict(optimizer_module._global_optimizer_pre_hooks) == hooks and "_init_group" not in vars(kept)


def test_knobs_move_memory_the_right_way():
    build, make = FAMILIES["transformer"]
    base = estimate(build, make, batch_size=16)
    bf16 = estimate(build, make, batch_size=16, precision="bf16-weights").breakdown.category("parameter")
    fp32 = base.breakdown.category("parameter")
    tensors = len(list(build().parameters()))
    # half the bytes, but each tensor still rounds up to whole 512 B blocks
    assert fp32 // 2 <= bf16 <= fp32 // 2 + 512 * tensors
    sgd = estimate(build, make, batch_size=16, optimizer="sgd")
    assert dict(sgd.breakdown.after)["optimizer state"] == 0 < dict(base.breakdown.after)["optimizer state"]
    big = estimate(build, make, batch_size=64)
    accumulated = estimate(build, make, batch_size=16, accumulation=4)
    assert accumulated.effective_batch == 64 and accumulated.peak < big.peak
    checkpointed = estimate(build, make, batch_size=64, checkpointing=True)
    assert checkpointed.checkpointing == "on (TransformerEncoderLayer)"
    assert checkpointed.peak < big.peak


def test_a_module_instance_is_copied_not_changed():
    model = Transformer()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    estimate(model, FAMILIES["transformer"][1], batch_size=4, checkpointing=True)
    assert all(parameter.grad is None for parameter in model.parameters())
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert not any("checkpoint" in type(module).__name__.lower() for module in model.modules())
    assert not isinstance(next(model.parameters()), torch._subclasses.fake_tensor.FakeTensor)


def test_capacity_verdict():
    result = estimate(mlp, FAMILIES["mlp"][1], batch_size=8, device="1MiB")
    assert result.fits is False and "does NOT fit" in str(result)
    assert estimate(mlp, FAMILIES["mlp"][1], batch_size=8, device="T4").fits is True


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"batch_size": 0}, "positive whole number"),
        ({"batch_size": 8, "precision": "fp8"}, "use one of fp32, bf16, fp16, bf16-weights, fp16-weights"),
        ({"batch_size": 8, "optimizer": "lion"}, "use one of sgd, sgd-momentum, adam, adamw, adagrad, rmsprop, adam-fused, adamw-fused"),
        ({"batch_size": 8, "accumulation": 0}, "micro-batches"),
        ({"batch_size": 8, "device": "T5000"}, "A100-40GB"),
    ],
)
def test_bad_input_names_what_is_accepted(arguments, message):
    with pytest.raises(ValueError, match=message):
        estimate(mlp, FAMILIES["mlp"][1], **arguments)


def test_bad_batch_factory_and_model():
    with pytest.raises(ValueError, match="must return a tensor, a tuple"):
        estimate(mlp, lambda n: [1, 2, 3], batch_size=4)
    with pytest.raises(ValueError, match="must return a torch.nn.Module"):
        estimate(lambda: "model", FAMILIES["mlp"][1], batch_size=4)


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum().item() > 0:  # data-dependent control flow
            return self.linear(x)
        return x


def test_a_model_that_reads_values_gets_advice_to_track():
    with pytest.raises(ValueError, match="can't run on fake tensors.*nbmem.track"):
        estimate(ReadsValues, lambda n: torch.randn(n, 8), batch_size=4)


def test_repeated_blocks_picks_the_outermost_repeated_type():
    assert repeated_blocks(Transformer()) is nn.TransformerEncoderLayer
    assert repeated_blocks(mlp()) is None


def test_exported_from_the_package():
    assert nbmem.estimate is estimate


def test_reserved_comes_from_the_allocator_simulation():
    result = estimate(mlp, FAMILIES["mlp"][1], batch_size=8)
    assert result.reserved >= result.peak
    # every tensor of this small MLP is at most 1 MiB: all from 2 MiB small-pool segments
    assert result.reserved % (2 * 1024**2) == 0
    big = estimate(lambda: nn.Linear(1024, 4096), lambda n: torch.randn(n, 1024), batch_size=8, optimizer="sgd")
    # the 16 MiB weight and its 16 MiB gradient are large-pool requests of >= 10 MiB: 16 MiB segments each
    assert big.reserved >= 32 * 1024**2 and "reserved peak" in str(big)


def test_fits_needs_every_reserved_segment_to_fit():
    build_one = lambda: nn.Linear(1024, 4096)  # noqa: E731
    make_one = lambda n: torch.randn(n, 1024)  # noqa: E731
    loose = estimate(build_one, make_one, batch_size=8, optimizer="sgd")
    # the 16 MiB weight and its 16 MiB gradient take a 16 MiB large-pool segment each,
    # everything else one 2 MiB small-pool segment
    assert loose.reserved == 16 * 1024**2 * 2 + 2 * 1024**2
    tight = estimate(build_one, make_one, batch_size=8, optimizer="sgd", device=loose.peak)
    assert tight.peak <= tight.capacity  # the allocated bytes would fit...
    assert tight.reserve_failed == 16 * 1024**2 and tight.fits is False  # ...but a segment can't be reserved
    assert "could not reserve a 16.0 MiB segment" in str(tight)
    roomy = estimate(build_one, make_one, batch_size=8, optimizer="sgd", device="1GiB")
    assert roomy.fits is True and roomy.reserve_failed is None


def test_allocated_counts_the_block_the_allocator_gives_as_cuda_does(monkeypatch):
    """CUDA's allocator counts a block's bytes as allocated and splits a large block only when more than 1 MiB would
    be left: an 11.5 MiB weight gets a 12 MiB segment (2 MiB-rounded) whole, and counts 12 MiB. Expandable segments
    map pages to fit (2 MiB pages, split at 512 B): the weight's own bytes."""
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    MiB = 1024**2

    def weight(**keywords):
        return estimate(lambda: nn.Linear(2944, 1024, bias=False), lambda n: torch.randn(n, 2944), batch_size=1,
                        task="inference", **keywords).breakdown.category("parameter")

    assert weight() == 12 * MiB
    assert weight(alloc_conf="expandable_segments:True") == 2944 * 1024 * 4 == 12_058_624


def test_bf16_weights_are_laid_out_as_a_loader_would_without_the_fp32_copy_the_cast_let_go():
    """The fp32 build (a 23 MiB weight in a 24 MiB block) is cast to bf16 and let go: the loader's layout holds only
    the bf16 weight, an 11.5 MiB tensor in a 12 MiB block it counts whole, and the activations' 2 MiB segment. The
    last weight cast used to be laid out again in fp32 too: 38 MiB reserved."""
    MiB = 1024**2
    result = estimate(lambda: nn.Linear(5888, 1024, bias=False), lambda n: torch.randn(n, 5888), batch_size=1,
                      task="inference", precision="bf16-weights")
    assert (result.breakdown.category("parameter"), result.reserved) == (12 * MiB, 14 * MiB)


def test_a_recharge_keeps_the_peaks_breakdown_summing_to_the_peak():
    """After the fp32 build and its cast, a loader's layout charges a bf16 weight a smaller block than the build's
    allocator history gave it: the counters change below the peak, and the peak's breakdown stays the peak's."""
    from nbmem.tracking.tracker import Tracker

    seen = []
    recharge = Tracker.recharge

    def watched(tracker: Tracker) -> None:
        before = sum(record.size for record in tracker._storages.values())
        recharge(tracker)
        seen.append((before, tracker.allocated(), tracker.peak_allocated(),
                     sum(tracker.peak_detail().categories.values())))

    build = lambda: nn.Sequential(nn.Linear(1024, 3072, bias=False), nn.Linear(3072, 1963, bias=False))  # noqa: E731
    with mock.patch.object(Tracker, "recharge", watched):
        estimate(build, lambda n: torch.randn(n, 1024), batch_size=1, task="inference", precision="bf16-weights",
                 timeline=True)
    ((before, after, peak, at_peak),) = seen
    assert before - after == 12_582_912 - 3072 * 1963 * 2  # the 11.5 MiB weight: a 12 MiB block, then its own bytes
    assert at_peak == peak > after


def test_a_tracker_fed_a_simulation_charges_each_storage_its_block():
    """New, resized and reused: each storage counts as the block the simulated allocator holds for it."""
    from nbmem.core.allocator import CachingAllocatorSimulation
    from nbmem.tracking.tracker import Tracker

    MiB = 1024**2
    tracker = Tracker("cpu")
    tracker.simulator = CachingAllocatorSimulation()
    with tracker:
        grown = torch.empty(0)
        grown.resize_(2944 * 1024)  # 11.5 MiB: a 12 MiB segment, not split for 0.5 MiB
        assert tracker.allocated() == 12 * MiB
        kept = torch.empty(2944 * 1024)
        del grown
        reused = torch.empty(11 * MiB // 4)  # the freed 12 MiB block: 1 MiB left is not more than 1 MiB, unsplit
        assert tracker.allocated() == tracker.simulator.allocated == 24 * MiB
        assert tracker.record_of(reused).asked == 11 * MiB and tracker.record_of(kept).size == 12 * MiB
    untracked = Tracker("cpu")
    with untracked:
        alone = torch.empty(2944 * 1024)
        assert untracked.allocated() == 2944 * 1024 * 4  # no simulation: the bytes, rounded to 512
    del kept, reused, alone


def test_the_allocator_settings_change_the_simulated_reserved_figure(monkeypatch):
    # one 1200 MiB weight (15360 x 20480 fp32, no bias) and a few KiB of activations in a 2 MiB small segment
    build = lambda: nn.Linear(15360, 20480, bias=False)  # noqa: E731
    make = lambda n: torch.randn(n, 15360)  # noqa: E731
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    MiB = 1024**2

    def reserved(**keywords):
        return estimate(build, make, batch_size=1, task="inference", **keywords)

    plain = reserved()
    assert plain.reserved == (1200 + 2) * MiB
    assert any("one stream, the allocator's default settings" in note for note in plain.notes)
    # four steps between 1024 and 2048 MiB: the weight's block is 1280 MiB, and counts as allocated, as CUDA's
    # allocator counts a block; the batch's 61,440 B become 65,536 B (four steps between 32 and 64 KiB)
    rounded = reserved(alloc_conf="roundup_power2_divisions:4")
    assert (rounded.peak, rounded.reserved) == (plain.peak + 80 * MiB + 4096, (1280 + 2) * MiB)
    assert any("roundup_power2_divisions:4 (from alloc_conf)" in note for note in rounded.notes)
    # read from the environment when not given, as CUDA would read it
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:4")
    from_environment = reserved()
    assert from_environment.reserved == rounded.reserved
    assert any("(from PYTORCH_CUDA_ALLOC_CONF)" in note for note in from_environment.notes)
    assert "allocator roundup_power2_divisions:4" in from_environment.plan.describe()


def test_allocator_settings_pytorch_would_refuse_fail_before_anything_runs():
    build = lambda: nn.Linear(4, 4)  # noqa: E731
    with pytest.raises(ValueError, match="not a setting PyTorch's allocator knows"):
        estimate(build, lambda n: torch.randn(n, 4), batch_size=2, alloc_conf="expandable:True")
    with pytest.raises(ValueError, match="a measured run uses the allocator as this process started it"):
        Plan(batch_size=2, mode="measured", alloc_conf="expandable_segments:True")


class _ForwardHeavy(nn.Module):
    """One 4 MiB weight, and a forward-only temporary (8 x 1024 x 1024 floats, 32 MiB) that makes the forward the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1024, 1024, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = (x.unsqueeze(2) * x.unsqueeze(1)).mean()
        return self.linear(x) * scale


@pytest.mark.parametrize("model", [lambda: nn.Linear(1024, 1024, bias=False), _ForwardHeavy])
def test_where_the_loop_zeroes_gradients_is_a_knob(model):
    make = lambda n: torch.randn(n, 1024)  # noqa: E731
    runs = {where: estimate(model, make, batch_size=8, optimizer="sgd", zero_grad=where)
            for where in ("after_step", "keep", "before_backward")}
    gradient = 1024 * 1024 * 4  # the weight's gradient: 4,194,304 B
    first = runs["after_step"].first_step
    assert {run.first_step for run in runs.values()} == {first}  # no gradient exists before the first step
    # kept (set_to_none=False): alive through the next forward, and backward's new gradient is added to it
    assert runs["keep"].steady == runs["after_step"].steady + gradient
    # zeroed between the loss and backward: alive through the forward only, so it counts where the forward is the peak
    forward_peak = model is _ForwardHeavy
    assert runs["before_backward"].steady == runs["after_step"].steady + (gradient if forward_peak else 0)
    assert runs["keep"].step.endswith("zero_grad(set_to_none=False): the gradients stay allocated, zero-filled")
    assert "zero_grad keep" in runs["keep"].plan.describe()


def test_zero_grad_says_what_to_pass():
    build = lambda: nn.Linear(4, 4)  # noqa: E731
    make = lambda n: torch.randn(n, 4)  # noqa: E731
    with pytest.raises(ValueError, match="unknown zero_grad 'never': use one of after_step, keep, before_backward"):
        estimate(build, make, batch_size=2, zero_grad="never")
    with pytest.raises(ValueError, match="your step= zeroes them itself"):
        estimate(build, make, batch_size=2, zero_grad="keep", step=lambda model, batch, optimizer: None)
    with pytest.raises(ValueError, match="computes no gradients"):
        estimate(build, make, batch_size=2, zero_grad="keep", task="inference")


@pytest.mark.parametrize("mode", ["estimated", "tracked"])
def test_hold_output_false_drops_the_logits_before_backward(mode):
    """Hugging Face's Trainer (and `loss = model(**batch).loss`) keeps no output through backward: the logits
    (128 x 1000 fp32), which backward does not need, are gone at its peak; the batch stays (the Trainer holds its
    micro-batches for the whole step)."""
    build = lambda: nn.Linear(64, 1000)  # noqa: E731
    make = lambda n: (torch.randn(n, 64), torch.randint(0, 1000, (n,)))  # noqa: E731
    held = estimate(build, make, batch_size=128, optimizer="sgd", mode=mode)
    dropped = estimate(build, make, batch_size=128, optimizer="sgd", mode=mode, hold_output=False)
    assert held.steady - dropped.steady == 128 * 1000 * 4
    assert dropped.step.startswith("nbmem's built-in: output dropped once the loss is made")
    assert "output dropped before backward" in dropped.plan.describe()
    with pytest.raises(ValueError, match="hold_output takes True or False, got 'no'"):
        estimate(build, make, batch_size=2, hold_output="no")
    with pytest.raises(ValueError, match="your step= holds what it holds"):
        estimate(build, make, batch_size=2, hold_output=False, step=lambda model, batch, optimizer: None)
    with pytest.raises(ValueError, match="runs no backward"):
        estimate(build, make, batch_size=2, hold_output=False, task="inference")


def test_weights_loaded_in_bf16_never_reserve_their_fp32_build():
    # eight 4096 x 4096 weights in bf16: 32 MiB each, one 32 MiB segment each; the bf16 biases (8 KiB each) and the
    # activations share one 2 MiB small segment. The fp32 build nbmem's copy of the model went through (twice the
    # bytes, then cast) never reaches a real GPU, whose loaders put the weights there in their own dtype.
    MiB = 1024**2
    build = lambda: nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)])  # noqa: E731
    result = estimate(build, lambda n: torch.randn(n, 4096), batch_size=4, precision="bf16-weights", task="inference")
    assert result.breakdown.category("parameter") == 8 * (4096 * 4096 + 4096) * 2
    assert result.reserved == 8 * 32 * MiB + 2 * MiB


def test_a_fused_optimizer_holds_its_state_and_no_temporaries():
    build = lambda: nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))  # noqa: E731
    make = lambda n: (torch.randn(n, 1024), torch.randn(n, 1024))  # noqa: E731
    sgd, fused = (estimate(build, make, batch_size=256, optimizer=name) for name in ("sgd", "adamw-fused"))
    parameters = (1024 * 4096 + 4096 + 4096 * 1024 + 1024) * 4  # 33,574,912 B
    # plain SGD updates in place, so its peak is backward's; fused AdamW adds its two moments and a 4-byte step
    # tensor per parameter (fused keeps it on the device: a 512 B block each), and nothing more: no foreach temporaries
    assert fused.steady == sgd.steady + 2 * parameters + 4 * 512
    assert any("fused=True" in note for note in fused.notes)
    with pytest.raises(ValueError, match="takes no foreach"):
        estimate(build, make, batch_size=2, optimizer="adamw-fused", foreach=True)


def test_the_optimizer_step_fused_into_backward_frees_each_gradient_as_it_goes():
    build = lambda: nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10))  # noqa: E731
    make = lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,)))  # noqa: E731
    # every parameter's gradient, had they all lived at once: 16,777,216 + 16,384 + 163,840 + 40 (a 512 B block)
    gradients = 16_777_216 + 16_384 + 163_840 + 512

    def run(**options):
        return estimate(build, make, batch_size=64, optimizer="adamw", **options)

    fused, plain = run(optimizer_in_backward=True), run()
    assert plain.breakdown.category("gradient") == gradients  # all of them, at the peak
    assert fused.breakdown.category("gradient") < plain.breakdown.category("gradient")
    # the same optimizer state (AdamW's two moments and step per parameter), made inside backward
    assert fused.breakdown.category("optimizer state") == plain.breakdown.category("optimizer state")
    assert fused.steady < plain.steady
    tracked = run(optimizer_in_backward=True, mode="tracked")  # PyTorch's own hooks and optimizers, for real
    assert (tracked.first_step, tracked.steady) == (fused.first_step, fused.steady)
    assert "optimizer step in backward" in fused.plan.describe()
    with pytest.raises(ValueError, match="with accumulation, it would step once per micro-batch"):
        run(optimizer_in_backward=True, accumulation=2)


def test_reserved_with_the_cublas_workspaces_each_thread_adds(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    MiB = 1024**2
    # one 1200 MiB weight: its own segment, full; a 2 MiB small segment for the rest. A workspace then needs a segment
    # of its own: 8,519,680 B (PyTorch's ":4096:2:16:8") takes a 20 MiB one, Hopper's 32 MiB one of 32 MiB
    build = lambda: nn.Linear(15360, 20480, bias=False)  # noqa: E731
    make = lambda n: torch.randn(n, 15360)  # noqa: E731
    default = estimate(build, make, batch_size=1, task="inference")
    assert (default.workspaces.count, default.workspaces.each) == (1, 8_519_680)  # inference: one thread's
    assert default.reserved_with_workspaces == default.reserved + 20 * MiB
    hopper = estimate(build, make, batch_size=1, task="inference", device="H100-80GB")
    assert hopper.reserved_with_workspaces == hopper.reserved + 32 * MiB
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what PyTorch reads first: 4096 KiB x 8 = 32 MiB
    assert estimate(build, make, batch_size=1, task="inference").workspaces.each == 32 * MiB
    # training: forward's thread and autograd's backward thread, each its own handle and workspace
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    mlp = lambda: nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))  # noqa: E731
    pairs = lambda n: (torch.randn(n, 1024), torch.randn(n, 1024))  # noqa: E731
    trained = estimate(mlp, pairs, batch_size=256, device="H100-80GB")
    assert trained.workspaces.count == 2 and trained.reserved_with_workspaces == trained.reserved + 2 * 32 * MiB
    assert "  with workspaces  234 MiB reserved, with 2 cuBLAS workspaces of 32.0 MiB" in str(trained)
    assert "  not included: cuBLAS workspace about 64.0 MiB (2 of 32.0 MiB; in 'with workspaces' above)" in str(trained)


def test_recurrent_and_convolution_layers_say_what_cudnn_holds_beyond_the_estimate():
    from nbmem.estimation.workspaces import CONV_NOTE, RNN_NOTE

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(4, 8, 3)
            self.gru = nn.GRU(8, 16, batch_first=True)

        def forward(self, x):
            return self.gru(self.conv(x).transpose(1, 2))[0].sum()

    make = lambda n: torch.randn(n, 4, 12)  # noqa: E731
    loss = lambda output, batch: output  # noqa: E731
    on_t4 = estimate(Both, make, batch_size=2, loss=loss, device="T4")
    # a training step's GRU follows cuDNN's kernel (tests/test_cudnn_rnn.py): its note says so, in RNN_NOTE's place
    modelled = [note for note in on_t4.notes if note.startswith("cuDNN: 1 LSTM/GRU call per step (recomputed")]
    assert len(modelled) == 1 and RNN_NOTE not in on_t4.notes
    assert CONV_NOTE in on_t4.notes and f"note: {CONV_NOTE}" in str(on_t4)
    assert modelled == [note for note in estimate(Both, make, batch_size=2, loss=loss).notes  # no device: CUDA's
                        if note.startswith("cuDNN: 1 LSTM")]
    tracked = estimate(Both, make, batch_size=2, loss=loss, device="T4", mode="tracked")
    assert RNN_NOTE in tracked.notes  # real tensors ran PyTorch's kernels
    # Intel's and Apple's GPUs run neither cuDNN nor its kernels' workspaces
    for other in ("Arc-A770-16GB", "Mac-16GB"):
        assert not {RNN_NOTE, CONV_NOTE} & set(estimate(Both, make, batch_size=2, loss=loss, device=other).notes)
    linear = estimate(lambda: nn.Linear(4, 4), lambda n: torch.randn(n, 4), batch_size=2, device="T4")
    assert not {RNN_NOTE, CONV_NOTE} & set(linear.notes)
    # the H100's figures are a training step's: an inference estimate names the layers without them
    served = [note for note in estimate(Both, make, batch_size=2, task="inference", device="T4").notes
              if note.startswith("cuDNN: ")]
    assert len(served) == 2 and all(full.startswith(note.split(";")[0]) for note, full in zip(served, (RNN_NOTE, CONV_NOTE)))
    assert all(note.endswith("measured only for training steps so far") and "H100" not in note for note in served)


class _Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, doubled: bool = False) -> torch.Tensor:
        _FLAGS.append(doubled)
        out = self.linear(x)
        return out * 2 if doubled else out


_FLAGS: list[object] = []


def test_a_batch_dict_passes_plain_values_beside_its_tensors():
    """CLIP needs return_loss=True in its batch: a dict's plain values go to the model as they are; a dict of plain
    values alone, or anything else in it, is still refused with what to return."""
    _FLAGS.clear()
    estimate(_Flagged, lambda n: {"x": torch.randn(n, 64), "doubled": True}, batch_size=32)
    assert _FLAGS and all(flag is True for flag in _FLAGS)  # the model got it as the batch gave it
    with pytest.raises(ValueError, match="a dict of tensors \\(and plain values such as return_loss=True\\)"):
        estimate(_Flagged, lambda n: {"doubled": True}, batch_size=32)
    with pytest.raises(ValueError, match="returned dict"):
        estimate(_Flagged, lambda n: {"x": torch.randn(n, 64), "doubled": [True]}, batch_size=32)


def test_a_sparse_gradient_is_estimated_as_tracked():
    """nn.Embedding(sparse=True): the tracker counts a sparse gradient by its parts, whose _indices() and _values()
    dispatched back into the estimate's fake mode and recursed without end (RecursionError) before."""
    build = lambda: nn.Sequential(nn.Embedding(128, 32, sparse=True), nn.Flatten(), nn.Linear(6 * 32, 8))  # noqa: E731
    make = lambda n: (torch.randint(0, 128, (n, 6)), torch.randint(0, 8, (n,)))  # noqa: E731
    estimated = estimate(build, make, batch_size=2, optimizer="sgd")
    tracked = estimate(build, make, batch_size=2, optimizer="sgd", mode="tracked")
    assert estimated.peak == tracked.peak == 35840
    # parameters: 128*32*4 = 16384, and 6*32*8*4 + 8*4 -> 6144 + 512 (each rounded to 512 B) = 23040
    assert dict(estimated.breakdown.at_peak)["parameter"] == 23040
    assert estimated.breakdown.at_peak == tracked.breakdown.at_peak
    with pytest.raises(RuntimeError, match="Adam does not support sparse gradients"):
        estimate(build, make, batch_size=2, optimizer="adamw")


def test_adafactor_first_estimated_in_a_fresh_process_is_the_tracked_figure():
    """transformers.optimization, first imported inside the estimate's modes, left 1,024 B of module-level tensors
    (peft's layers' default arguments) counted as the step's memory, in whichever mode ran first."""
    pytest.importorskip("transformers")
    import subprocess
    import sys

    step = "(lambda: torch.nn.Linear(32, 8, bias=False)), lambda n: (torch.randn(n, 32), torch.randint(0, 8, (n,)))"
    figures = [f"nbmem.estimate({step}, batch_size=2, optimizer='adafactor', mode={mode!r}).peak"
               for mode in ("estimated", "tracked")]  # the estimate first: transformers not yet imported
    printed = subprocess.check_output([sys.executable, "-c", f"import torch, nbmem; print({', '.join(figures)})"],
                                      text=True, timeout=600)
    first, tracked = map(int, printed.split()[-2:])
    assert first == tracked


def test_a_factory_with_a_bug_of_its_own_raises_its_own_error():
    """A constructor that fails on real tensors too (a shape mismatch) came back as nbmem's ValueError about fake
    tensors; the real build's own error is raised as it is."""
    def build():
        layer = nn.Linear(64, 64)
        torch.ones(3, 4) @ torch.ones(5, 6)  # the bug
        return layer

    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(3x4 and 5x6\)"):
        estimate(build, lambda n: (torch.randn(n, 64), torch.randint(0, 64, (n,))), batch_size=4, optimizer="sgd")


def test_a_kernel_place_left_with_nothing_in_is_taken_over_on_its_own_thread_only():
    """An entry Ctrl-C cut short before its try leaves its class's place held with nothing registered: the next
    entry on the same thread takes it over; another thread's holder may be half-way into its entry, and is kept."""
    import threading

    from nbmem.estimation.kernels import ScopedKernels

    class Nothing(ScopedKernels):
        def register(self, library):
            pass

    left = Nothing()
    left._take_place()  # what an interrupted __enter__ leaves
    with Nothing() as active:
        assert active.registered and Nothing._holder is active
        with pytest.raises(RuntimeError, match="already active in this process"):
            Nothing().__enter__()  # an installed holder is never taken over
    assert Nothing._holder is None
    left._take_place()
    refused = []

    def other_thread():
        try:
            Nothing().__enter__()
        except RuntimeError as error:
            refused.append(str(error))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert refused == ["nbmem's Nothing is already active in this process: one at a time"]
    left.release()
    assert Nothing._holder is None
    left.release()  # idempotent
