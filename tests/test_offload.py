"""DeepSpeed's ZeRO stages 2 and 3 and FSDP2's CPU offload (issue 24): what each GPU holds, and what the host holds.

Estimated with PyTorch's own wrappers on fake tensors (``fully_shard`` with ``CPUOffloadPolicy``); the host's share
leaves the device figures as FSDP hands it over. Exact where the arithmetic is known: rank 0's shards, Adam's state
on them, the step counters.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

import nbmem
from nbmem.core.units import format_bytes
from nbmem.whatif.training_arguments import knobs_from_training_arguments
from test_parallel import _shard_bytes, build, make

OPTIONS = dict(batch_size=16, optimizer="adam", world_size=4)


def _shard_numel(world_size: int) -> int:
    """Rank 0's parameter elements under FSDP2: each parameter split on its first dimension, unpadded."""
    return sum(math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0]) for p in build().parameters())


def _after(result) -> dict[str, int]:
    return dict(result.breakdown.after)


@pytest.mark.parametrize(("zero", "fsdp"), [("zero2", "fsdp-no-reshard"), ("zero3", "fsdp")])
def test_deepspeed_stages_are_estimated_as_their_fsdp2_counterparts(zero, fsdp):
    ours, theirs = (nbmem.estimate(build, make, parallel=name, **OPTIONS) for name in (zero, fsdp))
    assert (ours.first_step, ours.steady, ours.reserved) == (theirs.first_step, theirs.steady, theirs.reserved)
    assert _after(ours)["parameter"] == _shard_bytes(build(), 4)
    assert f"{zero} on 4 GPUs" in str(ours) and "DeepSpeed ZeRO stage" in nbmem.STRATEGIES[zero]


def test_zero2_keeps_gathered_parameters_through_backward_and_zero3_does_not():
    zero2, zero3 = (nbmem.estimate(build, make, parallel=name, **OPTIONS) for name in ("zero2", "zero3"))
    assert dict(zero2.breakdown.at_peak)["parameter"] > dict(zero3.breakdown.at_peak)["parameter"]
    assert zero2.steady > zero3.steady


@pytest.mark.parametrize("parallel", ["zero3", "zero2", "fsdp"])
def test_cpu_offload_moves_shards_gradients_and_optimizer_state_to_the_host(parallel):
    kept = nbmem.estimate(build, make, parallel=parallel, **OPTIONS)
    offloaded = nbmem.estimate(build, make, parallel=parallel, cpu_offload=True, **OPTIONS)
    # between steps the GPU holds nothing of the model: shards and state are in host memory
    assert _after(offloaded)["parameter"] == _after(offloaded)["optimizer state"] == 0
    assert _after(kept)["parameter"] == _shard_bytes(build(), 4)
    # the host: rank 0's fp32 shards, Adam's two moments on them, and one 4-byte step counter per parameter
    shards = 4 * _shard_numel(4)
    counters = 4 * len(list(build().parameters()))
    assert offloaded.host == shards + 2 * shards + counters == 3 * 823_816 + 16 * 4  # 2,471,512 B
    assert kept.host is None and "host memory" in str(offloaded) and "host memory" not in str(kept)
    assert any(note.startswith(f"FSDP CPU offload: this rank's host memory holds parameter shards "
                               f"({format_bytes(823_816)}) and optimizer state ({format_bytes(2 * 823_816 + 64)})")
               for note in offloaded.notes)
    # the steady peak is lower by at least the shards and the state the GPU no longer holds
    assert kept.steady - offloaded.steady >= _after(kept)["parameter"] + _after(kept)["optimizer state"]
    assert offloaded.first_step == offloaded.steady  # no optimizer state arrives on the GPU at the first step
    assert "CPU offload" in offloaded.plan.describe()


def test_cpu_offload_refuses_what_it_cannot_mean():
    with pytest.raises(ValueError, match=r"cpu_offload=True is FSDP2's CPU offload \(CPUOffloadPolicy\), and "
                                         r"parallel='ddp': use one of fsdp, fsdp-no-reshard, zero2, zero3"):
        nbmem.estimate(build, make, parallel="ddp", cpu_offload=True, **OPTIONS)
    with pytest.raises(ValueError, match="a tracked run's device is this CPU, where nothing moves"):
        nbmem.estimate(build, make, parallel="fsdp", cpu_offload=True, mode="tracked", **OPTIONS)
    with pytest.raises(ValueError, match="cpu_offload must be True or False, got 'yes'"):
        nbmem.estimate(build, make, parallel="fsdp", cpu_offload="yes", **OPTIONS)


def test_a_sweep_offloads_only_its_fsdp_configurations():
    table = nbmem.sweep(build, make, batch_size=16, optimizer="adam", parallel=["ddp", "zero3"], world_size=4,
                        cpu_offload=True)
    hosts = {row.value("parallel"): row.result.host for row in table.rows}
    assert hosts["ddp"] is None and hosts["zero3"] == 2_471_512


def _args(**settings):
    defaults = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, bf16=False, fp16=False,
                    optim="adamw_torch")
    return SimpleNamespace(**{**defaults, **settings})


@pytest.mark.parametrize(("stage", "parallel"), [(1, "zero1"), (2, "zero2"), (3, "zero3")])
def test_training_arguments_read_a_deepspeed_stage(stage, parallel):
    read = knobs_from_training_arguments(_args(deepspeed={"zero_optimization": {"stage": stage}}), world_size=8)
    assert read.knobs["parallel"] == parallel and read.knobs["world_size"] == 8
    assert read.not_understood == ()
    assert any(f"deepspeed ZeRO stage {stage}: parallel={parallel!r} on 8 GPUs" in text for text in read.read)


def test_training_arguments_read_deepspeed_offload_from_a_json_file(tmp_path):
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                    "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": "auto"},
              "bf16": {"enabled": "auto"}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    read = knobs_from_training_arguments(_args(deepspeed=str(path), bf16=True), world_size=4)
    assert read.knobs["cpu_offload"] is True and read.knobs["parallel"] == "zero3"
    assert read.not_understood == ()  # "auto" buckets are DeepSpeed's defaults, said in the stage's note


def test_training_arguments_say_what_deepspeed_settings_are_not_estimated(tmp_path):
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                    "reduce_bucket_size": 200_000_000}, "fp16": {"enabled": True}}
    read = knobs_from_training_arguments(_args(deepspeed=config), world_size=2)
    said = "\n".join(read.not_understood)
    assert "only stage 3 with both on the CPU is estimated" in said
    assert "deepspeed reduce_bucket_size=200000000 (DeepSpeed's own buffers are not modelled)" in said
    assert "deepspeed fp16 enabled while the arguments say fp32" in said
    assert "cpu_offload" not in read.knobs
    missing = knobs_from_training_arguments(_args(deepspeed=str(tmp_path / "missing.json")), world_size=2)
    assert "not a readable JSON file" in missing.not_understood[0]


def test_training_arguments_read_fsdp_cpu_offload():
    read = knobs_from_training_arguments(_args(fsdp="full_shard offload auto_wrap", fsdp_config={}), world_size=4)
    assert read.knobs["cpu_offload"] is True and read.knobs["parallel"] == "fsdp" and read.not_understood == ()
    modern = knobs_from_training_arguments(_args(fsdp=True, fsdp_config={"cpu_offload": True}), world_size=4)
    assert modern.knobs["cpu_offload"] is True
    assert any("fsdp_config cpu_offload: cpu_offload=True" in text for text in modern.read)


def test_estimate_trainer_runs_a_deepspeed_stage_3_offload_configuration():
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
    arguments = dict(per_device_train_batch_size=16, gradient_accumulation_steps=1, optim="adamw_torch",
                     deepspeed=config)
    result = nbmem.estimate_trainer(arguments, model=build, batch=make, world_size=4)
    assert (result.parallel, result.world_size, result.host) == ("zero3", 4, 2_471_512)  # AdamW's state as Adam's
    assert any(note.startswith("from the training arguments: deepspeed ZeRO stage 3: parallel='zero3' on 4 GPUs")
               for note in result.notes)
    with pytest.raises(ValueError, match=r"deepspeed reduce_bucket_size=500000000\.0 \(DeepSpeed.s own buffers"):
        nbmem.estimate_trainer({**arguments, "deepspeed": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}},
                               model=build, batch=make, world_size=4)


def test_cpu_offload_with_frozen_layers_offloads_only_trained_gradients():
    def frozen_first():
        model = build()
        model[0].requires_grad_(False)  # as LoRA's base weights, or trainable=, leave layers frozen
        return model

    result = nbmem.estimate(frozen_first, make, parallel="zero3", cpu_offload=True, **OPTIONS)
    assert _after(result)["parameter"] == _after(result)["optimizer state"] == 0
    frozen = 4 * (64 * 128 + 64)  # rank 0's shard of the first Linear(128, 256): 64 rows and 64 biases, fp32
    assert result.host == 3 * 823_816 + 16 * 4 - 2 * frozen - 2 * 4  # no Adam state (nor step counters) for it


def test_sweeps_leave_compile_out_of_data_parallel_configurations_and_trainers_map_torch_compile():
    table = nbmem.sweep(build, make, batch_size=16, optimizer="adam", parallel=["single", "zero3"], world_size=[1, 4],
                        compile=[False, True], progress=False)
    configurations = {(row.value("parallel"), row.value("compile")) for row in table.rows}
    assert configurations == {("single", False), ("single", True), ("zero3", False)}
    read = knobs_from_training_arguments(_args(torch_compile=True))
    assert read.knobs["compile"] is True
    sharded = knobs_from_training_arguments(_args(torch_compile=True, deepspeed={"zero_optimization": {"stage": 3}}),
                                            world_size=4)
    assert "compile" not in sharded.knobs


def test_deepspeed_bf16_at_stage_3_is_fsdp_mixed_precision_not_autocast():
    config = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}
    read = knobs_from_training_arguments(_args(deepspeed=config, bf16=True), world_size=4)
    assert (read.knobs["precision"], read.knobs["mp_policy"]) == ("fp32", "bf16") and read.not_understood == ()
    stage1 = knobs_from_training_arguments(_args(deepspeed={"zero_optimization": {"stage": 1}}, bf16=True), world_size=4)
    assert "estimated as autocast over fp32 weights" in stage1.not_understood[0]
