"""The plan: a step's configuration, every knob in one frozen object, checked once (issue 22).

``nbmem.estimate``, ``sweep``, ``max_batch_size``, ``launch`` and ``explore``
take the knobs as keyword arguments, as users write them. Each builds one
:class:`Plan` from them and hands it down; a sweep varies a plan with
:func:`dataclasses.replace` (which checks the new one again), and the layers
below read the fields they use. The knobs' validation lives here, once:
a plan that exists is one a step can run with.

A new knob is a field here (its default, its check, how :meth:`Plan.describe`
says it) and code in the one layer that uses it.

>>> plan = Plan(batch_size=8, precision="bf16", checkpointing=True)
>>> plan.describe()
'batch 8, bf16, checkpointing per block, adamw'
>>> import dataclasses
>>> dataclasses.replace(plan, accumulation=4, foreach=True).describe()
'batch 8 x 4 micro-batches, bf16, checkpointing per block, adamw foreach'
>>> Plan(batch_size=0)
Traceback (most recent call last):
...
ValueError: batch_size must be a positive whole number, got 0
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..core.allocator_settings import AllocatorSettings, resolve_alloc_conf
from .attention import check_attention
from .autocast_policy import AUTOCAST_POLICIES
from .building import check_block
from .selective import check_saves, saves_label
from .step import ZERO_GRAD
from .finetune import check_trainable, trainable_label
from .parallel import check_cpu_offload, check_mp_policy, check_parallel, fsdp_family, per_device_batch
from .libraries import require_library
from .quantization import Quantization
from .optimizers import OPTIMIZERS, known_optimizer, library_optimizer, optimizer_names
from .tasks import check_task
from .userstep import check_step, step_name

__all__ = ["Plan", "KNOBS", "MODES", "PRECISIONS", "OPTIMIZERS", "optimizer_name", "run_device", "real_rank"]

#: How a step runs: on fake tensors; for real on the CPU, tracked; for real on CUDA, measured.
MODES = ("estimated", "tracked", "measured")

#: fp32; bf16/fp16 autocast (fp16 with a GradScaler); pure bf16/fp16 weights.
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-weights", "fp16-weights")


def compile_refusal(parallel: Any, task: str, quantization: Any) -> str:
    """Why ``compile=True`` can't be estimated for a configuration, or ``""`` where it can.

    Plan refuses such a configuration with it; a sweep over ``compile=[False, True]`` leaves its compiled cell out.

    >>> compile_refusal("single", "train", None)
    ''
    >>> compile_refusal("fsdp", "train", None)[:40]
    "parallel='fsdp' is estimated eagerly (FS"
    """
    return (f"parallel={parallel!r} is estimated eagerly (FSDP's and DDP's compiled graphs are not planned here)"
            if parallel != "single" else
            "generation calls the model's generate(), which runs the module uncompiled: estimate one forward "
            "with task='inference'" if task == "generate" else
            "quantized layers are estimated eagerly (nbmem.track() around your own compiled step counts "
            "inductor's buffers, with its native engine)" if quantization is not None else "")


@dataclass(frozen=True)
class Plan:
    """Every knob of one step; :func:`nbmem.estimate` documents what each does.

    ``batch_size`` is per device; or give ``global_batch_size`` (across
    devices and micro-batches), which :attr:`per_device_batch` resolves.
    Creating a plan (or replacing a field of one) checks every knob and
    raises ValueError saying what to pass.
    """

    batch_size: int | None = None
    global_batch_size: int | None = None
    loss: Callable[[Any, Any], torch.Tensor] | None = None
    optimizer: str | Callable[..., torch.optim.Optimizer] | None = "adamw"
    precision: str = "fp32"
    checkpointing: bool | Callable[[torch.nn.Module], bool] = False
    accumulation: int = 1
    foreach: bool | None = None
    #: A capacity to compare with (a preset such as "T4", or a size such as "24GiB").
    device: int | str | None = None
    mode: str = "estimated"
    enforce_capacity: bool = False
    parallel: str = "single"
    world_size: int = 1
    rank: int = 0
    step: Callable[..., Any] | None = None
    autocast_policy: str = "cuda"
    trainable: Any = None
    task: str = "train"
    prompt_length: int | None = None
    new_tokens: int | None = None
    #: The caching allocator's settings the simulated reserved figure follows: a PYTORCH_ALLOC_CONF string, an
    #: AllocatorSettings, or None (this process's PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, as CUDA would read it).
    alloc_conf: str | AllocatorSettings | None = None
    #: The repeated block checkpointing wraps and FSDP shards as one unit: a module class, its name, a predicate over
    #: modules, or None (nbmem chooses: nbmem.estimation.building.repeated_blocks).
    block: Any = None
    #: Selective checkpointing: what checkpointed blocks keep (nbmem.estimation.selective): "matmuls",
    #: "every-other-matmul", a list of ops, or a policy function; None keeps only each block's inputs.
    checkpoint_saves: Any = None
    #: Where the built-in step zeroes gradients (nbmem.estimation.step.ZERO_GRAD): "after_step" (set_to_none=True),
    #: "keep" (set_to_none=False: kept, zero-filled), "before_backward" (zero_grad() between the loss and backward).
    zero_grad: str = "after_step"
    #: Whether the built-in step holds the model's output until backward returns (True: ``out = model(x); loss =
    #: f(out); loss.backward()``), or drops it once the loss is made (False: Hugging Face's Trainer, whose
    #: compute_loss returns the loss alone, or ``loss = model(**batch).loss; loss.backward()``). The batch is held.
    hold_output: bool = True
    #: The optimizer step fused into backward: each parameter steps (its own optimizer) as soon as its gradient is
    #: complete, and the gradient is freed (nbmem.estimation.optimizers.OptimizerInBackward).
    optimizer_in_backward: bool = False
    #: FSDP2's mixed precision (fully_shard's mp_policy): "bf16"/"fp16" or a MixedPrecisionPolicy; None: fp32 shards.
    mp_policy: Any = None
    #: FSDP2's CPU offload (fully_shard's offload_policy=CPUOffloadPolicy()): sharded parameters, their gradients and
    #: the optimizer's step and state in host memory, outside the GPU's figures.
    cpu_offload: bool = False
    #: torch.compile the model (inductor), estimated from inductor's own generated code (nbmem.estimation.compiled_plan).
    compile: bool = False
    #: A Hugging Face model's attention implementation (attn_implementation): "eager", "sdpa", "flash_attention_2"...
    #: None: the model's own.
    attention: str | None = None
    #: Quantized weights (nbmem.estimation.quantization): "nf4", "fp4", "int8", a BitsAndBytesConfig or a
    #: Quantization; None: the weights as built.
    quantization: Any = None
    #: The settings alloc_conf resolves to.
    allocator: AllocatorSettings = field(init=False, repr=False, compare=False)
    #: The batch size each device runs (from batch_size, or global_batch_size / (world_size x accumulation)).
    per_device_batch: int = field(init=False, repr=False, compare=False)
    #: What quantization resolves to (None: nothing quantized).
    quantized: Quantization | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the order of the checks is the order a user reads the arguments in: sizes, then the task, then the rest
        object.__setattr__(self, "per_device_batch", self._resolved_batch_size())
        object.__setattr__(self, "allocator", resolve_alloc_conf(self.alloc_conf))
        check_task(self.task, prompt_length=self.prompt_length, new_tokens=self.new_tokens,
                   checkpointing=self.checkpointing, accumulation=self.accumulation, parallel=self.parallel,
                   step=self.step)
        if isinstance(self.per_device_batch, bool) or not isinstance(self.per_device_batch, int) or self.per_device_batch < 1:
            raise ValueError(f"batch_size must be a positive whole number, got {self.per_device_batch!r}")
        _check_accumulation(self.accumulation)
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if isinstance(self.optimizer, str) and not known_optimizer(self.optimizer):
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}: use one of {optimizer_names()}, or pass a function "
                "that takes the parameters and returns a torch.optim.Optimizer"
            )
        if isinstance(self.optimizer, str) and self.optimizer.endswith(("-fused", "_fused")) and self.foreach is not None:
            unfused = self.optimizer.removesuffix("-fused").removesuffix("_fused")
            raise ValueError(f"optimizer={self.optimizer!r} is the fused implementation, which takes no foreach: leave "
                             f"foreach out, or use {unfused!r} with foreach=")
        self._check_library_optimizer()
        check_step(self.step, accumulation=self.accumulation, loss=self.loss, optimizer=self.optimizer,
                   parallel=self.parallel, precision=self.precision)
        check_trainable(self.trainable)
        check_block(self.block)
        _check_checkpointing(self.checkpointing)
        check_saves(self.checkpoint_saves, self.checkpointing)
        self._check_zero_grad()
        self._check_in_backward()
        check_mp_policy(self.mp_policy, self.parallel)
        check_cpu_offload(self.cpu_offload, self.parallel, self.mode)
        self._check_compile()
        check_attention(self.attention)
        self._check_quantization()
        if self.task != "train" and self.trainable is not None:
            raise ValueError(
                f"trainable= chooses what a training step updates, and task={self.task!r} updates nothing: leave trainable out"
            )
        if self.autocast_policy not in AUTOCAST_POLICIES:
            raise ValueError(
                f"unknown autocast_policy {self.autocast_policy!r}: use 'cuda' (CUDA's op lists) or 'cpu' (CPU autocast's)"
            )
        if self.mode not in MODES:
            raise ValueError(
                f"unknown mode {self.mode!r}: use 'estimated' (fake tensors, nothing runs), 'tracked' (a real run on "
                "this CPU, every tensor accounted) or 'measured' (a real run on a CUDA device)"
            )
        if self.mode == "measured" and self.alloc_conf is not None:
            raise ValueError(
                "alloc_conf= sets the allocator settings a simulated reserved figure follows, and a measured run uses "
                "the allocator as this process started it: leave alloc_conf out (set PYTORCH_ALLOC_CONF before CUDA "
                "starts to measure other settings), or use mode='estimated' or 'tracked'"
            )
        # a real run's rank is its process's; an estimate picks the rank whose view it gives
        if self.mode == "estimated" and (
            isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size
        ):
            raise ValueError(
                f"rank must be one of the {self.world_size} ranks, 0 to {self.world_size - 1}, got {self.rank!r}"
            )

    def _check_compile(self) -> None:
        if self.compile is False:
            return
        if self.compile is not True:
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        reason = ("a tracked run's dispatch mode makes PyTorch run compiled code eagerly: estimate it "
                  "(mode='estimated'), or measure your compiled step with nbmem.track(), whose native engine counts "
                  "inductor's buffers" if self.mode == "tracked" else
                  "a measured run's breakdown tracker makes PyTorch run compiled code eagerly: estimate it "
                  "(mode='estimated'), or measure your own compiled step with %%gpumem or nbmem.measure(), which see "
                  "compiled code as it runs" if self.mode == "measured" else
                  compile_refusal(self.parallel, self.task, self.quantization))
        if reason:
            raise ValueError(f"compile=True can't be estimated here: {reason}; leave compile out")

    def _check_zero_grad(self) -> None:
        if self.zero_grad not in ZERO_GRAD:
            raise ValueError(f"unknown zero_grad {self.zero_grad!r}: use one of {', '.join(ZERO_GRAD)} (where your loop "
                             "calls optimizer.zero_grad, and with which set_to_none)")
        if self.zero_grad != "after_step" and self.step is not None:
            raise ValueError("zero_grad= says where nbmem's built-in step zeroes the gradients, and your step= zeroes "
                             "them itself: leave zero_grad out")
        if self.hold_output is not True and self.hold_output is not False:
            raise ValueError(f"hold_output takes True or False, got {self.hold_output!r}")
        if not self.hold_output and self.step is not None:
            raise ValueError("hold_output= says what nbmem's built-in step holds through backward, and your step= "
                             "holds what it holds: leave hold_output out")
        if not self.hold_output and self.task != "train":
            raise ValueError(f"hold_output= applies to training, and task={self.task!r} runs no backward: leave it out")
        if self.zero_grad != "after_step" and self.task != "train":
            raise ValueError(f"zero_grad= applies to training, and task={self.task!r} computes no gradients: leave it out")

    def _check_library_optimizer(self) -> None:
        """bitsandbytes' and torchao's optimizers (and Adafactor): what they need, and what they can't be run with."""
        name = self.optimizer if isinstance(self.optimizer, str) else None
        if name is None or not library_optimizer(name):
            return
        if self.foreach is not None:
            raise ValueError(f"optimizer={name!r} has one implementation, which takes no foreach: leave foreach out")
        library = "transformers" if name == "adafactor" else "torchao" if name.startswith("adamw_torch_") else "bitsandbytes"
        require_library(library, f"optimizer={name!r}")
        if library == "transformers":
            return
        reason = ("optimizer_in_backward=True makes one optimizer per parameter" if self.optimizer_in_backward else
                  f"parallel={self.parallel!r} wraps the optimizer in a sharded one"
                  if self.parallel == "zero1" or fsdp_family(self.parallel) else "")
        if reason:
            raise ValueError(f"optimizer={name!r} is not estimated when {reason} (its state and code maps are set up "
                             "on the optimizer nbmem builds): use 'adamw' there, or leave that option out")
        if self.mode == "measured" and name.startswith("paged_"):
            raise ValueError(f"optimizer={name!r} pages its state into CUDA managed memory, which bitsandbytes never "
                             "frees in this process and PyTorch's allocator never counts: estimate it (mode='estimated' "
                             "shows it as managed memory), or measure its non-paged twin "
                             f"{name.removeprefix('paged_')!r}")

    def _check_quantization(self) -> None:
        quantized = None if self.quantization is None else Quantization.of(self.quantization)
        object.__setattr__(self, "quantized", quantized)
        if quantized is None:
            return
        require_library(quantized.library, "quantization=")
        name = type(quantized.config).__name__
        if name.startswith("Float8DynamicActivation") and self.device is not None:
            from ..core.devices import COMPUTE_CAPABILITY, parse_capacity

            capability = COMPUTE_CAPABILITY.get(parse_capacity(self.device)[1])
            if capability is not None and capability < (8, 9):
                raise ValueError(f"torchao's {name} multiplies in float8, which needs compute capability 8.9 or "
                                 f"more (Ada, Hopper), and the {self.device} has {capability[0]}.{capability[1]}: "
                                 "use a weight-only config there (Float8WeightOnlyConfig, Int8WeightOnlyConfig)")
        if self.parallel != "single":
            raise ValueError(f"quantization= with parallel={self.parallel!r} is not estimated yet (FSDP's QLoRA "
                             "shards 4-bit weights stored as bf16): leave one of them out")

    def _check_in_backward(self) -> None:
        if not self.optimizer_in_backward:
            return
        reason = ("your step= builds its own loop" if self.step is not None else
                  f"task={self.task!r} trains nothing" if self.task != "train" else
                  "with accumulation, it would step once per micro-batch" if self.accumulation != 1 else
                  f"parallel={self.parallel!r} steps sharded optimizers after backward" if self.parallel != "single"
                  else "")
        if reason:
            raise ValueError(f"optimizer_in_backward=True steps each parameter inside backward, and {reason}: "
                             "leave it out here")

    def _resolved_batch_size(self) -> Any:
        check_parallel(self.parallel, self.world_size)
        if (self.batch_size is None) == (self.global_batch_size is None):
            raise ValueError(
                "pass batch_size (per GPU) or global_batch_size (across GPUs and micro-batches), exactly one of them"
            )
        if self.global_batch_size is not None:
            _check_accumulation(self.accumulation)
            return per_device_batch(self.global_batch_size, self.world_size, self.accumulation)
        return self.batch_size

    @property
    def trains(self) -> bool:
        """Whether the step updates the model (task "train"): only then is an optimizer built."""
        return self.task == "train"

    @property
    def optimizer_used(self) -> str | Callable[..., torch.optim.Optimizer] | None:
        """The optimizer the step builds: None when nothing trains."""
        return self.optimizer if self.trains else None

    def describe(self) -> str:
        """The plan in a line, as a person would say it: ``batch 8, bf16, checkpointing per block, adamw foreach``."""
        accumulate = f" x {self.accumulation} micro-batches" if self.accumulation > 1 else ""
        words = [f"batch {self.per_device_batch}{accumulate}", self.precision]
        if self.task != "train":
            words.insert(0, self.task)
            if self.prompt_length is not None:
                words.append(f"{self.prompt_length} prompt tokens")
            if self.new_tokens is not None:
                words.append(f"{self.new_tokens} new tokens")
        else:
            if self.checkpointing is True:
                words.append("checkpointing per block")
            elif self.checkpointing is not False:
                words.append(f"checkpointing where {step_name(self.checkpointing)} says")
            if self.checkpoint_saves is not None:
                words.append(f"keeping {saves_label(self.checkpoint_saves)}")
            foreach = {True: " foreach", False: " for-loop", None: ""}[self.foreach]
            words.append(f"{optimizer_name(self.optimizer)}{foreach}")
            if self.trainable is not None:
                words.append(f"training {trainable_label(self.trainable)}")
            if self.step is not None:
                words.append(f"your step {step_name(self.step)}")
            if self.zero_grad != "after_step":
                words.append(f"zero_grad {self.zero_grad}")
            if not self.hold_output:
                words.append("output dropped before backward")
            if self.optimizer_in_backward:
                words.append("optimizer step in backward")
        if self.parallel != "single":
            words.append(f"{self.parallel} on {self.world_size} GPUs")
        if self.attention is not None:
            words.append(f"{self.attention} attention")
        if self.quantized is not None:
            words.append(f"weights {self.quantized.method}")
        if self.mp_policy is not None:
            words.append(f"FSDP mixed precision {self.mp_policy if isinstance(self.mp_policy, str) else 'policy given'}")
        if self.cpu_offload:
            words.append("CPU offload")
        if self.compile:
            words.append("torch.compile")
        if self.block is not None:
            words.append(f"block {block_label(self.block)}")
        if not self.allocator.is_default:
            words.append(f"allocator {self.allocator}")
        return ", ".join(words)

    def varied(self, **knobs: Any) -> Plan:
        """This plan with some knobs changed, checked again (:func:`dataclasses.replace`)."""
        return dataclasses.replace(self, **knobs)


#: The knobs a plan takes, by name (its init fields).
KNOBS = tuple(item.name for item in dataclasses.fields(Plan) if item.init)


def optimizer_name(optimizer: str | Callable[..., torch.optim.Optimizer] | None) -> str:
    """How a result names the optimizer: its name, a function's name, "custom", or the user's step's own."""
    if optimizer is None:
        return "your step's own optimizer"
    return optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", "custom")


def block_label(block: Any) -> str:
    """How a plan names block=: the class's or function's name, or the name given."""
    return block if isinstance(block, str) else getattr(block, "__name__", "your predicate")


def _check_accumulation(accumulation: Any) -> None:
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation must be a positive whole number of micro-batches, got {accumulation!r}")


def real_rank(parallel: str) -> int:
    """This process's rank in a real run (0 on a single device)."""
    if parallel == "single":
        return 0
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def run_device(mode: str) -> torch.device:
    """Where a step of this mode runs (fake tensors say cpu; they hold no memory anywhere)."""
    if mode not in MODES:
        raise ValueError(
            f"unknown mode {mode!r}: use 'estimated' (fake tensors, nothing runs), 'tracked' (a real run on this "
            "CPU, every tensor accounted) or 'measured' (a real run on a CUDA device)"
        )
    if mode != "measured":
        return torch.device("cpu")
    from ..tracking.accelerators import current_device

    device = current_device()
    if device is None:
        raise ValueError(
            "mode 'measured' runs the step on a CUDA device (or another accelerator) and none is available here: use "
            "mode='tracked' (a real run on this CPU, every tensor accounted) or 'estimated'"
        )
    return device


def _check_checkpointing(checkpointing: Any) -> None:
    """checkpointing= is True, False or a predicate over modules: "no" was read as on (a newcomer's walk through the
    docs), and a block's class is named with block=."""
    if isinstance(checkpointing, type):
        raise ValueError(f"checkpointing={checkpointing.__name__} is a class: to checkpoint each such block, pass "
                         f"checkpointing=True, block={checkpointing.__name__}")
    if isinstance(checkpointing, bool) or callable(checkpointing):
        return
    if isinstance(checkpointing, str):
        word = checkpointing.strip().lower()
        fix = ("checkpointing=False" if word in ("no", "off", "false", "none", "0", "") else
               "checkpointing=True" if word in ("yes", "on", "true", "1") else
               f"checkpointing=True, block={checkpointing!r} to checkpoint each block of that class")
        raise ValueError(f"checkpointing={checkpointing!r} is a string: pass {fix}")
    raise ValueError(f"checkpointing={checkpointing!r}: pass True (each repeated block), False, or a predicate that "
                     "takes a module and says whether to checkpoint it")
