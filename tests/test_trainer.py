"""Hugging Face's Trainer (issue 24): estimates read from its arguments, and a callback that records each step.

Tiny GPT-2s built from a config (nothing downloaded), trained for real on the
CPU for a few steps. transformers is an optional dependency (nbmem[zoo]).
"""

from __future__ import annotations

import pytest
import torch

import nbmem
from _zoo import need

need("transformers", env="NBMEM_REQUIRE_ZOO")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator  # noqa: E402

from nbmem.whatif.training_arguments import knobs_from_training_arguments  # noqa: E402

CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)
DATA = [{"input_ids": torch.randint(0, 128, (32,)), "labels": torch.randint(0, 128, (32,))} for _ in range(8)]


def arguments(tmp_path, **options):
    options = {"per_device_train_batch_size": 4, "report_to": [], "use_cpu": True, "save_strategy": "no",
               "logging_strategy": "no", **options}
    return TrainingArguments(str(tmp_path / "out"), **options)


def build():
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG)


def tokens(size):
    return {"input_ids": torch.randint(0, 128, (size, 32)), "labels": torch.randint(0, 128, (size, 32))}


def test_the_arguments_become_the_estimates_knobs(tmp_path):
    args = arguments(tmp_path, gradient_accumulation_steps=2, gradient_checkpointing=True, optim="adamw_torch_fused")
    read = knobs_from_training_arguments(args)
    assert read.knobs == {"batch_size": 4, "accumulation": 2, "hold_output": False, "precision": "fp32",
                          "checkpointing": True, "optimizer": "adamw-fused"}
    assert read.not_understood == ()
    trainer = Trainer(model=build(), args=args, train_dataset=DATA, data_collator=default_data_collator)
    # the Trainer's model and its dataset through its collator: the same figures as the knobs given by hand
    from_trainer = nbmem.estimate_trainer(trainer)
    by_hand = nbmem.estimate(build, tokens, batch_size=4, accumulation=2, checkpointing=True, optimizer="adamw-fused",
                             hold_output=False)
    assert (from_trainer.first_step, from_trainer.steady) == (by_hand.first_step, by_hand.steady)
    assert any(note.startswith("from the training arguments: per_device_train_batch_size=4") for note in from_trainer.notes)
    from_arguments = nbmem.estimate_trainer(args, model=build, batch=tokens)
    assert from_arguments.steady == by_hand.steady


def test_settings_nbmem_does_not_estimate_are_named_never_ignored(tmp_path):
    args = arguments(tmp_path, optim="galore_adamw", fsdp=True,
                     fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]})
    read = knobs_from_training_arguments(args)
    assert read.knobs["parallel"] == "fsdp" and read.knobs["block"] == "GPT2Block"
    assert any(text.startswith("optim='galore_adamw'") for text in read.not_understood)
    with pytest.raises(ValueError, match=r"optim='galore_adamw'.*world_size="):
        nbmem.estimate_trainer(args, model=build, batch=tokens)
    # the knobs that stand for them, given: estimated, FSDP's units the named block
    result = nbmem.estimate_trainer(args, model=build, batch=tokens, optimizer="adamw", world_size=2)
    assert any(note.startswith("FSDP units: each GPT2Block (2)") for note in result.notes)
    lenient = nbmem.estimate_trainer(args, model=build, batch=tokens, world_size=2, strict=False)
    assert any(note.startswith("not estimated: optim='galore_adamw'") for note in lenient.notes)
    # ZeRO-2-like sharding (transformers 4's shard_grad_op, 5's reshard_after_forward=False) and offload
    args = arguments(tmp_path, fsdp=True, fsdp_config={"reshard_after_forward": False, "cpu_offload": True})
    read = knobs_from_training_arguments(args, world_size=4)
    assert (read.knobs["parallel"], read.knobs["world_size"]) == ("fsdp-no-reshard", 4)
    assert read.not_understood == () and read.knobs["cpu_offload"] is True


def test_the_trainers_step_drops_the_output_before_backward_and_its_own_optimizer_is_used(tmp_path):
    """Trainer.training_step: compute_loss returns the loss alone, so the logits are not alive in backward, as
    nbmem's built-in step holds them (hold_output=False); a Trainer given its own optimizer is estimated with it."""
    args = arguments(tmp_path, optim="adamw_torch")
    model = build()
    trainer = Trainer(model=model, args=args, train_dataset=DATA, data_collator=default_data_collator,
                      optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    result = nbmem.estimate_trainer(trainer)
    assert result.step.startswith("nbmem's built-in: output dropped once the loss is made")
    assert result.breakdown.category("optimizer state") == 0  # SGD without momentum keeps none
    assert "from the training arguments: the Trainer's optimizer: SGD with its defaults (foreach=True, as CUDA " \
        "defaults)" in result.notes
    by_hand = nbmem.estimate(build, tokens, batch_size=4, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, foreach=True),
                             hold_output=False)
    assert (result.first_step, result.steady) == (by_hand.first_step, by_hand.steady)


def test_the_optimizer_a_trainer_built_from_optim_is_read_as_optim(tmp_path):
    """After train() the Trainer keeps the optimizer it built (bitsandbytes' 8-bit AdamW here): read as optim= says,
    not rebuilt from its class (which made it 32-bit, a review); another library's optimizer given to the Trainer
    is named."""
    bnb = pytest.importorskip("bitsandbytes")

    args = arguments(tmp_path, optim="adamw_bnb_8bit", max_steps=1)
    trainer = Trainer(model=build(), args=args, train_dataset=DATA, data_collator=default_data_collator)
    before = nbmem.estimate_trainer(trainer)
    try:
        trainer.train()
    finally:
        # the Trainer registers the embeddings with bitsandbytes' process-wide GlobalOptimManager (32-bit state for
        # them), which keeps the module alive for the rest of the process: later tests' baselines would count it
        bnb.optim.GlobalOptimManager.get_instance().initialize()
    after = nbmem.estimate_trainer(trainer)
    assert after.breakdown.category("optimizer state") == before.breakdown.category("optimizer state")
    assert "from the training arguments: the Trainer's optimizer: AdamW, as optim='adamw_bnb_8bit' builds it" \
        in after.notes
    model = build()
    given = Trainer(model=model, args=arguments(tmp_path), train_dataset=DATA, data_collator=default_data_collator,
                    optimizers=(bnb.optim.AdamW(model.parameters(), optim_bits=8), None))
    with pytest.raises(ValueError, match=r"the Trainer's own optimizer bitsandbytes\.optim\.adamw\.AdamW"):
        nbmem.estimate_trainer(given)


def test_settings_that_change_the_trainers_memory_are_named(tmp_path):
    """Checkpointing every other layer, reentrant or offloaded; label smoothing (the Trainer's own loss over the
    logits); a compile mode or backend other than inductor's default; FSDP1, a wrap policy other than per block,
    an fsdp_config key nbmem doesn't know; DeepSpeed's own optimizer: each named, none ignored."""
    read = knobs_from_training_arguments(arguments(
        tmp_path, gradient_checkpointing=True, label_smoothing_factor=0.1,
        gradient_checkpointing_kwargs={"every_n_layers": 2, "use_reentrant": True, "preserve_rng_state": False},
        torch_compile=True, torch_compile_mode="reduce-overhead"))
    assert [text.split(" (")[0] for text in read.not_understood] == [
        "activation checkpointing every_n_layers=2", "activation checkpointing use_reentrant=True",
        "label_smoothing_factor=0.1", "torch_compile_mode='reduce-overhead'"]
    assert any("(its kwargs {'preserve_rng_state': False} change no memory nbmem counts)" in text for text in read.read)
    from types import SimpleNamespace

    read = knobs_from_training_arguments(SimpleNamespace(
        fsdp=True, fsdp_config={"reshard_after_forward": "false", "version": 1, "auto_wrap_policy": "NO_WRAP",
                                "sharding_group_size": 8}), world_size=2)
    assert read.knobs["parallel"] == "fsdp-no-reshard"  # "false" is false, as transformers' str_to_bool reads it
    assert [text.split(" (")[0] for text in read.not_understood] == [
        "fsdp_config version=1", "fsdp_config auto_wrap_policy='NO_WRAP'", "fsdp_config sharding_group_size=8"]
    read = knobs_from_training_arguments(SimpleNamespace(
        deepspeed={"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}), world_size=2)
    assert read.not_understood[0].startswith("deepspeed optimizer 'AdamW'")


def test_bad_arguments_say_how_to_fix_them(tmp_path):
    """A dict's misspelt key names the right one, a dict without a batch size takes the Trainer's default (8), the
    class instead of an instance and an iterable dataset say what to pass (a review)."""
    with pytest.raises(TypeError, match=r"'gradient_acumulation_steps' \(did you mean 'gradient_accumulation_steps'\?\)"):
        nbmem.estimate_trainer({"gradient_acumulation_steps": 8}, model=build, batch=tokens)
    assert nbmem.estimate_trainer({"gradient_accumulation_steps": 2}, model=build, batch=tokens).batch_size == 8
    with pytest.raises(TypeError, match=r"pass TrainingArguments\(\.\.\.\)"):
        nbmem.estimate_trainer(TrainingArguments, model=build, batch=tokens)

    class Streamed(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(DATA)

    trainer = Trainer(model=build(), args=arguments(tmp_path, max_steps=1), train_dataset=Streamed(),
                      data_collator=default_data_collator)
    with pytest.raises(ValueError, match=r"can't be indexed \(an iterable dataset\): pass batch="):
        nbmem.estimate_trainer(trainer)


def test_the_callback_records_each_step(tmp_path):
    callback = nbmem.MemoryCallback(backend="tracked", device="cpu", quiet=True)
    args = arguments(tmp_path, max_steps=3, optim="adamw_torch", max_grad_norm=0.0)
    trainer = Trainer(model=build(), args=args, train_dataset=DATA, data_collator=default_data_collator,
                      callbacks=[callback])
    trainer.train()
    steps = list(callback.history)
    assert [result.label for result in steps] == ["training step 1", "training step 2", "training step 3"]
    assert all(result.mode == "tracked" and result.device == "cpu" for result in steps)
    # the first step makes AdamW's state and keeps it: two moments per parameter (GPT-2 ties its head to the
    # embedding, so each is counted once; its step counts are CPU tensors on a GPU, outside the figures); and two
    # scalars the Trainer keeps for its log, the step's loss and the gradients' norm (512 B each)
    parameters = list(trainer.model.parameters())
    state = sum(2 * (-(-p.numel() * 4 // 512) * 512) for p in parameters)
    assert steps[0].retained == state + 2 * 512
    # from then on nothing new lives on but those two scalars, replaced each step (and at times dropped between steps)
    assert all(abs(result.retained) <= 2 * 512 for result in steps[1:])
    assert steps[1].peak_allocated > steps[0].peak_allocated - steps[0].retained  # the state is there at each peak
    most = max(steps, key=lambda result: result.peak_allocated)  # the first of equals, as max gives it
    highest = max(steps, key=lambda result: result.peak)
    alike = sum(result.peak == highest.peak for result in steps) - 1
    assert callback.summary() == (
        f"gpumem: 3 training steps tracked on cpu; the highest peak, {nbmem.format_bytes(most.peak_allocated)} "
        f"allocated, at {most.label}; the largest rise above a step's start, {nbmem.format_bytes(highest.peak)} "
        f"allocated, at {highest.label}"
        + (f" (as in {alike} more)" if alike else "") + "; callback.history has each")
    assert most.label != "training step 1"  # the first step's peak comes before its optimizer state is all there


def test_an_interrupted_training_leaves_nothing_installed(tmp_path):
    from nbmem.tracking.tracker import default_tracker

    class Stop(Exception):
        pass

    class Interrupt(nbmem.MemoryCallback):
        def on_step_begin(self, *args, **kwargs):
            super().on_step_begin(*args, **kwargs)
            raise Stop  # training stops mid-step, as a Ctrl-C would: on_step_end never comes

    callback = Interrupt(backend="tracked", device="cpu", quiet=True)
    trainer = Trainer(model=build(), args=arguments(tmp_path, max_steps=2), train_dataset=DATA,
                      data_collator=default_data_collator, callbacks=[callback])
    with pytest.raises(Stop):
        trainer.train()
    assert default_tracker("cpu").active  # the step's scope is still open here
    callback.close()  # what the end of a notebook cell does by itself
    assert not default_tracker("cpu").active and len(callback.history) == 0


def test_in_a_notebook_the_cells_end_closes_an_interrupted_step(shell, tmp_path):
    from nbmem.tracking.tracker import default_tracker

    class Interrupt(nbmem.MemoryCallback):
        def on_step_begin(self, *args, **kwargs):
            super().on_step_begin(*args, **kwargs)
            raise KeyboardInterrupt  # Ctrl-C inside the step

    callback = Interrupt(backend="tracked", device="cpu", quiet=True)
    trainer = Trainer(model=build(), args=arguments(tmp_path, max_steps=2), train_dataset=DATA,
                      data_collator=default_data_collator, callbacks=[callback])
    shell.push({"trainer": trainer})
    result = shell.run_cell("trainer.train()")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert not default_tracker("cpu").active  # closed when the cell ended
    assert callback.meter._cell_ended not in shell.events.callbacks["post_run_cell"]  # and nothing of it left behind
    shell.run_cell("del trainer")


def test_a_deepspeed_configuration_or_a_batch_where_a_function_goes_says_what_to_pass(tmp_path):
    """A newcomer's walk through the docs: a DeepSpeed configuration passed as the arguments, and a batch passed
    where the function making one goes, failed with bare TypeErrors."""
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    with pytest.raises(TypeError, match=r"They look like a DeepSpeed configuration: pass it as TrainingArguments' "
                                        r"deepspeed=, e.g. \{'deepspeed': config"):
        nbmem.estimate_trainer(config, model=build, batch=tokens)
    with pytest.raises(TypeError, match=r"batch must be a function that takes a batch size .* got a dict"):
        nbmem.estimate_trainer(arguments(tmp_path), model=build, batch=tokens(4))
    with pytest.raises(TypeError, match=r"got a Tensor: nbmem makes a batch of each size it tries"):
        nbmem.estimate(build, torch.randint(0, 128, (4, 32)), batch_size=4)

