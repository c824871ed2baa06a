"""The checks of a config that need more than one key, before any model loads: ppo.py's derived batch sizes
(check_sizes) and the settings that cannot work together (check_combinations); validation.check_best_metric
checks trainer.best_metric; and a model folder, that it holds what loads and nothing that would run code
(check_model_path). One key's type and range are infra/cli.py's."""
import json
import os
import re
from dataclasses import dataclass

from infra.config import ConfigError


def exact_div(a: int, b: int, what: str) -> int:
    """a / b as an int, or a sentence saying which batch size does not divide."""
    if b <= 0 or a % b != 0:
        raise ConfigError(f"{what}: {a} is not divisible by {b}")
    return a // b


@dataclass(frozen=True)
class Sizes:
    """Batch sizes derived from the config, computed and checked once (check_sizes); per process unless said."""
    prompts: int  # prompts per step
    batch: int  # B: sequences per step (prompts × rollout.n)
    num_mini: int  # mini-batches (optimiser steps) per PPO epoch, the same on every process
    mini: int  # sequences per mini-batch
    actor_micro: int  # sequences per actor forward/backward (gradient accumulation fills the mini-batch)
    critic_micro: int  # sequences per critic forward/backward
    max_tokens: int  # actor.use_dynamic_bsz: tokens per micro-batch (actor.max_token_len_per_device); 0: by count


def check_sizes(cfg, world: int, num_rows: int) -> Sizes:
    """ppo.py's derived batch sizes; one that does not divide fails here with a sentence, before any model loads."""
    d, a, n = cfg.data, cfg.actor, cfg.rollout.n
    if num_rows < d.train_batch_size:
        raise ConfigError(f"data.train_files has {num_rows} usable prompts, fewer than "
                          f"data.train_batch_size={d.train_batch_size}")
    prompts = exact_div(d.train_batch_size, world, "data.train_batch_size across processes")
    num_mini = exact_div(d.train_batch_size, a.ppo_mini_batch_size,
                         "data.train_batch_size by actor.ppo_mini_batch_size (prompts per mini-batch)")
    mini = exact_div(a.ppo_mini_batch_size * n, world, "actor.ppo_mini_batch_size × rollout.n across processes")
    actor_micro = min(a.ppo_micro_batch_size_per_device, mini)
    exact_div(mini, actor_micro, "sequences per mini-batch on one process by actor.ppo_micro_batch_size_per_device")
    critic_micro = min(cfg.critic.ppo_micro_batch_size_per_device, mini)
    exact_div(mini, critic_micro, "sequences per mini-batch on one process by critic.ppo_micro_batch_size_per_device")
    max_tokens = a.max_token_len_per_device if a.use_dynamic_bsz else 0
    return Sizes(prompts, prompts * n, num_mini, mini, actor_micro, critic_micro, max_tokens)


def check_combinations(cfg) -> None:
    """ppo.py's settings that cannot work together fail here, before anything loads, one sentence each."""
    alg, ro, t = cfg.algorithm, cfg.rollout, cfg.trainer  # the rollout kind's own checks: rollout.check_rollout
    low, high = rejection_band(alg)
    if low >= high:
        lower = (f"algorithm.rollout_rs_threshold_lower={low:g}" if alg.rollout_rs_threshold_lower else
                 f"the lower bound 1 / algorithm.rollout_rs_threshold = {low:g} (rollout_rs_threshold_lower=0)")
        raise ConfigError(f"{lower} is not below algorithm.rollout_rs_threshold={high:g}, so rejection would keep "
                          f"nothing: set rollout_rs_threshold above 1 (it is the upper bound of ρ), or a "
                          f"rollout_rs_threshold_lower below it")
    if alg.filter_groups.enable and ro.n < 2:
        raise ConfigError(f"algorithm.filter_groups.enable keeps the prompts whose samples score differently: set "
                          f"rollout.n ≥ 2 (it is {ro.n})")
    if ro.val_n > 1 and ro.val_temperature == 0:
        raise ConfigError(f"rollout.val_n={ro.val_n} greedy samples (rollout.val_temperature=0) are one answer "
                          f"{ro.val_n} times: set rollout.val_temperature > 0, e.g. 1.0, or rollout.val_n=1")
    if cfg.reward.overlong_buffer_len > ro.max_response_length:
        raise ConfigError(f"reward.overlong_buffer_len={cfg.reward.overlong_buffer_len} is longer than "
                          f"rollout.max_response_length={ro.max_response_length}: make it at most that")
    names = [spec.rpartition(":")[2] for spec in ro.multi_turn.tools]
    twice = sorted({name for name in names if names.count(name) > 1})
    if ro.multi_turn.enable and twice:
        raise ConfigError(f"rollout.multi_turn.tools: two tools are named {twice[0]!r} (" + ", ".join(
            spec for spec in ro.multi_turn.tools if spec.rpartition(":")[2] == twice[0]) + "), and the model calls a "
            "tool by its function's name: rename one")
    if t.best_metric and not cfg.data.val_files:
        raise ConfigError(f"trainer.best_metric={t.best_metric} needs validation: set data.val_files")
    if t.rollback_tolerance is not None and not t.best_metric:
        raise ConfigError("trainer.rollback_tolerance rolls back to the best checkpoint: set trainer.best_metric too "
                          "(e.g. val/score/mean)")
    if t.rollback_tolerance is not None and not t.test_freq:
        raise ConfigError("trainer.rollback_tolerance acts at a validation during training, and trainer.test_freq=0 "
                          "validates only after the last step: set trainer.test_freq > 0")
    if t.rollback_baseline == "pretrained" and (t.rollback_tolerance is None or not t.val_before_train):
        raise ConfigError("trainer.rollback_baseline=pretrained compares each validation with the one before "
                          "training: set trainer.rollback_tolerance and trainer.val_before_train=true")
    sources = reward_sources(cfg.reward)
    if all(weight == 0 for _, weight in sources) and not (ro.multi_turn.env or alg.teacher.path):
        raise ConfigError(f"reward.weights={[w for _, w in sources]} weigh every one of reward.sources="
                          f"{[name for name, _ in sources]} by 0, so every score is 0 and training would learn "
                          f"nothing; give a source a weight other than 0 (only an environment's own rewards, "
                          f"rollout.multi_turn.env, or a teacher, algorithm.teacher.path, can stand alone)")


def lower_is_better(t) -> bool:
    """Whether trainer.best_metric improves downwards: trainer.best_metric_mode, where auto means lower for a
    perplexity or a loss (val/perplexity, val/…/loss) and higher for anything else (scores, pass@k)."""
    if t.best_metric_mode != "auto":
        return t.best_metric_mode == "min"
    return t.best_metric.endswith(("perplexity", "loss"))


def describe_guards(cfg) -> str:
    """The start-up line naming each guard that is on and what it watches, or that none is."""
    t, said = cfg.trainer, []
    if t.max_kl:
        said.append(f"kl/mean (k1 to the reference, computed each step) over {t.max_kl_window} steps > {t.max_kl} "
                    f"stops")
    if t.min_entropy:
        said.append(f"policy/entropy < {t.min_entropy} {t.min_entropy_action}s")
    if t.best_metric:
        direction = "lower" if lower_is_better(t) else "higher"
        said.append(f"best/ keeps the best {t.best_metric} ({direction} is better)" + (
            "" if t.rollback_tolerance is None else f", rolled back to when it is worse than its "
            f"{'value before training' if t.rollback_baseline == 'pretrained' else 'best'} by more than "
            f"{t.rollback_tolerance}"))
    return "guards: " + ("; ".join(said) if said else "none (trainer.max_kl, min_entropy, best_metric are off)")


def needs_reference(cfg) -> bool:
    """Whether a run computes the reference's log-probs (ppo.py's step 4): for a KL term, in the reward or the loss,
    or for the trainer.max_kl guard, which reads kl/mean whatever the KL terms."""
    alg = cfg.algorithm
    return alg.use_kl_in_reward or alg.use_kl_loss or cfg.trainer.max_kl > 0


def rejection_band(alg) -> tuple[float, float]:
    """[low, high], the band of ρ that algorithm.rollout_rs keeps: rollout_rs_threshold_lower (0: 1 / the upper
    bound, as verl) to rollout_rs_threshold."""
    return alg.rollout_rs_threshold_lower or 1 / alg.rollout_rs_threshold, alg.rollout_rs_threshold


# ---- reward.sources: the scorers a run adds up (rewards.SCORERS) with their weights


OLD_TYPES = {"rule": None, "model": ["model"], "judge": ["judge"], "both": "reward.sources=[rule,model]",
             "rule+judge": "reward.sources=[rule,judge]"}  # reward.type → its sources, or the new spelling to refuse


def reward_sources(cfg_reward) -> list[tuple[str, float]]:
    """(scorer name, weight) for each of reward.sources, which defaults to [function] with a reward.function, else
    [rule]; reward.type, the old spelling, maps onto it (OLD_TYPES). A ConfigError for a refused old spelling, both
    spellings at once, a weight count that is not the source count, a source twice, a reward.function beside rule
    sources that do not read it (beside a reward model, judge or server it is the task's rule of val/rule_score/mean),
    and the source function without a reward.function."""
    default = ["function"] if cfg_reward.function else ["rule"]
    names = cfg_reward.sources or default
    if cfg_reward.type is not None:
        if cfg_reward.sources is not None:
            raise ConfigError(f"reward.type={cfg_reward.type} and reward.sources are two spellings of one setting; "
                              f"keep reward.sources only")
        mapped = OLD_TYPES[cfg_reward.type]
        if isinstance(mapped, str):
            raise ConfigError(f"reward.type={cfg_reward.type} is now spelled {mapped} with reward.weights=[w_1,w_2] "
                              f"(the old reward.rule_weight, model_weight and judge.weight, in that order)")
        names = mapped or default
    weights = cfg_reward.weights or [1.0] * len(names)
    if len(weights) != len(names):
        raise ConfigError(f"reward.weights has {len(weights)} numbers for the {len(names)} reward.sources {names}: "
                          f"give one weight per source")
    if len(set(names)) != len(names):
        raise ConfigError(f"reward.sources={names} names a source twice; give it once, with its weight")
    if cfg_reward.function and set(names) <= {"rule"}:
        raise ConfigError(f"reward.function is set but reward.sources={names} does not read it: add function to "
                          f"reward.sources, or unset reward.function")
    if "function" in names and not cfg_reward.function:
        raise ConfigError("reward.sources lists function but reward.function is not set: give path/to/file.py:name")
    return list(zip(names, weights))


# ---- model folders: a model and a tokenizer that load, from safetensors, without running code from the folder


PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt")  # torch.save files: loading one unpickles it


def check_model_path(path: str, key: str, need: str = "model", trust_remote_code: bool = False) -> None:
    """Before anything loads: a local folder that is missing or holds no model (need="model": config.json and
    safetensors weights) or no tokenizer (need="tokenizer") fails in a sentence; so does a LoRA adapter, a folder
    of pickle weights only, or one whose model or tokenizer is code in the folder (auto_map) while
    trust_remote_code is false. A name that reads as a hub id (org/name, where no folder `org` exists here) is
    left to the hub."""
    hub_id = re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", path) and not os.path.isdir(path.split("/")[0])
    if not os.path.isdir(path):
        if hub_id and not os.path.exists(path):
            return
        raise ConfigError(f"{key}: {path} is not a folder; give a local model folder or a hub id (org/name)")
    files = set(os.listdir(path))
    if need == "tokenizer":
        if not {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"} & files:
            raise ConfigError(f"{key}: {path} holds no tokenizer (tokenizer.json or tokenizer_config.json)")
        check_no_remote_code(os.path.join(path, "tokenizer_config.json"), key, trust_remote_code)
        return
    if "adapter_config.json" in files:
        raise ConfigError(f"{key}: {path} is a LoRA adapter (adapter_config.json), not a whole model; merge it into "
                          f"its base first, python tools/merge_lora.py {path} {path}-merged, and give {path}-merged")
    pickles = sorted(f for f in files if f.endswith(PICKLE_WEIGHTS))
    if "config.json" in files and pickles and not any(f.endswith(".safetensors") for f in files):
        raise ConfigError(pickle_sentence(path, pickles, key))
    if not ("config.json" in files and any(f.endswith(".safetensors") for f in files)):
        raise ConfigError(f"{key}: {path} holds no model (config.json and *.safetensors weights); give the folder "
                          f"a model was saved to")
    check_no_remote_code(os.path.join(path, "config.json"), key, trust_remote_code)


def pickle_sentence(path: str, pickles: list, key: str) -> str:
    """Why a folder of pickle weights is refused, and the command that converts it (run where the file is trusted:
    torch.load with weights_only=True refuses code, but this library unpickles nothing)."""
    with open(os.path.join(path, "config.json")) as f:
        arch = (json.load(f).get("architectures") or ["AutoModelForCausalLM"])[0]
    return (f"{key}: {path} holds only pickle weights ({', '.join(pickles[:3])}), which this library does not load "
            f"(unpickling can run code); convert them to safetensors once, where you trust the file: python -c "
            f"\"from transformers import {arch} as M; M.from_pretrained('{path}').save_pretrained('{path}')\"")


def check_no_remote_code(config_file: str, key: str, trust_remote_code: bool) -> None:
    """A config.json / tokenizer_config.json whose `auto_map` points at Python files in the folder, for a model type
    or tokenizer class transformers does not have itself (so loading would run that code), fails unless
    trust_remote_code: transformers would otherwise ask on stdin, and a `yes` piped into a script runs it."""
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # absent, or not JSON: transformers' own error says so
    if trust_remote_code or not isinstance(config, dict) or not config.get("auto_map"):
        return
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if config_file.endswith("tokenizer_config.json"):
        known = hasattr(transformers, str(config.get("tokenizer_class")))
    else:
        known = config.get("model_type") in CONFIG_MAPPING_NAMES
    if not known:
        enable = ("--trust-remote-code" if key.startswith("--") else  # a tool's argument
                  "reward_model.trust_remote_code=true" if key.startswith("reward_model.")
                  else "model.trust_remote_code=true")
        names = [v for value in config["auto_map"].values() for v in (value if isinstance(value, list) else [value])]
        code = sorted({v.split(".")[0] + ".py" for v in names if isinstance(v, str)})  # "planted.Cls" → planted.py
        raise ConfigError(f"{key}: {config_file} maps its classes to code in the folder "
                          f"({', '.join(code) or 'auto_map'}), which runs only with {enable}; set it if you trust "
                          f"that code, or give a folder transformers loads by itself")


def check_model_folders(cfg_model, critic_path) -> None:
    """Before anything loads: the policy's folder and its tokenizer, and the critic's backbone (None: no critic)."""
    trust = cfg_model.trust_remote_code
    check_model_path(cfg_model.path, "model.path", trust_remote_code=trust)
    check_model_path(cfg_model.tokenizer_path or cfg_model.path,
                     "model.tokenizer_path" if cfg_model.tokenizer_path else "model.path", need="tokenizer",
                     trust_remote_code=trust)
    if critic_path is not None:
        check_model_path(critic_path, "critic.model_path", trust_remote_code=trust)
