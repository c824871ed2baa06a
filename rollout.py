"""Step 2, rollouts: sample `n` responses per prompt from the current policy. Every kind is one class with one
protocol, and one line of KINDS (rollout.name); multi-turn (agents/) and running ahead (RunAhead, below) wrap any kind
and answer the same calls:

    generate(rows, n, temperature, seed=None) -> Rollout   # step 2 (and validation's): rows are data rows, each
                                                           # with "prompt_ids" (and "max_tokens": a turn's budget)
    sync_weights(model, version)       # the actor's weights after `version` updates; never during a generate call
    close()                            # at the end (a vLLM engine's process groups, a server child)
    eos_ids                            # every id that ends a response
    gives_logprobs, runs_apart         # class attributes read at start-up (check_rollout): the sampler's logprobs;
                                       # weights of its own, so that generation may run ahead (rollout.steps_ahead)

Each returns the same `Rollout`, row `i·n + j` holding sample j of prompt i:
    responses      (B·n, Tr)  token ids, right-padded with the tokenizer's pad id (a tokenizer from
                              infra.models.load_tokenizer, which makes EOS the pad where there is none)
    response_mask  (B·n, Tr)  1 = a real response token (the EOS included), 0 = padding
    logprobs       (B·n, Tr)  the sampler's log-probabilities, or None where the backend has none
and, from multi-turn rollouts (agents/multi_turn.py), an attention mask (1 on the tool answers too, where
response_mask is 0), each sample's conversation, the environment's token rewards and agent/* metrics.

`ppo.py` calls `make_rollout(...)` once, then `generate(...)` every step and `sync_weights(...)` after every step that
changed the policy, and `close()` at the end. vLLM is imported only when its kind is made (it is optional, and its
environment must be set first: make_rollout). The server kind's process, requests and weight pushes are
rollout_kinds/server.py's.
"""
import importlib.util
import logging
import os
import time
from collections import deque
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from infra.batches import autocast_dtype
from infra.config import ConfigError, load_target
from infra.distributed import max_over_processes
from infra.metrics import timed
from infra.rollout_common import (cut_at_eos, eos_ids_of, InTurn, kv_cache_bytes, left_pad, policy_weights,
                                  prompt_seeds, prompts_and_budgets, right_pad, Rollout)


class HFRollout:
    """`model.generate` on the training model itself, batched and left-padded.

    It samples from the very weights being trained, so `sync_weights` has nothing to do, and it cannot run ahead of
    them. `device` is where it computes (the accelerator's): under FSDP2's CPU offload the parameters live in host
    memory.
    """
    gives_logprobs, runs_apart = False, False

    def __init__(self, model, tokenizer, cfg, autocast_dtype=None, synced_gpus=False, device=None):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = eos_ids_of(tokenizer, model)
        self.autocast_dtype = autocast_dtype
        self.synced_gpus = synced_gpus  # FSDP: every rank must run the same number of forwards
        self.device = device or next(model.parameters()).device

    @torch.no_grad()
    def generate(self, rows: list[dict], n: int, temperature: float, seed: Optional[int] = None) -> Rollout:
        cfg, device = self.cfg, self.device
        prompts, budgets = prompts_and_budgets(rows, cfg.max_response_length)
        seqs = [p for p in prompts for _ in range(n)]
        budgets = [b for b in budgets for _ in range(n)]  # per row
        greedy = temperature == 0
        kwargs = dict(max_new_tokens=max(budgets, default=cfg.max_response_length), do_sample=not greedy,
                      pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids), synced_gpus=self.synced_gpus)
        if cfg.ignore_eos:
            kwargs.update(min_new_tokens=kwargs["max_new_tokens"])
        if not greedy:
            kwargs.update(temperature=temperature, top_p=cfg.top_p, top_k=cfg.top_k if cfg.top_k > 0 else None)
        autocast = (torch.autocast(device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                    else nullcontext())
        was_training = self.model.training
        self.model.eval()
        chunks = [seqs[start:start + cfg.micro_batch_size] for start in range(0, len(seqs), cfg.micro_batch_size)]
        if self.synced_gpus:  # as many generate calls as the process with most (validation rows split unevenly),
            chunks += [None] * (max_over_processes(len(chunks)) - len(chunks))  # the extra ones on one pad token
        responses = []
        for chunk in chunks:
            ids, mask = left_pad(chunk or [[self.pad_id]], self.pad_id)
            with autocast:
                out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
            new = out[:, ids.shape[1]:].tolist() if chunk else []
            responses += new if cfg.ignore_eos else [cut_at_eos(row, self.eos_ids) for row in new]
        self.model.train(was_training)
        responses = [row[:budget] for row, budget in zip(responses, budgets)]  # each prompt's own budget
        responses, response_mask = right_pad(responses, self.pad_id)  # (B·n, Tr) each
        return Rollout(responses, response_mask, None)

    def sync_weights(self, model, version: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


class ExpectedVllmWarnings(logging.Filter):
    """Drops two kinds of vLLM warning that warn of nothing here (every other line passes):

    * "RotaryEmbedding: Failed to load weights", logged by the in-place reload at every sync: vLLM's RoPE layer holds
      a cos/sin cache buffer that the reload counts as loadable, and no checkpoint carries it (HF never saves
      inv_freq). vLLM keeps the cache it built at start, which is right: it depends on the config, not the weights.
    * "Attempted to load weight … with dtype torch.float32 into parameter with dtype torch.bfloat16", once per weight
      when the engine starts in bf16 (rollout.dtype) from an fp32 checkpoint (the demo's): rounding each weight to
      the dtype the engine was asked for is what should happen.
    """

    def filter(self, record):
        if record.msg == "%s: Failed to load weights":
            return record.args != ("RotaryEmbedding",)
        if record.msg.startswith("Attempted to load weight %s with dtype %s into parameter"):
            return record.args[1] != torch.float32
        return True


class VLLMRollout:
    """A vLLM engine in this process, with its own copy of the policy's weights.

    The engine loads `model.path`, and `sync_weights` overwrites its weights with the actor's, at construction
    (so a LoRA or resumed actor is what it samples from) and after every optimiser step.
    Its logprobs are `processed_logprobs`: log_softmax(logits / T) after top-k/top-p, the distribution sampled.
    On GPU with `rollout.free_cache_engine` the engine sleeps between rollouts (weights to host RAM, KV cache freed),
    as verl does; vLLM's CPU backend has no sleep mode, so there it stays awake. Awake, the engine holds
    rollout.gpu_memory_utilization × the device's memory (weights and KV cache) for the whole run.
    """
    gives_logprobs, runs_apart = True, True

    def __init__(self, cfg, model, tokenizer, unwrap=lambda m: m):
        from vllm import LLM

        for name in ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.models.utils"):
            logging.getLogger(name).addFilter(ExpectedVllmWarnings())
        self.cfg, self.unwrap = cfg.rollout, unwrap
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = eos_ids_of(tokenizer, unwrap(model))
        dtype = cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype  # auto: as the trainer computes
        self.dtype = autocast_dtype(dtype) or torch.float32
        self.sleeps = cfg.rollout.free_cache_engine and torch.cuda.is_available()
        max_len = cfg.data.max_prompt_length + cfg.rollout.max_response_length
        memory = dict(gpu_memory_utilization=cfg.rollout.gpu_memory_utilization)
        if not torch.cuda.is_available():
            # On CPU vLLM gives its KV cache gpu_memory_utilization·RAM minus the RSS of this whole process (the
            # trainer's too), and fails when that is ≤ 0; ask instead for what 256 full-length sequences need.
            kv_bytes = kv_cache_bytes(unwrap(model).config, 256 * max_len, self.dtype)
            memory = dict(max_num_seqs=256, kv_cache_memory_bytes=kv_bytes)
        # Under a launcher every rank owns an engine. "external_launcher" (TRL's colocate mode does the same) makes
        # vLLM join the process group accelerate made instead of starting its own, and put the engine on the
        # device LOCAL_RANK names; checked with 2 processes on CPU (gloo), FSDP2 and LoRA included. Whenever a group
        # exists, one process too (FSDP2 on one GPU runs under torchrun): vLLM's single-process executor would
        # otherwise take the launcher's group for one of its own. A launcher's (torchrun sets RANK), not the group an
        # earlier engine of this process made for itself.
        distributed = torch.distributed.is_initialized() and "RANK" in os.environ
        self.rank = torch.distributed.get_rank() if distributed else 0
        backend = "external_launcher" if distributed else None
        if torch.cuda.is_available():  # vLLM's start-up check counts torch's cached, unused blocks as taken
            torch.cuda.empty_cache()
        # In this process vLLM reseeds the global random, numpy and torch generators with trainer.seed.
        self.llm = LLM(model=cfg.model.path, tokenizer=cfg.model.tokenizer_path or cfg.model.path,
                       dtype=self.dtype, seed=cfg.trainer.seed, enforce_eager=cfg.rollout.enforce_eager,
                       max_model_len=max_len, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                       enable_sleep_mode=self.sleeps, distributed_executor_backend=backend,
                       trust_remote_code=cfg.model.trust_remote_code, **memory)
        self.asleep = set()  # the parts of a sleeping engine: "weights", "kv_cache"
        self.stale_prefix_cache = False
        self.sync_weights(model)

    @torch.no_grad()
    def generate(self, rows: list[dict], n: int, temperature: float, seed: Optional[int] = None) -> Rollout:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake_up(["weights", "kv_cache"])
        if self.stale_prefix_cache:  # cached prompt prefixes hold keys and values of the old weights
            self.llm.reset_prefix_cache()
            self.stale_prefix_cache = False
        cfg, greedy = self.cfg, temperature == 0
        prompts, budgets = prompts_and_budgets(rows, cfg.max_response_length)
        seeds = prompt_seeds(seed, self.rank, len(prompts))
        params = [SamplingParams(n=1 if greedy else n, temperature=temperature, top_p=cfg.top_p,
                                 top_k=max(cfg.top_k, 0), max_tokens=budget,
                                 stop_token_ids=sorted(self.eos_ids), detokenize=False,
                                 min_tokens=budget if cfg.ignore_eos else 0,  # as HF's
                                 logprobs=0,  # the sampled token's logprob, no alternatives
                                 seed=prompt_seed)
                  for budget, prompt_seed in zip(budgets, seeds)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        responses, logprobs = [], []
        for out in outputs:  # in prompt order; row i·n + j = sample j of prompt i
            samples = sorted(out.outputs, key=lambda s: s.index)
            for sample in samples * n if greedy else samples:  # vLLM wants n = 1 when greedy; the n rows agree
                tokens = cut_at_eos(list(sample.token_ids), self.eos_ids)
                responses.append(tokens)
                logprobs.append([sample.logprobs[t][tok].logprob for t, tok in enumerate(tokens)])
        if self.sleeps:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}
        responses, response_mask = right_pad(responses, self.pad_id)  # (B·n, Tr) each
        logprobs, _ = right_pad(logprobs, 0.0, dtype=torch.float32)  # (B·n, Tr)
        return Rollout(responses, response_mask, logprobs)

    @torch.no_grad()
    def sync_weights(self, model, version: int = 0) -> None:
        """Copy the actor's current weights into the engine, and forget KV computed with the old ones.
        The weights stream in one at a time (policy_weights), each in the engine's dtype as it comes: vLLM's in-place
        reload takes an iterator, and this process's engine consumes it here (VLLM_ENABLE_V1_MULTIPROCESSING=0).
        A sleeping engine wakes its weights only; its KV cache wakes when generate next runs, as verl does."""
        self.wake_up(["weights"])
        weights = ((name, w.to(self.dtype)) for name, w in policy_weights(self.unwrap(model)))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.stale_prefix_cache = True

    def wake_up(self, tags: list) -> None:
        """Wake those of `tags` ("weights", "kv_cache") that sleep. vLLM maps them back into memory the driver has
        free, and blocks torch's caching allocator keeps (the training step's) are not: they are released first, as
        TRL, verl and OpenRLHF do."""
        if todo := [tag for tag in tags if tag in self.asleep]:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.llm.wake_up(tags=todo)
            self.asleep -= set(todo)

    def close(self) -> None:
        """Shut the engine down: vLLM destroys its own process groups, then the launcher's (under a launcher), and so
        does not leave the teardown of NCCL communicators to the interpreter's exit."""
        self.llm.llm_engine.engine_core.shutdown()


# rollout.name → its backend (a feature folder's as "module:name"); gives_logprobs and runs_apart decide the start-up
# checks (check_rollout)
KINDS = {"hf": HFRollout, "vllm": VLLMRollout, "server": "rollout_kinds.server:ServerRollout"}
# rollout.name → the kind's own start-up check of its keys, before any model loads (check_rollout)
KIND_CHECKS = {"server": "rollout_kinds.server:check_server"}
# rollout.multi_turn: any kind's generate, turn after turn, an environment answering each turn
MULTI_TURN = {"check": "agents.multi_turn:check_multi_turn", "rollout": "agents.multi_turn:AgentRollout"}


def check_rollout(cfg) -> None:
    """Before anything loads: rollout.name is a kind, and what asks for the sampler's logprobs or for a rollout
    that runs ahead has one that gives them."""
    ro, alg = cfg.rollout, cfg.algorithm
    if ro.name not in KINDS:
        raise ConfigError(f"rollout.name={ro.name!r} is not one of {', '.join(KINDS)}")
    kind, missing = load_target(KINDS[ro.name]), ro.name == "vllm" and importlib.util.find_spec("vllm") is None
    if ro.name in KIND_CHECKS:
        load_target(KIND_CHECKS[ro.name])(cfg)
    asked = [f"algorithm.{key}={getattr(alg, key)}" for key in ("rollout_is", "rollout_rs")
             if getattr(alg, key) not in ("off", "auto")]
    if ro.steps_ahead and not kind.runs_apart:
        raise ConfigError(f"rollout.steps_ahead={ro.steps_ahead} needs a rollout with weights of its own, and "
                          f"rollout.name={ro.name} samples from the training weights: use rollout.name=vllm or server")
    if ro.steps_ahead and alg.filter_groups.enable:
        raise ConfigError(f"algorithm.filter_groups decides each step's generate rounds by their scores, which a "
                          f"batch generated rollout.steps_ahead={ro.steps_ahead} steps early cannot wait for: turn "
                          f"one of them off")
    if (asked or ro.steps_ahead) and (not kind.gives_logprobs or missing):
        why = "vLLM is not installed" if missing else f"rollout.name is {ro.name}"
        raise ConfigError(f"{' and '.join(asked) or f'rollout.steps_ahead={ro.steps_ahead}'} corrects by the "
                          f"sampler's own logprobs, which only rollout.name=vllm or server gives ({why}); use one of "
                          f"them, or set {' and '.join(a.split('=')[0] for a in asked) or 'it to 0'} to off")


def rollout_is_level(cfg) -> str:
    """algorithm.rollout_is with auto resolved: token when the rollout runs ahead (ppo.py's departure 8), else off."""
    if cfg.algorithm.rollout_is != "auto":
        return cfg.algorithm.rollout_is
    return "token" if cfg.rollout.steps_ahead else "off"


def check_turns(cfg, tokenizer, rows=()):
    """Before any model loads, with rollout.multi_turn on: its environment started and checked (MULTI_TURN) against
    the data rows, the settings that make_rollout's turns need; None without multi-turn."""
    return load_target(MULTI_TURN["check"])(cfg, tokenizer, rows) if cfg.rollout.multi_turn.enable else None


def make_rollout(cfg, model, tokenizer, accelerator, autocast_dtype=None, synced_forwards: bool = False, turns=None):
    """The backend named by `cfg.rollout.name` (KINDS), with multi-turn (turns: check_turns') around it; vLLM falls back
    to HF, with one warning, where it is missing."""
    name = cfg.rollout.name
    if name == "vllm":
        # Before vLLM is imported: keep its engine in this process (so weights pass by reference, and sync_weights
        # can stream them), and tell it torch's thread count, or on CPU it pins torch to one thread and training
        # runs at half speed.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0" and accelerator.is_main_process:
            print("warning: VLLM_ENABLE_V1_MULTIPROCESSING=1 is set, but rollout.name=vllm hands weights to an engine "
                  "in this process: it is set to 0 for this run")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", cfg.rollout.vllm_log_level)
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            if (rollout_is_level(cfg), cfg.algorithm.rollout_rs) != ("off", "off"):
                raise ConfigError(f"algorithm.rollout_is / rollout_rs need the sampler's logprobs, and vLLM cannot be "
                                  f"imported ({e}): repair vLLM, or turn both off") from None
            if accelerator.is_main_process:
                print(f"warning: rollout.name=vllm but vLLM cannot be imported ({e}); using rollout.name=hf")
            name = "hf"
    if name == "vllm":
        backend = VLLMRollout(cfg, model, tokenizer, unwrap=accelerator.unwrap_model)
    elif name == "hf":  # synced_forwards (FSDP2): every process runs as many forwards as the one with the longest one
        backend = HFRollout(accelerator.unwrap_model(model), tokenizer, cfg.rollout, autocast_dtype,
                            synced_gpus=synced_forwards, device=accelerator.device)
    else:  # every other kind: the common constructor
        backend = load_target(KINDS[name])(cfg, model, tokenizer, accelerator)
    if turns is not None:  # as many turns on every process (HF generate under FSDP2 is a collective)
        backend = load_target(MULTI_TURN["rollout"])(backend, tokenizer, turns, max_over_processes)
    return backend


# ---------------------------------------------------------------------------------------
# Running ahead (rollout.steps_ahead = k > 0, ppo.py's departure 8): read this only if you turn it on


@dataclass(frozen=True)
class Generated:
    """One step's prompts and their responses, before scoring."""
    rows: list  # (B/n,) this process's prompts' data rows
    rollout: Rollout
    version: int  # the policy version that sampled it: the actor's updates before
    seconds: float  # the generation's own time
    data_position: tuple  # (epoch, position) of the data order before these prompts: where a resumed run draws again


class RunAhead:
    """A rollout kind that generates the batches of the next k steps in one background thread (or in turn, with
    rollout.background=false: the same schedule without overlap) while the loop scores and trains. New weights reach
    the rollout between two generations, never during one; validation waits for the generation in flight."""

    def __init__(self, backend, cfg_rollout, version: int):
        """version: the actor's updates so far (a resumed run's too), which the backend's weights hold."""
        self.backend, self.cfg, self.k, self.version = backend, cfg_rollout, cfg_rollout.steps_ahead, version
        self.eos_ids, self.queue = backend.eos_ids, deque()  # Futures of Generated, the oldest first
        self.pool = InTurn("rollout") if cfg_rollout.background else None  # a daemon thread: Ctrl-C twice ends it

    def wants(self, step: int, total_steps: int) -> list[int]:
        """The steps whose prompts to draw now: the queue holds the batches of step … step + k."""
        return list(range(step + len(self.queue), min(step + self.k, total_steps) + 1))

    def submit(self, data_position: tuple, rows: list, seed: int) -> None:
        """Generate n responses for each of these prompts, in the thread, from the weights it holds then."""
        def generate():
            t0 = time.perf_counter()
            ro = self.backend.generate(rows, self.cfg.n, self.cfg.temperature, seed=seed)
            return Generated(rows, ro, self.version, time.perf_counter() - t0, data_position)
        if self.pool is None:
            self.queue.append(Future())
            self.queue[-1].set_result(generate())
        else:
            self.queue.append(self.pool.submit(generate))

    def next(self, step: int, times: dict, metrics: dict) -> tuple[list, Rollout]:
        """The oldest batch's prompt rows and rollout, once generated, its staleness added to `metrics` (lists:
        rollout/staleness_mean|max) and its seconds to `times`; refused when older than k versions."""
        with timed(times, "time/gen_wait_s"):
            got = self.queue.popleft().result()
        staleness = self.version - got.version
        check_staleness(staleness, self.k, step)
        times["time/gen_s"] = times.get("time/gen_s", 0.0) + got.seconds
        metrics["rollout/staleness_mean"].append(float(staleness))
        metrics["rollout/staleness_max"].append(float(staleness))
        return got.rows, got.rollout

    def generate(self, rows: list, n: int, temperature: float, seed: Optional[int] = None) -> Rollout:
        """Validation's: once no generation is in flight."""
        self.wait()
        return self.backend.generate(rows, n, temperature, seed=seed)

    def sync_weights(self, model, version: int) -> None:
        self.wait()
        self.backend.sync_weights(model, version)
        self.version = version

    def wait(self) -> None:
        for future in self.queue:
            future.result()

    def rewind(self, saved: dict) -> dict:
        """A checkpoint's state with the data position of the first batch drawn but not yet trained: a resumed run
        draws those prompts again, and generates them from the checkpoint's weights."""
        if self.queue:
            saved["epoch"], saved["position"] = self.queue[0].result().data_position
        return saved

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel=list(self.queue))
        self.backend.close()


def check_staleness(staleness: int, k: int, step: int) -> None:
    """A batch sampled more than rollout.steps_ahead versions before the policy it would train is never trained."""
    if not 0 <= staleness <= k:
        raise RuntimeError(f"the batch of step {step} was sampled {staleness} policy versions before the one it "
                           f"would train, outside rollout.steps_ahead={k}: refused (a bug in the schedule)")
