"""Estimate before running: a full training step on fake tensors, no data, no real memory.

``nbmem.estimate(build_model, make_batch, batch_size=64, precision="bf16",
checkpointing=True, optimizer="adamw")`` builds the model and runs two
optimizer steps (forward, loss, backward, step, zero_grad) under PyTorch's
``FakeTensorMode``: every tensor has its shape, dtype and lifetime but no
storage, so a model far larger than the machine costs nothing. nbmem's tracker
accounts those fake storages exactly as it accounts real ones (a tracked real
run of the same step gives the same bytes), with CUDA's 512 B rounding and the
breakdown by category.

The same step can also run for real (``mode=``): ``"tracked"`` on this CPU,
each storage accounted (how the tests check the estimate, and what a tracked
sweep uses), or ``"measured"`` on a CUDA device with the caching allocator's
own statistics (what a measured sweep and ``max_batch_size`` use on a GPU).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
from torch import nn

from .attention import FusedAttention, set_attention
from .cuda_reductions import CudaReductions
from .cudnn_conv import CudnnConv
from .cudnn_rnn import CudnnRNN
from .dropout import FusedDropout
from .kernel_outputs import grouped_mm_notes
from .finetune import TrainedWatch, apply_trainable
from .autocast_policy import CudaAutocastPolicy
from .building import (
    FAKE_ERRORS,
    apply_precision_and_checkpointing,
    fake_failure,
    fresh_model,
    block_rule,
    new_fake_mode,
    repeated_blocks,
    without_onednn,
)
from .low_bit import TORCHAO_OPTIM, prepare_low_bit
from .optimizers import (in_backward, library_optimizer, optimizer_factory,
                         target_optimizer_kwargs)
from .workspaces import WithWorkspaces, cudnn_notes, runs_cudnn, workspaces_for
from .parallel import fsdp_family, fsdp_units, host_figures, host_note, offload_to_host, parallelize, process_group
from .quantization import classify_quantization_state, code_maps, parameter_count, prepare_quantized, quantized
from .compiled_plan import (PLAN_NOTE, UNPLANNED_NOTE, compile_for_estimate, dynamo_shapes_left_as_found,
                            missing_internals, planned_inductor, quiet_about_hooks)
from .quantized_kernels import QuantizedKernels
from .quantized_layers import follow_cuda
from .result import Estimate
from .plan import MODES, OPTIMIZERS, PRECISIONS, Plan, optimizer_name, real_rank, run_device
from ..tracking.compiled import eager_stance
from .unsupported import bitsandbytes_message, compiled_note, from_bitsandbytes
from ..core.devices import PRESETS
from ..core.results import allocator_of
from ..tracking.accelerators import device_counter
from ..tracking.host_counters import HostStepCounters
from ..tracking.live import older_objects_unscanned
from ..tracking.scope import MemoryScope, tracker_alongside_note
from .step import run_step
from .tasks import (CacheRecord, check_generator, run_generate, run_inference, sized_batch, standard_attention_path,
                    task_notes)
from .userstep import (
    AlwaysSteppingScaler,
    fake_error_message,
    real_tensor_message,
    run_user_step,
    step_label,
    user_step_notes,
)
from .fakemode import FastKeyFakeTensorMode
from ..tracking.tracker import Tracker
from ..core.units import format_bytes

__all__ = ["estimate", "estimate_plan", "Estimate", "Plan", "PRECISIONS", "OPTIMIZERS", "MODES", "repeated_blocks"]

def estimate(
    model: nn.Module | Callable[[], nn.Module],
    batch: Callable[..., Any] | None = None,
    *,
    batch_size: int | None = None,
    loss: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: str | Callable[..., torch.optim.Optimizer] | None = "adamw",
    precision: str = "fp32",
    checkpointing: bool | Callable[[nn.Module], bool] = False,
    accumulation: int = 1,
    foreach: bool | None = None,
    device: int | str | None = None,
    mode: str = "estimated",
    enforce_capacity: bool = False,
    parallel: str = "single",
    world_size: int = 1,
    global_batch_size: int | None = None,
    rank: int = 0,
    step: Callable[..., Any] | None = None,
    autocast_policy: str = "cuda",
    trainable: Any = None,
    task: str = "train",
    prompt_length: int | None = None,
    new_tokens: int | None = None,
    alloc_conf: Any = None,
    block: Any = None,
    checkpoint_saves: Any = None,
    zero_grad: str = "after_step",
    hold_output: bool = True,
    optimizer_in_backward: bool = False,
    mp_policy: Any = None,
    cpu_offload: bool = False,
    attention: str | None = None,
    quantization: Any = None,
    compile: bool = False,
    timeline: bool = False,
) -> Estimate:
    """Estimate a training step's peak memory before running anything.

    ``model`` is a module or, better for large models, a function that builds
    one (it is called under fake tensors, so nothing is allocated). ``batch``
    takes a batch size and returns the model's input: a tensor, an
    ``(inputs, targets)`` tuple, or a dict of keyword arguments. ``loss(output,
    batch)`` defaults to cross-entropy for integer targets, MSE for float
    targets, the output's mean otherwise (or ``output.loss``). ``device`` is a
    capacity to compare with (``"T4"``, ``"24GiB"``). Nothing the user built is
    changed: a module is copied first.

    ``mode="tracked"`` runs the same step for real on this CPU, every tensor
    accounted; ``mode="measured"`` runs it on the current CUDA device and
    reads the caching allocator's peaks (allocated and reserved, relative to
    what was allocated before). ``enforce_capacity=True`` makes a real run
    raise ``torch.OutOfMemoryError`` at the op that crosses ``device``.

    ``parallel`` (``"ddp"``, ``"zero1"``, ``"fsdp"``, ``"fsdp-no-reshard"``, ``"zero2"``, ``"zero3"``;
    see :data:`nbmem.estimation.parallel.STRATEGIES`) with ``world_size`` GPUs gives
    what one GPU holds (rank 0, the largest shard): estimated with PyTorch's
    fake process group, so any world size runs here. ``batch_size`` is per
    GPU; or give ``global_batch_size``, which must divide into ``world_size``
    x ``accumulation``. Real runs of a strategy: :func:`nbmem.launch`.
    ``mp_policy`` is FSDP2's mixed precision, apart from autocast: ``"bf16"``
    (or ``"fp16"``) gathers parameters and computes in it and reduces
    gradients in fp32, the shards staying fp32; or FSDP2's own
    ``MixedPrecisionPolicy``. ``cpu_offload=True`` is FSDP2's CPU offload:
    the shards, their gradients and the optimizer's step and state stay in
    host memory, outside the GPU's figures (an estimate's notes say what the
    host holds). ``compile=True`` estimates the model ``torch.compile``'d
    (inductor): inductor plans on the fake tensors and its generated code's
    buffers are counted, its kernels never built
    (:mod:`nbmem.estimation.compiled_plan`; estimated mode only). Without it,
    compiled code in the step runs eagerly and the notes say so.

    The step nbmem runs (:mod:`nbmem.estimation.step`), twice (``first_step``, then
    ``steady``): for each micro-batch it makes the batch, runs forward and
    the loss (under autocast for ``"bf16"``/``"fp16"``) and holds the batch,
    the output and the loss until ``backward()`` returns, then drops them;
    then ``optimizer.step()`` and ``zero_grad(set_to_none=True)``, so no
    gradient lives between steps; ``zero_grad="keep"`` (a loop that calls
    ``zero_grad(set_to_none=False)``) or ``"before_backward"`` (one that
    zeroes between the loss and ``backward()``) keeps them through the next
    forward, as those loops do; ``hold_output=False`` drops the output once
    the loss is made (Hugging Face's Trainer, ``loss = model(**batch).loss``),
    so only what autograd saved of it lives through backward;
    ``optimizer_in_backward=True`` steps each
    parameter inside backward as soon as its gradient is complete and frees
    the gradient, so the gradients never all live at once. Yours may hold
    more or less: pass
    ``step=train_step``, your own ``train_step(model, batch, optimizer)``,
    and nbmem runs it instead, with the same tracker and knobs
    (:mod:`nbmem.estimation.userstep` has the contract): ``batch`` is what ``batch``
    returned for ``batch_size``; ``optimizer`` the one ``optimizer=`` names,
    or None with ``optimizer=None`` (your step builds its own, e.g. two
    of them, kept on the model it gets); bf16/fp16 run it inside autocast,
    fp16 passes a GradScaler as a 4th argument if it takes one; your step
    owns accumulation and the loss, so ``accumulation`` stays 1 and ``loss``
    unset. On fake tensors nothing has a value: guard ``loss.item()`` with
    ``if not nbmem.estimating():``.

    ``trainable`` chooses what trains (:mod:`nbmem.estimation.finetune`): ``"all"``,
    ``"head"``, ``"lora"`` (PEFT's defaults), a PEFT config such as
    ``peft.LoraConfig(r=16)``, or a predicate over parameter names; None
    (the default) leaves the model as it comes. Frozen parameters get no
    gradient and no optimizer state; the result's ``trained`` gives the
    trained parameters' own bytes.

    ``quantization`` quantizes the linear layers as a quantized load does
    (:mod:`nbmem.estimation.quantization`): ``"nf4"``, ``"fp4"``, ``"int8"``
    or a ``BitsAndBytesConfig`` with bitsandbytes' own functions, or a torchao
    weight config with torchao's ``quantize_``; ``optimizer`` also takes
    Hugging Face's ``optim`` names, bitsandbytes' ``"paged_adamw_8bit"`` and
    the others (:mod:`nbmem.estimation.low_bit`).

    ``precision="bf16"``/``"fp16"`` autocast follows CUDA's op lists
    (``autocast_policy="cuda"``, :mod:`nbmem.estimation.autocast_policy`), also in a
    tracked run, whose CPU kernels then compute in the dtypes CUDA would
    choose; ``autocast_policy="cpu"`` keeps CPU autocast's own lists. A
    measured run uses CUDA's autocast itself.

    ``task="inference"`` runs one forward pass of ``batch(batch_size)`` in eval
    mode under ``torch.inference_mode()``, no optimizer; ``task="generate"``
    (a Hugging Face causal LM) runs greedy decoding with the model's own KV
    cache: nbmem makes an unpadded prompt of ``batch_size`` x
    ``prompt_length`` token ids (``batch`` is not needed), prefills it, then
    generates ``new_tokens`` tokens in all, a fixed number of steps;
    ``kv_cache`` and ``kv_cache_per_token`` say what the cache holds
    (:mod:`nbmem.estimation.tasks`). ``prompt_length`` with ``"train"`` or
    ``"inference"`` sets the context length: nbmem calls
    ``batch(batch_size, prompt_length)``.

    >>> build = lambda: nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    >>> make = lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,)))
    >>> result = estimate(build, make, batch_size=64, optimizer="sgd")
    >>> result.breakdown.category("parameter")   # 4198400 + 40960 + 512
    4239872
    >>> def lean_step(model, batch, optimizer):   # the logits die inside cross_entropy, before backward
    ...     nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    ...     optimizer.step()
    ...     optimizer.zero_grad(set_to_none=True)
    >>> mine = estimate(build, make, batch_size=64, optimizer="sgd", step=lean_step)
    >>> result.peak - mine.peak   # the built-in step holds the logits through backward: 64 * 10 * 4 bytes
    2560
    """
    plan = Plan(
        batch_size=batch_size, global_batch_size=global_batch_size, loss=loss, optimizer=optimizer,
        precision=precision, checkpointing=checkpointing, accumulation=accumulation, foreach=foreach, device=device,
        mode=mode, enforce_capacity=enforce_capacity, parallel=parallel, world_size=world_size, rank=rank, step=step,
        autocast_policy=autocast_policy, trainable=trainable, task=task, prompt_length=prompt_length,
        new_tokens=new_tokens, alloc_conf=alloc_conf, block=block, checkpoint_saves=checkpoint_saves,
        zero_grad=zero_grad, hold_output=hold_output, optimizer_in_backward=optimizer_in_backward, mp_policy=mp_policy,
        cpu_offload=cpu_offload, attention=attention, quantization=quantization, compile=compile,
    )
    try:
        return estimate_plan(model, batch, plan, timeline=timeline)
    except (ValueError, AssertionError, RuntimeError) as error:
        # the words for a model the user's factory built with bitsandbytes' layers; nbmem's own quantization and
        # bitsandbytes' optimizers run on fake tensors, and their errors speak for themselves
        ours = plan.quantized is not None or (isinstance(plan.optimizer, str) and library_optimizer(plan.optimizer))
        if ours or not from_bitsandbytes(error):
            raise
        raise ValueError(bitsandbytes_message(error, plan.mode)) from error


def compile_unplanned(notes: list[str]) -> str | None:
    """Why compile=True can't be planned with this torch (noted, and the step estimated eagerly); None: it can."""
    missing = missing_internals()
    if missing is not None:
        notes.append(f"compile=True: {missing}, so the step was estimated as eager (nbmem plans with torch 2.13's "
                     "inductor internals)")
    return missing


#: What a task's step is called in messages.
_STEP_NAMES = {"train": "training step", "inference": "inference pass", "generate": "generation"}


def estimate_plan(model: nn.Module | Callable[[], nn.Module], batch: Callable[..., Any] | None, plan: Plan,
                  timeline: bool = False) -> Estimate:
    """:func:`estimate` for a :class:`~nbmem.estimation.plan.Plan` already made (a sweep's, a search's)."""
    if batch is None and plan.task != "generate":
        raise ValueError(f"task={plan.task!r} needs batch, a function that takes a batch size and returns the model's input")
    batch = sized_batch(batch, plan.prompt_length)
    batch_size, precision, mode, task, parallel = plan.per_device_batch, plan.precision, plan.mode, plan.task, plan.parallel
    optimizer, step, trainable = plan.optimizer_used, plan.step, plan.trainable
    autocast = precision in ("bf16", "fp16") and mode != "measured"
    policy = CudaAutocastPolicy() if autocast and plan.autocast_policy == "cuda" else None
    attention = FusedAttention() if mode != "measured" else None
    run_on = run_device(mode)
    capacity = label = None
    if plan.device is not None:
        from ..core.devices import parse_capacity

        capacity, label = parse_capacity(plan.device)
    fake_mode = new_fake_mode() if mode == "estimated" else None
    notes: list[str] = []
    limit = capacity if plan.enforce_capacity else None
    feed: WithWorkspaces | None = None  # the allocator simulations, tensors' and with workspaces (not measured)
    workspaces = workspaces_for(label if plan.device is not None else None, task)
    if mode == "measured":
        scope = functools.partial(MemoryScope, backend="measured", device=run_on, breakdown=True)
        counter = device_counter(run_on)
        before = (counter.allocated(), counter.reserved() or 0)
    else:
        from ..core.allocator import CachingAllocatorSimulation, StepRecording, settle

        tracker = Tracker("cpu")
        tracker.fake = fake_mode is not None
        # the tensors' simulation, and beside it the same with the cuBLAS workspaces the step's threads add (issue 24)
        tracker.simulator = feed = WithWorkspaces(
            CachingAllocatorSimulation(capacity=capacity, strict=False, settings=plan.allocator))
        # a launched rank (gloo on the CPU): gloo's own flat copies, made in its worker threads, are not
        # counted; NCCL, which a GPU run uses, works on FSDP's buffers in place
        tracker.adopt_unseen = not (mode == "tracked" and parallel != "single")
        if isinstance(fake_mode, FastKeyFakeTensorMode) and parallel == "single":
            tracker.host = fake_mode  # one trip into Python per op, not two (FastKeyFakeTensorMode.carry)
        scope = functools.partial(MemoryScope, tracker=tracker)
        before = (0, 0)
    outer = fake_mode if fake_mode is not None else contextlib.nullcontext()
    # an estimate leaves the objects made before it out of the collector's scans (tracking.live)
    unscanned = older_objects_unscanned() if fake_mode is not None else contextlib.nullcontext()
    planned = plan.compile and compile_unplanned(notes) is None  # compile=True, and this torch's inductor can plan
    # dropout as CUDA's and XPU's fused kernel keeps it (not MPS's); inductor's plan follows its own lowering
    on_mps = getattr(PRESETS.get(label or ""), "backend", "cuda") == "mps"
    dropout = FusedDropout() if mode != "measured" and not planned and not on_mps else None
    # an NVIDIA GPU's own kernels (or none named: a CUDA GPU's), not under compile=True's plan: an LSTM's or GRU's
    # memory as cuDNN's kernel takes it (on fake tensors), attention's backward workspace
    nvidia = runs_cudnn(label) and not planned
    rnn = CudnnRNN(label) if fake_mode is not None and nvidia else None
    # CUDA's split reductions' staging buffers (a bias's gradient, for one; a convolution's bias's too), in a tracked
    # run as well (a CPU buffer of that size, never touched), as dropout's one-byte mask: exact, and what its trials
    # must hold to agree with the estimates
    reductions = CudaReductions(label) if mode != "measured" and nvidia else None
    conv = CudnnConv(reductions) if fake_mode is not None and nvidia else None
    planning = None
    rank = plan.rank if fake_mode is not None else real_rank(parallel)  # the plan checked an estimate's rank
    group = process_group(parallel, plan.world_size, fake=fake_mode is not None, device_type=run_on.type, rank=rank)
    kernels: QuantizedKernels | None = None
    fast_path: standard_attention_path | None = None
    try:
        # oneDNN's CPU kernels (an LSTM's, for one) keep workspaces their fake
        # versions don't model: estimate and tracked run both use the generic ones. Not
        # for compile=True: inductor's CPU plan follows oneDNN being there, as a real compile's does.
        onednn = without_onednn() if not planned else contextlib.nullcontext()
        with group as mesh, onednn, unscanned, outer, scope(capacity=limit, timeline=timeline) as whole, contextlib.ExitStack() as target_rules:
            network = fresh_model(model, fake_mode, run_on, notes, require_trainable=trainable is None and task == "train")
            if plan.quantized is not None:
                if plan.quantized.library == "bitsandbytes":
                    target_rules.enter_context(code_maps(fake_mode, run_on))
                network = prepare_quantized(network, plan.quantized, plan.trains and trainable is not None, notes,
                                            as_built=plan.trains and trainable is None and step is None)
            assert whole.tracker is not None  # every mode here tracks: tracked, or measured with breakdown=True
            classify_quantization_state(network, whole.tracker.classify)  # also a model quantized before nbmem got it
            network = apply_trainable(network, trainable, notes)
            set_attention(network, plan.attention, notes)
            if attention is not None:
                attention.hugging_face = type(network).__module__.startswith(("transformers.", "peft."))
                attention.nvidia = nvidia
            if task == "generate":
                check_generator(network, plan.prompt_length, plan.new_tokens)  # type: ignore[arg-type]  # checked by check_task
            unit, unit_name = block_rule(network, plan.block)  # before checkpointing wraps the blocks
            if fsdp_family(parallel):
                units = len(fsdp_units(network, unit))
                notes.append(f"FSDP units: each {unit_name} ({units}), then the rest of the model as one; block= "
                             "(a class, its name or a predicate) names another" if units else
                             "FSDP: no repeated block found, so the whole model is one unit (all parameters gathered "
                             "at once); name the block with block=")
            chosen = apply_precision_and_checkpointing(network, precision, plan.checkpointing, notes, block=plan.block,
                                                       saves=plan.checkpoint_saves)
            if rnn is not None:  # as CUDA puts a recurrent layer's weights into one buffer (fp16 weights' too)
                if rnn.flatten(network) and task != "train":  # a training step's notes say so, with cuDNN's model
                    notes.append("recurrent layers: each one's weights in one flat buffer, as flatten_parameters() "
                                 "lays them on an NVIDIA GPU for cuDNN (a run on the CPU keeps them apart, each rounded "
                                 "to 512 B)")
            if (precision.endswith("-weights") or plan.quantized is not None) and feed is not None:
                # a real loader puts the weights on the GPU in their own dtype (or quantized): the fp32 build and
                # its cast, which only nbmem's copy of the model went through, never reach its allocator (issue 24)
                tracker.drain()  # first: the fp32 weights the cast let go are not laid again
                tracker.simulator = feed = feed.relaid()
                tracker.recharge()  # each weight charged the block it holds there
            make_optimizer = optimizer_factory(optimizer)
            if plan.optimizer_in_backward:
                make_optimizer = in_backward(make_optimizer)
                notes.append("optimizer: stepped inside backward, one optimizer per parameter in its "
                             "post-accumulate-grad hook, each gradient freed there (PyTorch's fused-backward recipe)")
            optimizer_kwargs = target_optimizer_kwargs(optimizer, plan.foreach, mode, notes, planned=planned)
            network, opt = parallelize(
                network, parallel, mesh, fake=fake_mode is not None, block=unit, make_optimizer=make_optimizer,
                optimizer_kwargs=optimizer_kwargs, classify=whole.tracker.classify, mp_policy=plan.mp_policy,
                cpu_offload=plan.cpu_offload,
            )
            if plan.cpu_offload and fake_mode is not None:
                offload_to_host(network, opt, whole.tracker)
            if planned:
                planning = target_rules.enter_context(planned_inductor(fake_mode))
                target_rules.enter_context(dynamo_shapes_left_as_found())
                target_rules.enter_context(quiet_about_hooks())
                network = compile_for_estimate(network, notes)
                target_rules.callback(network.release)
            managed = prepare_low_bit(opt, network, fake_mode, whole.tracker, notes)
            region = policy.region if policy is not None else torch.autocast
            cache = CacheRecord()
            if task == "inference":
                one_step = functools.partial(run_inference, network, batch, batch_size, precision, run_on,
                                             autocast_region=region)
            elif task == "generate":
                one_step = functools.partial(run_generate, network, batch_size, plan.prompt_length, plan.new_tokens,  # type: ignore[arg-type]  # checked by check_task
                                             precision, run_on, whole.tracker.classify, cache, autocast_region=region)
            elif step is None:
                scaler = torch.amp.GradScaler(run_on.type) if precision == "fp16" else None
                one_step = functools.partial(run_step, network, batch, batch_size, plan.loss, opt, scaler, precision,
                                             plan.accumulation, run_on, autocast_region=region,
                                             zero_grad=plan.zero_grad, hold_output=plan.hold_output)
            else:
                scaler = AlwaysSteppingScaler(run_on.type) if precision == "fp16" else None
                one_step = functools.partial(run_user_step, step, network, batch, batch_size, opt, scaler, precision,
                                             run_on, fake_mode is not None, autocast_region=region)
            if mode != "measured" and not plan.cpu_offload:  # offloaded: the whole step is on the host already
                # every optimizer the step runs, nbmem's or the user's (a Lightning module's, a step's own); the
                # tracked scope enters one for the same tracker (nbmem.tracking.host_counters): this one gives the note
                target_rules.enter_context(HostStepCounters(whole.tracker, notes))
            peaks, reserved, breakdowns = [], [], []
            if feed is not None:  # the first matmuls of the first step make them
                feed.add(workspaces)
            watch = TrainedWatch(network, whole.tracker, trainable) if trainable is not None else None
            kernels = QuantizedKernels(label) if mode != "measured" and quantized(network) else None
            if kernels is not None:
                follow_cuda(network)
            for rule in (policy, attention, dropout, rnn, conv, reductions, kernels):  # CUDA's autocast lists, attention, dropout, cuDNN's RNN and convolutions, reductions, bitsandbytes
                if rule is not None:
                    target_rules.enter_context(rule)
            if task != "train" and mode != "measured":
                fast_path = standard_attention_path(network, notes)
                target_rules.enter_context(fast_path)
            if not planned and (fake_mode is not None or (isinstance(optimizer, str) and optimizer in TORCHAO_OPTIM)):  # a tracked torchao optimizer too
                # torch.compile'd code runs its own Python: Dynamo would compile under FakeTensorMode (an infra
                # mode) and inductor's kernels would then read fake tensors' memory (a dead process, issue 23).
                # Entered here, after the model factory ran: a factory may be what first loads Dynamo.
                target_rules.enter_context(eager_stance())
            compiled_calls = 0
            recording = None
            for index in range(2 if task == "train" else 1):  # an inference pass has no state that a second one would add
                if index == 1 and feed is not None:  # the steady step, to replay in the allocator simulation
                    tracker.simulator = recording = StepRecording(feed)
                with scope() as one:
                    one_step()
                result = one.result
                compiled_calls += one.compiled_calls or 0
                # set when the scope closed; a tracker (tracked, or breakdown=True) made the breakdown
                assert result is not None and result.breakdown is not None
                peaks.append(result.peak_allocated - before[0])
                if result.peak_reserved is not None:
                    # less what other tensors held, not less what was reserved: a step that reuses
                    # blocks cached before it would otherwise read 0 (seen on an H100, 2026-11-25)
                    reserved.append(result.peak_reserved - before[0])
                breakdowns.append(result.breakdown)
            if recording is not None and feed is not None:
                tracker.simulator = feed
                replays = max(settle(feed.tensors, recording.events), settle(feed.whole, recording.events))
                notes.append(f"reserved: the steady step replayed {replays} more time{'s' if replays > 1 else ''} in the "
                             "allocator simulation, until its segments stopped changing")
            parameters = parameter_count(network)
            trained = watch.close(opt) if watch is not None else None
            host = host_figures(network, opt) if plan.cpu_offload else None
            if host is not None:
                notes.append(host_note(*host))
    except FAKE_ERRORS as error:
        if step is not None:
            raise ValueError(fake_error_message(error, step)) from error
        raise ValueError(
            f"the {_STEP_NAMES.get(task, 'training step')} can't run on fake tensors: {fake_failure(error)}. Fake "
            "tensors have no values, so "
            "code that reads them (.item(), .tolist(), nonzero, data-dependent shapes) can't be estimated: "
            "mode='tracked' runs the step for real on this CPU, every tensor accounted (or nbmem.track() around "
            "your own step)"
        ) from error
    except AssertionError as error:  # FakeTensorMode refuses a real tensor with an assertion
        message = real_tensor_message(error)
        if message is None:
            raise
        raise ValueError(message) from error
    finally:
        # Ctrl-C on the very entry of an __exit__, where nothing in it can catch one, leaves what that context
        # changed: each is released again here (idempotent; tests/test_interrupted_estimates.py)
        for entered in (policy, attention, dropout, rnn, conv, reductions, kernels, fast_path, unscanned, group):
            release = getattr(entered, "release", None)
            if release is not None:
                release()
    if policy is not None:
        notes.append(
            f"autocast follows CUDA's op lists (aten/src/ATen/autocast_mode.cpp, torch {torch.__version__.split('+')[0]}) "
            "on the CPU: layer norm, softmax, exp, sums and losses in fp32, matmuls and convolutions in "
            f"{precision}, each weight cast once per forward"
        )
    elif autocast:
        notes.append(
            "autocast follows PyTorch's CPU op lists (autocast_policy='cpu'); CUDA's lists differ for some ops "
            "(e.g. layer norm), so mixed-precision figures may differ from a CUDA run"
        )
    if attention is not None:
        notes += attention.notes(steps=0 if planning is not None else 2)  # compile=True: its calls were traces
    steps = 2 if task == "train" else 1  # the runs that counted calls
    if dropout is not None:
        notes += dropout.notes(steps=steps)
    if rnn is not None:
        notes += rnn.notes(steps=steps)
    if conv is not None:
        notes += conv.notes(steps=steps)
    if reductions is not None:
        notes += reductions.notes(steps=steps)
    # what a tracked run on a CPU leaves out (max_batch_size says so of its trials)
    cuda_kernels = tuple(kind for kind, rule in (("cuDNN's LSTM/GRU", rnn), ("cuDNN's convolutions", conv))
                         if rule is not None and rule.calls)
    if kernels is not None:
        notes += kernels.notes(steps=steps)
    notes += grouped_mm_notes(fake_mode, steps=steps)
    if mode == "measured":
        notes.append(
            f"measured by {allocator_of(str(run_on))}, relative to what was allocated before; it includes the "
            "workspaces the step's kernels allocated through the allocator (cuBLAS's, cuDNN's on CUDA)"
        )
        notes.append(
            f"reserved (measured) is the allocator's peak less what other tensors held before the step; "
            f"{format_bytes(before[1] - before[0])} were cached and free when it began, and count as the step's"
            " (an upper bound when the step did not need them all)"
        )
        notes.append(tracker_alongside_note("step's run without the breakdown's tracker"))
    else:
        notes += plan.allocator.simulation_notes()
        modelled = [name for name, taken in (("cuDNN's RNN", rnn is not None and rnn.calls),
                                             ("cuDNN's convolutions", conv is not None and conv.calls),
                                             ("attention's backward", attention is not None and attention.with_workspace))
                    if taken]
        others = f"cuBLAS's and {' and '.join(modelled)} (noted above)" if modelled else "cuBLAS's"
        notes.append(f"kernel workspaces other than {others} are not included (inductor's plan follows oneDNN's CPU "
                     "kernels)" if planned else f"kernel workspaces other than {others} are not included (CPU oneDNN "
                     "kernels are turned off for the step)")
        notes += cudnn_notes(network, label, task, rnn_modelled=rnn is not None and bool(rnn.calls) and not rnn.unmodelled,
                             conv_modelled=conv is not None and bool(conv.calls) and not conv.unmodelled)
    if planning is not None:
        if planning.calls == 0:
            notes.insert(0, UNPLANNED_NOTE)
        else:
            notes.append(PLAN_NOTE)
    elif compiled_calls:
        notes.append(compiled_note(mode, compiled_calls))
    if step is not None:
        notes += user_step_notes(step, precision, run_on)
    notes += task_notes(task, plan.prompt_length, plan.new_tokens)
    first, steady = peaks if task == "train" else (peaks[0], peaks[0])
    return Estimate(
        batch_size=batch_size,
        accumulation=plan.accumulation,
        precision=precision,
        optimizer=optimizer_name(optimizer) if plan.trains else "none",
        checkpointing=chosen,
        parameters=parameters,
        first_step=first,
        steady=steady,
        breakdown=breakdowns[0] if first >= steady else breakdowns[1],
        reserved=max(reserved) if feed is None else feed.tensors.peak_reserved,  # None: measured
        reserve_failed=None if feed is None else feed.tensors.overflow,
        reserved_with_workspaces=None if feed is None else feed.whole.peak_reserved,
        workspaces=workspaces,
        capacity=capacity,
        capacity_label=label or "",
        mode=mode,
        device=str(run_on),
        parallel=parallel,
        world_size=plan.world_size,
        rank=rank,
        notes=tuple(notes),
        step=step_label(step, plan.zero_grad, plan.hold_output),
        trained=trained,
        task=task,
        prompt_length=plan.prompt_length,
        new_tokens=plan.new_tokens,
        plan=plan,
        kv_cache=cache.bytes if task == "generate" else None,
        kv_cache_per_token=cache.per_token if task == "generate" else None,
        managed=managed.bytes if managed is not None else None,
        host=host[0] + host[1] if host is not None else None,
        cuda_kernels=cuda_kernels,
        timeline=whole.result.timeline if timeline and whole.result is not None else None,
    )
