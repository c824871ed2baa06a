"""verl's launch keys in this library's terms: a verl user's `key=value` overrides, as verl's example scripts write
them, become this library's (infra/cli.load_config says on the console what each became); a verl key with no
setting here is left out with the line saying why where it only places the run or sets its speed, and otherwise
stops the run with that sentence: never a "did you mean" guessed from the spelling.

    python ppo.py --config configs.yaml actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.rollout.n=5 \\
        actor_rollout_ref.actor.kl_loss_type=low_var_kl trainer.total_training_steps=100
    # verl key actor_rollout_ref.actor.optim.lr=1e-6 → actor.optim.lr=1e-6   … one line each
    python ppo.py --config verl_overrides.yaml    # a file in verl's layout (actor_rollout_ref: …) reads the same way

The tables are plain dicts: ALIASES (verl key → ours, the same meaning), IGNORED and NO_SETTING (verl key, or a
prefix ending in ".", → why there is none here), and VALUES, the value translations (verl's KL estimator names;
-1 = never). tests/test_peer_rewards.py holds the 56 keys verl's example scripts use most, each translated or told.
"""
import json
from typing import Callable, Optional

# verl key → this library's key (or keys) with the same meaning and units
ALIASES = {
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.use_remove_padding": "model.use_remove_padding",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "actor_rollout_ref.model.trust_remote_code": "model.trust_remote_code",
    "actor_rollout_ref.model.lora_rank": "model.lora_rank",
    "actor_rollout_ref.model.lora_alpha": "model.lora_alpha",
    "actor_rollout_ref.model.target_modules": "model.target_modules",
    "actor_rollout_ref.actor.optim.lr": "actor.optim.lr",
    "actor_rollout_ref.actor.optim.weight_decay": "actor.optim.weight_decay",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "actor.optim.warmup_ratio",
    "actor_rollout_ref.actor.optim.warmup_style": "actor.optim.lr_scheduler",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "actor.optim.lr_scheduler",
    "actor_rollout_ref.actor.optim.min_lr_ratio": "actor.optim.min_lr_ratio",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size_per_device",
    "actor_rollout_ref.actor.ppo_epochs": "actor.ppo_epochs",
    "actor_rollout_ref.actor.use_dynamic_bsz": "actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.max_token_len_per_device",
    "actor_rollout_ref.actor.clip_ratio": ("actor.clip_ratio_low", "actor.clip_ratio_high"),
    "actor_rollout_ref.actor.clip_ratio_low": "actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c": "actor.clip_ratio_c",
    "actor_rollout_ref.actor.entropy_coeff": "actor.entropy_coef",
    "actor_rollout_ref.actor.loss_agg_mode": "actor.loss_agg_mode",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "actor.policy_loss",
    "actor_rollout_ref.actor.grad_clip": "actor.max_grad_norm",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type": "algorithm.kl_loss_type",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_device",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_device",
    "actor_rollout_ref.rollout.name": "rollout.name",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.enforce_eager": "rollout.enforce_eager",
    "actor_rollout_ref.rollout.free_cache_engine": "rollout.free_cache_engine",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "rollout.val_temperature",
    "actor_rollout_ref.rollout.val_kwargs.n": "rollout.val_n",
    "actor_rollout_ref.rollout.multi_turn.enable": "rollout.multi_turn.enable",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "rollout.multi_turn.max_turns",
    "data.max_response_length": "rollout.max_response_length",
    "critic.model.path": "critic.model_path",
    "critic.ppo_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size_per_device",
    "critic.grad_clip": "critic.max_grad_norm",
    "trainer.critic_warmup": "critic.warmup_steps",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.default_local_dir": "trainer.output_dir",
    "reward_model.model.path": "reward.model_path",
    "reward_model.overlong_buffer.len": "reward.overlong_buffer_len",
    "reward_model.overlong_buffer.penalty_factor": "reward.overlong_penalty_factor",
    "custom_reward_function.path": "reward.function",
    "data.tokenizer": "model.tokenizer_path",
    "data.trust_remote_code": "model.trust_remote_code",
    "data.seed": "trainer.seed",
    "critic.optim.lr_warmup_steps_ratio": "critic.optim.warmup_ratio",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler",
    "critic.optim.lr_scheduler_type": "critic.optim.lr_scheduler",
    "critic.optim.clip_grad": "critic.max_grad_norm",
    "algorithm.rollout_correction.rollout_is": "algorithm.rollout_is",
    "algorithm.rollout_correction.rollout_is_threshold": "algorithm.rollout_is_threshold",
    "algorithm.rollout_correction.rollout_rs": "algorithm.rollout_rs",
    "algorithm.rollout_correction.rollout_rs_threshold": "algorithm.rollout_rs_threshold",
    "trainer.resume_from_path": "trainer.resume",
    "trainer.max_actor_ckpt_to_keep": "trainer.keep_checkpoints",
    "trainer.max_critic_ckpt_to_keep": "trainer.keep_checkpoints",
    "trainer.log_val_generations": "trainer.num_samples_to_show",
}

OFFLOAD = ("offloading is the FSDP plugin's here (fsdp_offload_params in accelerate_configs/fsdp2.yaml: parameters, "
           "gradients and optimiser state together)")
PROCESSES = "the processes are accelerate's (accelerate launch --num_processes N --num_machines M, or slurm/)"
NO_MEGATRON = "there is no Megatron backend, FSDP2 through accelerate only"
LOG_PROB = "the log-prob passes follow actor.use_dynamic_bsz and actor.max_token_len_per_device"
# verl key (or a prefix ending in ".") → why this library has no such setting, for keys that place a run or set
# its speed, not what it computes: said on the console and left out, so that a verl launch line runs
IGNORED = {
    "defaults": "Hydra's composition list: one file is read here, with its overrides",
    "hydra.": "Hydra's own settings: there is no Hydra here",
    "trainer.n_gpus_per_node": PROCESSES,
    "trainer.nnodes": PROCESSES,
    "trainer.use_legacy_worker_impl": "there are no Ray workers here, legacy or new",
    "trainer.balance_batch": "batches are not reordered across processes here",
    "data.return_raw_chat": "every row keeps its stored prompt, messages and all",
    "actor_rollout_ref.actor.fsdp_config.": OFFLOAD,
    "actor_rollout_ref.ref.fsdp_config.": OFFLOAD,
    "critic.model.fsdp_config.": OFFLOAD,
    "actor_rollout_ref.actor.megatron.": NO_MEGATRON,
    "actor_rollout_ref.ref.megatron.": NO_MEGATRON,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "there is no sequence parallelism here",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "vLLM runs one engine per process here, or as its own "
                                                            "server (rollout.name=server, rollout.server.devices)",
    "actor_rollout_ref.rollout.enable_chunked_prefill": "vLLM's own default is used",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "vLLM's own default is used",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": LOG_PROB,
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": LOG_PROB,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": LOG_PROB,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": LOG_PROB,
    "actor_rollout_ref.actor.use_torch_compile": "the policy is not compiled here",
    "critic.model.use_remove_padding": "the critic follows model.use_remove_padding",
    "critic.model.enable_gradient_checkpointing": "the critic follows model.gradient_checkpointing",
    "critic.use_dynamic_bsz": "the critic follows actor.use_dynamic_bsz",
    "critic.ppo_max_token_len_per_gpu": "the critic follows actor.max_token_len_per_device",
    "critic.forward_max_token_len_per_gpu": "the critic follows actor.max_token_len_per_device",
    "critic.forward_micro_batch_size_per_gpu": "the critic's no-grad pass follows critic.ppo_micro_batch_size_per_device",
    "critic.ulysses_sequence_parallel_size": "there is no sequence parallelism here",
    "critic.strategy": "FSDP2 through accelerate is the only strategy",
    "critic.checkpoint.": "a checkpoint holds everything a resume needs",
    "critic.profiler.": "there is no profiler setting here",
    "data.dataloader_num_workers": "prompts are read in the training process",
    "data.use_shm": "models are read from their folders",
    "data.val_batch_size": "validation generates its rows in batches of data.train_batch_size",
    "data.validation_shuffle": "validation reads its rows in order",
    "data.filter_overlong_prompts_workers": "the prompts are measured in the training process",
    "trainer.del_local_ckpt_after_load": "checkpoints are kept by trainer.keep_checkpoints",
    "trainer.ray_wait_register_center_timeout": "there is no Ray here",
    "trainer.device": "the device is the one accelerate gives each process",
    "trainer.esi_redundant_time": "SIGTERM (Slurm's preemption) saves a checkpoint at the next micro-batch",
    "ray_kwargs.": "there is no Ray here",
    "global_profiler.": "there is no profiler setting here",
    "transfer_queue.": "there is no transfer queue here",
}
# verl key (or a prefix ending in ".") → why this library has no such setting, for keys that change what a run
# computes: refused with that sentence, since leaving them out would train something other than what was asked
NO_SETTING = {
    "trainer.total_epochs": "this library counts training in steps, and data.train_files could not be read to count "
                            "them: set trainer.total_steps = epochs × train rows ÷ data.train_batch_size",
    "trainer.resume_mode": "trainer.resume takes auto, off or a checkpoint path",
    "data.prompt_key": "the prompt column is always `prompt` (verl's layout or a string)",
    "data.reward_fn_key": "rows are routed to their rule by the data_source column, as verl's default does",
    "actor_rollout_ref.rollout.mode": "the rollout runs in the training loop, or ahead of it with rollout.steps_ahead",
    "actor_rollout_ref.rollout.val_kwargs.top_p": "validation samples with rollout.top_p and rollout.val_temperature",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "validation is greedy when rollout.val_temperature=0",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "tools are named by rollout.multi_turn.tools "
                                                             "(agents/tools.py), not by verl's tool YAML",
    "reward_model.enable": "name the scorers in reward.sources (model for a reward model, with reward.model_path)",
    "reward_model.reward_manager": "every reward manager's work is reward.sources' here (DAPO's overlong buffer: "
                                   "reward.overlong_buffer_len)",
    "custom_reward_function.name": "give custom_reward_function.path too, or reward.function=path/to/file.py:name",
    "reward_model.model.": "a reward model is reward.sources=[model] with reward.model_path",
    "reward_model.micro_batch_size_per_gpu": "a reward model's batch is reward.micro_batch_size",
    "reward_manager.": "every reward manager's work is reward.sources' here",
    "data.train_max_samples": "the training rows are all of data.train_files",
    "data.image_key": "there are no images or videos here: text only",
    "data.video_key": "there are no images or videos here: text only",
    "data.custom_cls.": "rows are read by data.py from verl's parquet layout or this library's",
    "data.sampler.": "prompts are drawn in a shuffled order each epoch (data.shuffle)",
    "data.datagen.": "data is prepared beforehand (tools/prepare_data.py)",
    "data.tool_config_path": "tools are named by rollout.multi_turn.tools",
    "critic.ppo_mini_batch_size": "the critic steps with the actor's mini-batches (actor.ppo_mini_batch_size)",
    "critic.ppo_epochs": "the critic trains for the actor's epochs (actor.ppo_epochs)",
    "critic.loss_agg_mode": "the value loss is a token mean",
    "critic.enable": "the critic is on exactly when algorithm.adv_estimator=gae",
    "algorithm.use_pf_ppo": "there is no policy-filtration PPO here",
    "algorithm.pf_ppo.": "there is no policy-filtration PPO here",
    "algorithm.rollout_correction.": "this library's rollout correction is algorithm.rollout_is and rollout_rs",
    "trainer.val_only": "validation runs within training (trainer.val_before_train, trainer.test_freq)",
    "trainer.default_hdfs_dir": "checkpoints are written to trainer.output_dir only",
    "trainer.rollout_data_dir": "samples are logged in metrics.jsonl's tables (trainer.sample_freq)",
    "trainer.validation_data_dir": "samples are logged in metrics.jsonl's tables (trainer.sample_freq)",
}

VERL_ONLY = ("actor_rollout_ref.", "custom_reward_function.", "critic.model.")  # sections that are not ours

# verl's KL estimator names (core_algos.kl_penalty) → kl.ESTIMATORS'; low_var_kl is k3, without verl's ±10 clamp
ESTIMATOR_NAMES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3", "abs": "abs"}
ESTIMATOR_NOT_HERE = {"full": "the full-vocabulary KL needs every token's logits, which are not kept here",
                      "k1+": "verl's straight-through variants (k_n's value, k2's gradient) are not built in",
                      "k2+": "verl's straight-through variants (k_n's value, k2's gradient) are not built in",
                      "k3+": "verl's straight-through variants (k_n's value, k2's gradient) are not built in"}


def estimator(key: str, value: str) -> str:
    """A KL estimator's name in verl's spelling (kl, mse, low_var_kl, abs, k1–k3) → kl.ESTIMATORS'; verl's others
    are a ValueError saying why; any other name is left for the stage's check (ppo.check_names) to refuse."""
    if value in ESTIMATOR_NOT_HERE:
        raise ValueError(f"{key}={value}: {ESTIMATOR_NOT_HERE[value]}")
    return ESTIMATOR_NAMES.get(value, value)


def correction(key: str, value: str) -> str:
    """verl's rollout_correction names (rollout_is: token, sequence; rollout_rs: token_k1, seq_sum_k1, seq_mean_k1;
    null = off) → algorithm.rollout_is's and rollout_rs's."""
    names = {"null": "off", "none": "off", "token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "sequence_mean"}
    return names.get(str(value).strip().lower(), value)


def never_as_zero(key: str, value: str) -> str:
    """verl's -1 (never) for a frequency → 0, which here means only at the end of the run."""
    return "0" if value.strip() == "-1" else value


# this library's key → how a verl value of it is written here (applied to verl's keys and ours alike)
VALUES: dict[str, Callable[[str, str], str]] = {
    "algorithm.kl_loss_type": estimator, "algorithm.kl_penalty": estimator,
    "algorithm.teacher.kl_estimator": estimator, "trainer.save_freq": never_as_zero, "trainer.test_freq": never_as_zero,
    "algorithm.rollout_is": correction, "algorithm.rollout_rs": correction,
}


def why_not(key: str, table: dict) -> Optional[str]:
    """Why verl's `key` has no setting here, from `table` (IGNORED or NO_SETTING) by the key or its longest prefix;
    None where the table does not hold it."""
    prefixes = [p for p in table if key == p or (p.endswith(".") and key.startswith(p))]
    return table[max(prefixes, key=len)] if prefixes else None


def translate_all(items: list[str], tree: dict) -> tuple[list[str], list[str]]:
    """A command line's key=value items → this library's, and the console lines saying what each verl one became;
    ValueError with the sentence why for a verl key with no setting here. Four of verl's keys need more than a table:
    data.filter_overlong_prompts=True is data.truncation=filter (whatever data.truncation says, as in verl),
    custom_reward_function.name joins its .path, and trainer.total_epochs becomes trainer.total_steps, counted from
    data.train_files' rows and data.train_batch_size (given here, else in the config file `tree`, else the default);
    data.prompt_key=prompt is what this library reads anyway."""
    given = dict(item.split("=", 1) for item in items if "=" in item)
    given = {k.strip().removeprefix("+"): v.strip() for k, v in given.items()}
    out, lines = [], []
    for item in items:
        key, value = (part.strip() for part in item.split("=", 1)) if "=" in item else (item, None)
        key = key.removeprefix("+")
        if value is None or (key == "data.truncation" and truthy(given.get("data.filter_overlong_prompts"))):
            out += [item] if value is None else []
        elif key == "data.filter_overlong_prompts":
            out += ["data.truncation=filter"] if truthy(value) else []
            lines.append(f"verl key {key}={value} → " + ("data.truncation=filter" if truthy(value) else "(nothing)"))
        elif key == "data.prompt_key" and value.strip("'\"") == "prompt":
            lines.append(f"verl key {key}={value} is left out: the prompt column is `prompt` here too")
        elif key == "custom_reward_function.name" and "custom_reward_function.path" in given:
            continue
        elif key == "custom_reward_function.path" and "custom_reward_function.name" in given:
            out.append(f"reward.function={value}:{given['custom_reward_function.name']}")
            lines.append(f"verl keys custom_reward_function.path/name → {out[-1]}")
        elif key == "trainer.total_epochs" and steps_of(value, given, tree) is not None:
            out.append(f"trainer.total_steps={steps_of(value, given, tree)}")
            lines.append(f"verl key {key}={value} → {out[-1]} (epochs × train rows ÷ data.train_batch_size)")
        else:
            pairs, line = translate(key, value)
            out += [f"{k}={v}" for k, v in pairs]
            lines += [line] if line else []
    return out, lines


def tree_items(tree: dict, prefix: str = "") -> list[str]:
    """A verl YAML file (it has an actor_rollout_ref section) as the key=value items of a launch line, so that
    translate_all reads it as it reads verl's command line; lists and mappings as YAML flow text."""
    items = []
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "defaults":
            items += tree_items(value, f"{prefix}{key}.")
        elif not isinstance(value, dict):
            text = json.dumps(value) if isinstance(value, (list, bool)) or value is None else str(value)
            items.append(f"{prefix}{key}={text}")
    return items


def truthy(value: Optional[str]) -> bool:
    return str(value).strip().strip("'\"").lower() == "true"


def steps_of(epochs: str, given: dict, tree: dict) -> Optional[int]:
    """trainer.total_epochs as steps, as verl counts them (its loader drops the last short batch): epochs ×
    ⌊rows ÷ data.train_batch_size⌋, at least 1; None where data.train_files cannot be read."""
    import pyarrow.parquet as pq
    from infra.config import DataConfig
    section = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    path = given.get("data.train_files", section.get("train_files", DataConfig.train_files))
    batch = given.get("data.train_batch_size", section.get("train_batch_size", DataConfig.train_batch_size))
    try:
        rows = pq.ParquetFile(str(path).strip("'\"")).metadata.num_rows
        return max(1, int(float(epochs)) * (rows // int(batch)))
    except (OSError, ValueError, ZeroDivisionError):  # a missing or unreadable file (ArrowInvalid is a ValueError)
        return None


def translate(key: str, value: str) -> tuple[list[tuple[str, str]], Optional[str]]:
    """One override → ([(our key, value), …], the console line saying what it became or None where nothing changed).
    A verl key that only places the run or sets its speed (IGNORED) is left out, the line saying why; ValueError with
    the sentence why for any other verl key with no setting here, or a verl value with none (KL "full")."""
    key = key.removeprefix("+")  # Hydra's "add a key"
    if key.endswith("._target_"):
        return [], f"verl key {key}={value} is left out: Hydra's class to build, which this library does not use"
    if key not in ALIASES and why_not(key, IGNORED) is not None:  # a prefix's sentence, where no alias holds the key
        return [], f"verl key {key}={value} is left out: {why_not(key, IGNORED)}"
    if key not in ALIASES and why_not(key, NO_SETTING) is not None:
        raise ValueError(f"verl's `{key}` has no setting here: {why_not(key, NO_SETTING)}")
    if key.startswith(VERL_ONLY) and key not in ALIASES:  # a guess from its spelling would name a wrong key
        raise ValueError(f"verl's `{key}` is not one this library translates (infra/verl_keys.py lists those it does, "
                         f"and why the others have no setting here); see `--help` for this library's keys")
    ours = ALIASES.get(key, key)
    pairs = [(k, VALUES[k](key, value) if k in VALUES else value) for k in ((ours,) if isinstance(ours, str) else ours)]
    changed = key in ALIASES or any(v != value for _, v in pairs)
    line = f"verl key {key}={value} → {' '.join(f'{k}={v}' for k, v in pairs)}" if changed else None
    return pairs, line
