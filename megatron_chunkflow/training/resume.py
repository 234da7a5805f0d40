"""What a checkpoint's settings say about this run, before anything is loaded: a contradiction
that cannot be honoured is refused naming the flag and the value saved (another model, model
class, TP/PP/VPP/CP layout, LoRA adapters, dtype or --seed), a change that can is said (the
learning-rate schedule, the global batch). training/checkpoint.py reads the settings and calls
compare_settings and resumed_model_class (before `chunkflow train` builds the model)."""

from __future__ import annotations


def resumed_model_class(model_class: str, saved: dict | None) -> str:
    """--model-class as given, but "auto" resuming from a checkpoint whose settings are `saved`
    is the checkpoint's class (its parameters are named by it: a GPTModel checkpoint of
    megatron-core 0.16 resumes as GPTModel on 0.19, whose own recommendation is HybridModel).
    Checkpoints saved before the setting existed are GPTModel's."""
    if model_class != "auto" or saved is None:
        return model_class
    return saved.get("model_class", "gpt")


CLASS_NAMES = {"gpt": "GPTModel", "hybrid": "HybridModel"}
SCHEDULE = {"lr": "--lr", "min_lr": "--min-lr", "lr_warmup_iters": "--lr-warmup-iters"}


def compare_settings(saved: dict, given: dict, iteration: int, root: str,
                     override_schedule: bool = False) -> list[str]:
    """The checkpoint's settings against this run's, before anything is loaded: ValueError for a
    contradiction that cannot be honoured (another model shape or TP/CP/PP/EP layout, another --seed,
    nothing left to train), else notes saying which value wins where they differ.
    `override_schedule`: --override-lr-schedule (this run's schedule wins)."""
    where = f"--load {root} (iteration {iteration})"
    if saved.get("shape") != given.get("shape"):
        diff = {k: (saved["shape"].get(k), v) for k, v in given["shape"].items()
                if saved["shape"].get(k) != v}
        raise ValueError(f"{where} holds another model: " + ", ".join(
            f"{k} {a} there, {b} here" for k, (a, b) in diff.items()))
    for key, flag, default in (("tp", "--tensor-model-parallel-size", 1),
                               ("pp", "--pipeline-model-parallel-size", 1),
                               ("vpp", "--num-virtual-stages-per-pipeline-rank", 1),
                               ("cp", "--context-parallel-size", 1),
                               ("ep", "--expert-model-parallel-size", 1),
                               ("etp", "--expert-tensor-parallel-size", None)):
        a, b = saved["parallel"].get(key, default), given["parallel"].get(key, default)
        if a != b:
            raise ValueError(f"{where} was saved with {flag} {a}; this run has {b}: the "
                             f"checkpoint's shards are laid out for {flag} {a} (give {a})")
    _compare_lora(saved.get("lora"), given.get("lora"), where)
    saved_class = saved.get("model_class", "gpt")
    if saved_class != given.get("model_class", "gpt"):
        raise ValueError(f"{where} holds a {CLASS_NAMES[saved_class]} checkpoint; this run builds "
                         f"a {CLASS_NAMES[given.get('model_class', 'gpt')]} (--model-class "
                         f"{given.get('model_class')}): give --model-class {saved_class} (or auto)")
    if saved.get("dtype", given.get("dtype")) != given.get("dtype"):
        raise ValueError(f"{where} was saved in {saved.get('dtype')}; this run trains in "
                         f"{given.get('dtype')} (--dtype): resume in {saved.get('dtype')}")
    if saved.get("seed") != given.get("seed"):
        raise ValueError(f"{where} was saved with --seed {saved.get('seed')}; --seed "
                         f"{given.get('seed')} would reshuffle the data in mid-epoch (give "
                         f"--seed {saved.get('seed')})")
    if iteration >= given["train_iters"]:
        raise ValueError(f"--train-iters {given['train_iters']}: {where} has already trained "
                         "that many steps; nothing to do (raise --train-iters)")
    notes = []
    changed = [f"{flag} {given['optimizer'][k]} (saved {saved['optimizer'][k]})"
               for k, flag in SCHEDULE.items() if saved["optimizer"][k] != given["optimizer"][k]]
    if saved["train_iters"] != given["train_iters"]:
        changed.append(f"--train-iters {given['train_iters']} (saved {saved['train_iters']})")
    if changed and override_schedule:
        notes.append(f"{where}: " + ", ".join(changed) + ": --override-lr-schedule: this run's "
                     f"learning-rate schedule, continued from step {iteration}")
    elif changed:
        notes.append(f"{where}: " + ", ".join(changed) + ": the checkpoint's learning-rate "
                     "schedule continues (Megatron-LM's default; --override-lr-schedule takes "
                     f"this run's), the run stops at --train-iters {given['train_iters']}")
    if saved["global_batch_size"] != given["global_batch_size"]:
        notes.append(f"{where}: --global-batch-size {given['global_batch_size']} (saved "
                     f"{saved['global_batch_size']}): the data continues after the "
                     "sequences already consumed")
    return notes


LORA_FLAGS = {"rank": "--lora-rank", "alpha": "--lora-alpha", "targets": "--lora-targets"}


def _compare_lora(saved: dict | None, given: dict | None, where: str) -> None:
    """The adapters decide which parameters and optimizer states the checkpoint holds: the run's
    --lora-* flags must be the checkpoint's (ValueError naming each that differs, and its saved
    value)."""
    if saved == given:
        return
    if saved is None:
        raise ValueError(f"{where} was saved without LoRA (full fine-tuning); this run has "
                         f"--lora-rank {given['rank']}: resume without --lora-*, or start a LoRA "
                         "run from its weights (--save-hf, then --load-hf)")
    flags = " ".join(f"{flag} {saved[k]:g}" if isinstance(saved[k], float) else
                     f"{flag} {saved[k]}" for k, flag in LORA_FLAGS.items())
    if given is None:
        raise ValueError(f"{where} was saved with LoRA adapters ({flags}); this run has none: "
                         f"give {flags}")
    differ = [f"{flag} {given[k]} (saved {saved[k]})" for k, flag in LORA_FLAGS.items()
              if saved.get(k) != given.get(k)]
    raise ValueError(f"{where} was saved with other LoRA adapters: " + ", ".join(differ)
                     + f"; give {flags}")
