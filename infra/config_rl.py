"""The algorithm's config keys: advantages and KL (algorithm), the policy update (actor), the critic, their
optimisers, the teacher of on-policy distillation, and the reward (its sources: rules, your function, a reward model, an
LLM judge, a remote reward server). Each key: its type, its default (written here once) and,
in the string under it, its meaning; infra/config.py gathers these sections into ppo.py's `Config`.
"""
from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class KLControlConfig:
    kl_coef: float = 0.001
    """β, the initial KL-penalty coefficient"""
    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed β, or adaptive β (Ziegler et al. 2019)"""
    target_kl: float = 0.1
    """adaptive controller: KL per sequence it steers towards"""
    horizon: int = 10000
    """adaptive controller: horizon in samples"""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO's dynamic sampling (Yu et al., 2025; verl's algorithm.filter_groups): drop the prompts whose rollout.n
    scores are all equal (no advantage to learn from) and generate for more prompts until the step has
    data.train_batch_size of them; each process fills its own share"""
    max_num_gen_batches: int = 10
    """most generate rounds of data.train_batch_size prompts per step, the first included; a step still short after
    them stops the run with the counts (verl's key; its 0 = unbounded has no equivalent here)"""


@dataclass
class TeacherConfig:
    path: Optional[str] = None
    """on-policy distillation's teacher: a causal LM folder with the policy's vocabulary (a merged final/ of this
    library, tools/merge_lora.py); null = no teacher"""
    coef: float = 1.0
    """weight of KL(π ‖ π_teacher): in the token rewards (mode=reward) or in the actor loss (mode=loss)"""
    mode: Literal["reward", "loss"] = "reward"
    """reward: −coef·KL_t(π ‖ π_teacher) joins each token's reward (a dense reward, as verl's and TRL's on-policy
    distillation); loss: coef·KL is added to the policy loss, as the KL loss to the reference is"""
    kl_estimator: str = "k1"
    """the per-token estimate of KL(π ‖ π_teacher), a name in kl.ESTIMATORS: k1 = log π − log π_teacher, the reverse
    KL of on-policy distillation, as a reward; with mode=loss use k3 (k1's gradient is zero in expectation)"""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    """advantage estimator, a name in advantages.ESTIMATORS: gae (with the critic), grpo (group-normalised), rloo
    (leave-one-out), reinforce_plus_plus (discounted return per token, whitened over the global batch),
    reinforce_plus_plus_baseline (the score minus its group's mean, whitened over the global batch)"""
    gamma: float = 1.0
    """discount factor for GAE and REINFORCE++"""
    lam: float = 0.95
    """GAE λ"""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group std (false = Dr. GRPO)"""
    whiten_advantages: bool = True
    """GAE: whiten advantages over the valid tokens of the batch"""
    use_kl_in_reward: bool = False
    """subtract β·KL(policy‖ref) from the per-token reward"""
    kl_penalty: str = "k1"
    """KL estimator for the reward penalty, a name in kl.ESTIMATORS"""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """controller for β"""
    use_kl_loss: bool = True
    """add kl_loss_coef·KL(policy‖ref) to the policy loss (as GRPO does)"""
    kl_loss_coef: float = 0.1
    """weight of the KL loss"""
    kl_loss_type: str = "k3"
    """KL estimator for the KL loss, a name in kl.ESTIMATORS"""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """dynamic sampling"""
    rollout_is: Literal["auto", "off", "token", "sequence", "sequence_mean"] = "auto"
    """truncated importance sampling for the sampler/trainer gap (needs the sampler's logprobs: rollout.name=vllm or
    server): the policy loss × min(ρ, rollout_is_threshold), ρ = π_old/π_rollout per token, per response (the
    product), or per response length-normalised (the geometric mean); off still logs the token weights; auto =
    token when rollout.steps_ahead > 0 (ppo.py's departure 8), else off"""
    rollout_is_threshold: float = 2.0
    """upper bound of the rollout importance weight"""
    rollout_rs: Literal["off", "token", "sequence", "sequence_mean"] = "off"
    """rollout rejection sampling (verl's rollout_rs token_k1 / seq_sum_k1 / seq_mean_k1; needs rollout.name=vllm or
    server): a token, or a whole response, whose ratio ρ (as rollout_is) leaves [rollout_rs_threshold_lower,
    rollout_rs_threshold] is left out of the policy loss"""
    rollout_rs_threshold: float = 2.0
    """upper bound of ρ kept by rejection"""
    rollout_rs_threshold_lower: float = 0.0
    """lower bound of ρ kept by rejection; 0 = 1 / rollout_rs_threshold (as verl)"""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """on-policy distillation: the policy's own samples scored token by token by a teacher's log-probabilities"""


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """peak learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas"""
    warmup_ratio: float = 0.05
    """share of total steps spent in linear warmup"""
    lr_scheduler: Literal["cosine", "constant"] = "cosine"
    """schedule after warmup"""
    min_lr_ratio: float = 0.1
    """cosine floor, as a share of lr"""


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr_scheduler="constant"))
    """actor optimiser"""
    ppo_epochs: int = 1
    """passes over each batch of rollouts"""
    ppo_mini_batch_size: int = 4
    """prompts per optimiser step, over all processes (times rollout.n sequences)"""
    ppo_micro_batch_size_per_device: int = 64
    """sequences per forward/backward on one process (gradient accumulation fills the mini-batch)"""
    log_prob_micro_batch_size_per_device: int = 64
    """sequences per no-grad forward for old/ref logprobs and values"""
    policy_loss: str = "vanilla"
    """the per-token policy loss, a name in losses.POLICY_LOSSES: vanilla (PPO's clipped surrogate), gspo (one
    length-normalised ratio per response, Zheng et al. 2025), cispo (clipped, stop-gradient importance weight,
    MiniMax-M1)"""
    clip_ratio_low: float = 0.2
    """PPO clip: ratio ≥ 1 − clip_ratio_low (1: no lower bound, as CISPO)"""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio ≤ 1 + clip_ratio_high"""
    clip_ratio_c: float = 3.0
    """dual-clip bound for negative advantages (Ye et al., 2020)"""
    entropy_coef: float = 0.0
    """entropy bonus weight"""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token losses are averaged over the mini-batch (seq-mean-token-sum-norm: Dr. GRPO's sum over
    tokens / (sequences × loss_scale_factor))"""
    loss_scale_factor: float = 0.0
    """the constant normaliser of seq-mean-token-sum-norm (verl's key); 0 = rollout.max_response_length"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    use_dynamic_bsz: bool = False
    """form micro-batches by a token budget instead of a count"""
    max_token_len_per_device: int = 8192
    """token budget per micro-batch when use_dynamic_bsz"""


@dataclass
class CriticConfig:
    model_path: Optional[str] = None
    """value model backbone; null means model.path (a reward-model folder works too)"""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, warmup_ratio=0.0,
                                                                   lr_scheduler="constant", min_lr_ratio=0.0))
    """critic optimiser"""
    cliprange_value: float = 0.2
    """value clipping around old values"""
    vf_coef: float = 1.0
    """value loss weight"""
    warmup_steps: int = 0
    """steps during which only the critic trains: the actor waits until the values it learns from mean something
    (its first steps' advantages come from a random value head)"""
    max_grad_norm: float = 1.0
    """clip the critic's gradient norm"""
    ppo_micro_batch_size_per_device: int = 64
    """sequences per critic forward/backward on one process"""
    lora_rank: int = 32
    """LoRA rank of the critic (on model.target_modules of the top model.lora_top_layers layers; the value head
    trains whole); 0 trains every weight"""
    lora_alpha: int = 64
    """critic LoRA scaling α (the update is α/r · B·A)"""


@dataclass
class RequestFields:
    """How an HTTP scorer (the judge, a reward server: judge.with_retries) sends its requests."""
    max_concurrency: int = 8
    """requests in flight at once"""
    timeout_s: float = 30.0
    """seconds one request may take before it is retried"""
    max_retries: int = 2
    """retries of a request that timed out, could not connect or got a 429/5xx, after backoff_s, 2·backoff_s, …
    seconds"""
    backoff_s: float = 1.0
    """seconds before the first retry"""


@dataclass
class JudgeConfig(RequestFields):
    base_url: Optional[str] = None
    """the judge's OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (vLLM's server); asked before any model
    loads"""
    model: Optional[str] = None
    """the model to ask there; null = the one the endpoint serves"""
    api_key_env: str = "OPENAI_API_KEY"
    """environment variable holding the endpoint's API key (a local vLLM server needs none), so no key is saved
    in the run's config.yaml; the key is sent only where base_url is https or this machine (localhost, 127.0.0.1,
    ::1), never over plain http to another host, and start-up says in one line which"""
    prompt_template: Optional[str] = None
    """text file with the judge's prompt; {prompt}, {response} and {ground_truth} in it are replaced (a misspelt one,
    e.g. {respnse}, is refused at start-up)"""
    parser: str = "number"
    """how an answer becomes a score, a name in judge.PARSERS: number (X of its last "X/Y", "X out of Y" or "X of Y",
    Y being max_score, else its last number; in [min_score, max_score], scaled to [0, 1]) or yes_no (its last yes or
    no: 1 or 0)"""
    min_score: float = 0.0
    """number parser: the lowest score the prompt asks for"""
    max_score: float = 10.0
    """number parser: the highest score the prompt asks for"""
    temperature: float = 0.0
    """the judge's sampling temperature; at 0 (greedy) the same response gets the same answer at every step, so a
    score's noise is the policy's alone"""
    max_tokens: int = 64
    """longest answer of the judge, in tokens"""


@dataclass
class RemoteRewardConfig(RequestFields):
    url: Optional[str] = None
    """a reward server (reward.sources=[remote]): each batch is POSTed there as JSON in OpenRLHF's --remote_rm_url
    format, {"query": [prompt + response text], "prompts": [...], "labels": [ground truths]} (and "responses",
    "data_sources", "extra_info" beside), and {"rewards": [one number per sample]} (or "scores") comes back"""
    request_size: int = 0
    """samples per request; 0 = the whole batch in one"""


@dataclass
class RewardConfig:
    sources: Optional[list[str]] = None
    """the scorers whose weighted scores add up to the task score, names in rewards.SCORERS: rule (the built-in
    rules by data_source), function (reward.function), model (a reward model), judge (an LLM judge), remote (a reward
    server); null = [function] when reward.function is set, else [rule]"""
    weights: list[float] = field(default_factory=list)
    """one weight per source; [] = 1.0 each"""
    type: Optional[Literal["rule", "model", "judge", "both", "rule+judge"]] = None
    """the old spelling, still read: rule = sources [rule] (or [function] with reward.function), model = [model],
    judge = [judge]; both and rule+judge are refused with their new spelling"""
    function: Optional[str] = None
    """your reward (source function): path/to/file.py:name with verl's compute_score signature, returning a number or
    a dict with "score" (and, for rewards per token, "step_rewards" with "step_ends": the character offsets where
    each step ends); beside a reward model, judge or server, the task's rule of val/rule_score/mean"""
    function_style: Literal["auto", "verl", "trl", "openrlhf"] = "auto"
    """reward.function's calling convention: verl (compute_score(data_source, solution_str, ground_truth, extra_info),
    per sample), trl (f(prompts, completions, **columns) → list[float | None], per batch: TRL's reward_funcs),
    openrlhf (reward_func(queries, prompts, labels) → rewards or {"rewards", "scores", "extra_logs"}, per batch:
    one call of the process's batch, which reward.timeout_s bounds as a whole); auto = trl where it has a
    `completions` parameter, openrlhf where `queries`, else verl"""
    model_path: Optional[str] = None
    """reward model folder (AutoModelForSequenceClassification), for source model"""
    normalize: bool = False
    """standardise model scores with the mean/std stored beside the reward model"""
    clip: Optional[float] = None
    """clip model scores to ±clip"""
    micro_batch_size: int = 32
    """sequences per reward-model forward"""
    overlong_penalty: float = 0.0
    """added to the score of a response that hit max_response_length without EOS"""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13; verl's reward_manager=dapo overlong_buffer.len):
    a response longer than rollout.max_response_length − this many tokens loses overlong_penalty_factor × the share
    of the buffer it used; 0 = off"""
    overlong_penalty_factor: float = 1.0
    """the soft punishment at a response of rollout.max_response_length tokens"""
    overlong_filter: bool = False
    """DAPO's overlong filtering: responses cut off at max_response_length (no EOS) are left out of the policy loss"""
    timeout_s: float = 30.0
    """seconds one call of a custom reward.function may take: it runs in a worker process, which is restarted after
    a call that hangs, exits or kills it; such a call is an error for its sample (reward/errors)"""
    max_concurrency: int = 8
    """worker processes (on each training process) running a custom reward.function's calls at once"""
    max_timeouts: int = 8
    """calls of one batch that may time out before its calls not yet started are errors, unrun, so that a function
    hanging on every call ends its batch after ⌈max_timeouts / max_concurrency⌉ rounds of timeout_s (and a grace
    of seconds: infra/worker.hung_batch_s); 0 = no limit, every call waits out its own timeout"""
    max_abs_score: float = 1e6
    """a reward function's score beyond ±this (or not finite) is an error for its sample (reward/errors), not a
    score: one huge score swamps the batch's advantages and overflows the loss"""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """the LLM judge (source judge)"""
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    """the reward server (source remote)"""
