"""The rollout in its own process (rollout.name=server): vLLM's OpenAI-compatible server, started as this run's child
or found at rollout.server.url, asked for token ids and log-probs, and sent new weights (ServerRollout, the backend).

    python -m vllm.entrypoints.openai.api_server --model <model.path> --logprobs-mode processed_logprobs ...
    POST /v1/completions       {"prompt": [token ids], "n", "seed", "logprobs": 0, "return_token_ids": true, ...}
    POST /v1/load_lora_adapter {"lora_name": "policy-3", "lora_path": <folder>}      LoRA: a new adapter per push
    POST /collective_rpc       {"method": "reload_weights", "kwargs": {"weights_path": <folder>}}   full weights

Both weight pushes go through the disk, a folder under output_dir that the server reads, since that is what vLLM 0.32
offers a running server on a CPU: runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) and, in its dev mode
(VLLM_SERVER_DEV_MODE=1), the worker's in-place reload_weights from a folder, followed by /reset_prefix_cache. Between
GPUs vLLM 0.32 also has a weight-transfer engine (/init_weight_transfer_engine, /update_weights over NCCL), which a
CPU cannot run and this file does not use.

Before any model loads, check_server refuses a url without a scheme, one where no server answers GET /v1/models with
a model, and rollout.server.cpus that are not this process's cores. Every answer is checked against what was asked
(read_choices: n choices, token ids in the policy's vocabulary, a log-prob each): a server that is not exactly vLLM
stops the run in one sentence naming it and what it answered. Every request waits at most rollout.server.timeout_s;
after a stop signal the generation in flight ends within that, and a second signal ends the run at once (the
requests run in the calling thread's event loop, so no thread outlives it).
"""
import asyncio
import atexit
import ctypes
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Iterator, Optional

import torch
from safetensors.torch import save_file

from infra.batches import autocast_dtype
from infra.config import ConfigError
from infra.runs import RunError
from infra.rollout_common import (adapter_weights, cut_at_eos, eos_ids_of, kv_cache_bytes, policy_weights,
                                   prompt_seeds, prompts_and_budgets, right_pad, Rollout)

SERVED_NAME = "policy"  # the name the child serves model.path under


def post(url: str, body: dict, timeout: float) -> dict:
    """POST `body` as JSON; the JSON answer ({"text": …} where it is plain text, as /v1/load_lora_adapter's). An HTTP
    error, no answer within `timeout` seconds (rollout.server.timeout_s) or a lost connection is a RunError naming
    the url and what happened."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            data = reply.read()
    except urllib.error.HTTPError as e:
        raise RunError(f"the rollout server answered {url} with {e.code}: {e.read().decode(errors='replace')[:500]}"
                       ) from None
    except (OSError, http.client.HTTPException) as e:  # refused, reset, or silent past the timeout
        raise no_answer(url, e, timeout) from None
    try:
        return json.loads(data)
    except ValueError:
        return {"text": data.decode(errors="replace")}


def no_answer(url: str, e: Exception, timeout: float) -> RunError:
    """A request to `url` that got no answer: silent past the timeout (rollout.server.timeout_s), refused, reset."""
    silent = isinstance(e, TimeoutError) or "Timeout" in type(e).__name__ or "timed out" in str(e)
    return RunError(f"the rollout server at {url}: " + (f"no answer within rollout.server.timeout_s={timeout:g} s"
                                                        if silent else f"{type(e).__name__}: {e}"))


def check_server(cfg) -> None:
    """rollout.KIND_CHECKS' line, before any model loads: rollout.server.url, where set, is an http(s) address where
    a server answers GET /v1/models (within rollout.server.timeout_s) and serves a model; rollout.server.cpus, where
    set, lists cores this process may run on."""
    s = cfg.rollout.server
    if s.url:
        if not s.url.startswith(("http://", "https://")):
            raise ConfigError(f"rollout.server.url={s.url!r} has no scheme: write it as http://{s.url} (or https://)")
        served_model(s.url.rstrip("/"), s.timeout_s)
    if s.cpus:
        cores, here = cpu_list(s.cpus), os.sched_getaffinity(0)
        if not cores or not cores <= here:
            raise ConfigError(f"rollout.server.cpus={s.cpus!r} names core(s) {sorted(cores - here)} that this process "
                              f"cannot run on (it may use {sorted(here)})")


def served_model(url: str, timeout: float) -> str:
    """The first model the server at `url` serves (GET /v1/models), or a ConfigError naming rollout.server.url and
    what it answered."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as reply:
            answer = reply.read()
    except (OSError, http.client.HTTPException) as e:
        why = str(no_answer(url, e, timeout)).removeprefix(f"the rollout server at {url}: ")
        raise ConfigError(f"rollout.server.url={url}: {why}; start one (python -m vllm.entrypoints.openai.api_server "
                          f"--model …) or leave the key null") from None
    try:
        models = [m["id"] for m in json.loads(answer)["data"]]
    except (ValueError, KeyError, TypeError) as e:
        models = e
    if not isinstance(models, list) or not models:
        raise ConfigError(f"rollout.server.url={url}: GET /v1/models answered {answer[:200]!r}, not a list of models "
                          f"as vLLM's server answers: is it vLLM's OpenAI-compatible server?")
    return models[0]


def read_choices(url: str, answer: dict, n: int, vocab_size: int) -> list[tuple[list[int], list[float]]]:
    """A /v1/completions answer → its `n` choices (token ids, their log-probs) in index order; a RunError naming the
    server and what it answered unless it is what vLLM answers: `n` choices, each with token_ids (ints in
    [0, vocab_size)) and as many logprobs.token_logprobs (numbers)."""
    def refuse(what):
        raise RunError(f"the rollout server at {url} answered a completion with {what} (answer: {str(answer)[:300]}); "
                       f"rollout.name=server needs vLLM's OpenAI-compatible server (return_token_ids, logprobs)")
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        refuse(f"{len(choices) if isinstance(choices, list) else 'no list of'} choices for n={n}")
    got = []
    for c in sorted((c if isinstance(c, dict) else {} for c in choices),
                    key=lambda c: c.get("index") if type(c.get("index")) is int else 0):
        tokens, logprobs = c.get("token_ids"), c.get("logprobs")
        logprobs = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            refuse("a choice without a list of token_ids")
        if not all(0 <= t < vocab_size for t in tokens):
            refuse(f"token ids outside the policy's vocabulary of {vocab_size} "
                   f"({[t for t in tokens if not 0 <= t < vocab_size][:5]})")
        if not isinstance(logprobs, list) or len(logprobs) != len(tokens) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in logprobs):
            refuse("a choice without one number in logprobs.token_logprobs per token")
        got.append((tokens, logprobs))
    return got


class Client:
    """Completions and weight pushes against one server, each request given `timeout` seconds. `complete` sends one
    request per prompt, at most `max_concurrency` at a time, and returns each request's choices (token ids,
    log-probs; read_choices) in prompt order."""

    def __init__(self, url: str, max_concurrency: int, timeout: float, vocab_size: int):
        self.url, self.max_concurrency = url.rstrip("/"), max_concurrency
        self.timeout, self.vocab_size = timeout, vocab_size
        self.base = served_model(self.url, timeout)

    def complete(self, requests: list[dict]) -> list[list[tuple[list[int], list[float]]]]:
        return asyncio.run(self.complete_all(requests))  # in the calling thread: nothing left running after a stop

    async def complete_all(self, requests: list[dict]) -> list:
        import httpx

        limit, url = asyncio.Semaphore(self.max_concurrency), f"{self.url}/v1/completions"
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            async def one(body):
                async with limit:
                    try:
                        reply = await client.post(url, json=body)
                    except httpx.HTTPError as e:
                        raise no_answer(url, e, self.timeout) from None
                if reply.status_code >= 400:
                    raise RunError(f"the rollout server answered {url} with {reply.status_code}: {reply.text[:500]}")
                try:
                    answer = reply.json()
                except ValueError:
                    answer = reply.text
                return read_choices(self.url, answer, body["n"], self.vocab_size)
            return await asyncio.gather(*(one(body) for body in requests))

    def load_adapter(self, name: str, folder: str, previous: str = None) -> None:
        post(f"{self.url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder}, self.timeout)
        if previous:  # its slot is needed, and nothing generates between two pushes
            post(f"{self.url}/v1/unload_lora_adapter", {"lora_name": previous}, self.timeout)

    def reload_weights(self, folder: str) -> None:
        post(f"{self.url}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}},
             self.timeout)
        post(f"{self.url}/reset_prefix_cache", {}, self.timeout)  # cached prefixes hold the old weights' keys, values


def save_weights(weights: Iterator, folder: str, shard_bytes: int = 2 << 30) -> None:
    """(name, tensor) pairs into folder/model-<i>.safetensors, a shard at a time (at most `shard_bytes` held)."""
    os.makedirs(folder, exist_ok=True)
    shard, size, index = {}, 0, 0
    for name, w in weights:
        shard[name], size = w.detach().contiguous().cpu(), size + w.numel() * w.element_size()
        if size >= shard_bytes:
            save_file(shard, os.path.join(folder, f"model-{index:05d}.safetensors"))
            shard, size, index = {}, 0, index + 1
    if shard or index == 0:
        save_file(shard, os.path.join(folder, f"model-{index:05d}.safetensors"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_list(spec: str) -> set[int]:
    """taskset's list ("1", "0,2", "2-3") → the set of cores; a ConfigError naming rollout.server.cpus."""
    try:
        cores = set()
        for part in spec.split(","):
            low, _, high = part.partition("-")
            cores |= set(range(int(low), int(high or low) + 1))
        return cores
    except ValueError:
        raise ConfigError(f"rollout.server.cpus={spec!r} is not a list of cores such as 1, 0,2 or 2-3") from None


def server_command(cfg, port: int, dtype: torch.dtype, kv_bytes: int) -> list[str]:
    """The child's command line: model.path served as SERVED_NAME, the sampled distribution's log-probs
    (processed_logprobs, as VLLMRollout), vLLM's sampling defaults rather than the model's generation_config."""
    ro = cfg.rollout
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model.path,
           "--tokenizer", cfg.model.tokenizer_path or cfg.model.path, "--served-model-name", SERVED_NAME,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", str(dtype).removeprefix("torch."),
           "--max-model-len", str(cfg.data.max_prompt_length + ro.max_response_length), "--seed", str(cfg.trainer.seed),
           "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching", "--generation-config", "vllm"]
    cmd += ["--enforce-eager"] if ro.enforce_eager else []
    cmd += ["--trust-remote-code"] if cfg.model.trust_remote_code else []
    if cfg.model.lora_rank and cfg.rollout.server.lora_push == "adapter":
        cmd += ["--enable-lora", "--max-lora-rank", str(cfg.model.lora_rank), "--max-loras", "1"]
    if torch.cuda.is_available() or ro.server.devices:
        return cmd + ["--gpu-memory-utilization", str(ro.gpu_memory_utilization)]
    return cmd + ["--kv-cache-memory-bytes", str(kv_bytes), "--max-num-seqs", "256"]


def die_with_parent(cores: set) -> None:
    """In the child, before it runs: its cores, and SIGTERM when this process dies, even by SIGKILL (Linux)."""
    if cores:
        os.sched_setaffinity(0, cores)
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """The server as this run's child, in its own process group (vLLM's engine runs in a grandchild): started on a
    free port, waited for, and stopped with the run on every exit path (stop() at exit, error and signal included;
    the kernel's parent-death signal where the run itself is killed)."""

    def __init__(self, cfg, dtype: torch.dtype, kv_bytes: int, log_path: str):
        s, port = cfg.rollout.server, free_port()
        cores = cpu_list(s.cpus) if s.cpus else set()
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
                   VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", cfg.rollout.vllm_log_level))
        if cores:  # vLLM's CPU backend binds its OpenMP threads itself: to these cores
            env.update(OMP_NUM_THREADS=str(len(cores)), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, sorted(cores))))
        if s.devices:
            env["CUDA_VISIBLE_DEVICES"] = s.devices
        self.url, self.log_path = f"http://127.0.0.1:{port}", log_path
        with open(log_path, "a") as log:
            self.proc = subprocess.Popen(server_command(cfg, port, dtype, kv_bytes), stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         preexec_fn=lambda: die_with_parent(cores))
        atexit.register(self.stop)
        self.wait_until_ready(s.start_timeout_s)

    def wait_until_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ConfigError(f"the rollout server exited with {self.proc.returncode} while starting; its log "
                                  f"{self.log_path} ends: {tail(self.log_path)}")
            try:
                urllib.request.urlopen(f"{self.url}/v1/models", timeout=2)
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ConfigError(f"the rollout server did not answer within rollout.server.start_timeout_s="
                                      f"{timeout:g} s; see {self.log_path}") from None
                time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the child's group (the engine's process too), SIGKILL after 30 s."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break


def tail(path: str, chars: int = 1500) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


class ServerRollout:
    """A vLLM OpenAI-compatible server in its own process (rollout_kinds/server.py): this run's child on rollout.server's
    cores or devices, or the one at rollout.server.url. Every process sends its own prompts, one request each;
    sync_weights gathers the actor on every process (FSDP2) and rank 0 pushes it through a folder the server reads:
    a LoRA actor's adapter, loaded under a new name each time, or the full weights (a LoRA actor's merged, with
    rollout.server.lora_push=merged), reloaded in place. The sampler's logprobs are processed_logprobs, as
    VLLMRollout's (a server at rollout.server.url must be started so)."""
    gives_logprobs, runs_apart = True, True

    def __init__(self, cfg, model, tokenizer, accelerator):
        from accelerate.utils import broadcast_object_list

        self.cfg, self.accelerator, self.unwrap = cfg.rollout, accelerator, accelerator.unwrap_model
        self.pad_id, self.eos_ids = tokenizer.pad_token_id, eos_ids_of(tokenizer, self.unwrap(model))
        self.push_adapter = cfg.model.lora_rank > 0 and cfg.rollout.server.lora_push == "adapter"  # else: full weights
        self.rank = accelerator.process_index
        dtype = cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype  # auto: as the trainer computes
        self.dtype = autocast_dtype(dtype) or torch.float32
        self.folder, self.pushes, self.process = os.path.join(cfg.trainer.output_dir, "rollout_weights"), 0, None
        url = [cfg.rollout.server.url, f"policy-{os.getpid()}"]  # the url and this run's adapter names, from rank 0
        if accelerator.is_main_process and not url[0]:
            kv_bytes = kv_cache_bytes(self.unwrap(model).config, 256 * (cfg.data.max_prompt_length +
                                                                         cfg.rollout.max_response_length), self.dtype)
            self.process = ServerProcess(cfg, self.dtype, kv_bytes, os.path.join(cfg.trainer.output_dir,
                                                                                  "rollout_server.log"))
            url[0] = self.process.url
        broadcast_object_list(url)
        self.client = Client(url[0], cfg.rollout.server.max_concurrency, cfg.rollout.server.timeout_s,
                             self.unwrap(model).config.vocab_size)
        self.adapter = url[1]
        self.model_name = self.client.base
        self.sync_weights(model)  # so that a LoRA or resumed actor is what it samples from

    def generate(self, rows: list[dict], n: int, temperature: float, seed: Optional[int] = None) -> Rollout:
        cfg, greedy = self.cfg, temperature == 0
        prompts, budgets = prompts_and_budgets(rows, cfg.max_response_length)
        requests = [dict(model=self.model_name, prompt=p, n=1 if greedy else n, temperature=temperature,
                         top_p=cfg.top_p, top_k=max(cfg.top_k, 0), max_tokens=budget,
                         stop_token_ids=sorted(self.eos_ids), min_tokens=budget if cfg.ignore_eos else 0,  # as HF's
                         logprobs=0, seed=prompt_seed, return_token_ids=True, skip_special_tokens=False)
                    for p, budget, prompt_seed in zip(prompts, budgets, prompt_seeds(seed, self.rank, len(prompts)))]
        responses, logprobs = [], []
        for choices in self.client.complete(requests):  # in prompt order; row i·n + j = sample j of prompt i
            for tokens, token_logprobs in choices * n if greedy else choices:  # greedy: n = 1, the n rows agree
                tokens = cut_at_eos(tokens, self.eos_ids)
                responses.append(tokens)
                logprobs.append(token_logprobs[:len(tokens)])
        responses, response_mask = right_pad(responses, self.pad_id)  # (B·n, Tr) each
        logprobs, _ = right_pad(logprobs, 0.0, dtype=torch.float32)  # (B·n, Tr)
        return Rollout(responses, response_mask, logprobs)

    @torch.no_grad()
    def sync_weights(self, model, version: int = 0) -> None:
        """The actor's weights through a new folder (every process gathers, rank 0 writes and posts), then a barrier:
        no process samples before the server holds them."""
        model, self.pushes = self.unwrap(model), self.pushes + 1
        old, folder = os.path.join(self.folder, str(self.pushes - 1)), os.path.join(self.folder, str(self.pushes))
        full = ((k, w.to(self.dtype)) for k, w in policy_weights(model))  # a LoRA actor's merged: W + s·B·A
        weights = adapter_weights(model) if self.push_adapter else full
        if self.accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)  # the server reads every *.safetensors there
            if self.push_adapter:  # small: one file, where PEFT (and so vLLM) looks for it
                os.makedirs(folder, exist_ok=True)
                save_file(dict(weights), os.path.join(folder, "adapter_model.safetensors"))
                model.peft_config[model.active_adapter].save_pretrained(folder)
                self.client.load_adapter(self.adapter_name(self.pushes), folder,
                                         previous=self.pushes > 1 and self.adapter_name(self.pushes - 1))
            else:
                save_weights(weights, folder)
                self.client.reload_weights(folder)
            shutil.rmtree(old, ignore_errors=True)  # the previous push's, once the server has read this one
        else:
            for _ in weights:  # the gathers are collectives: every process walks the weights
                pass
        self.model_name = self.adapter_name(self.pushes) if self.push_adapter else self.client.base
        self.accelerator.wait_for_everyone()

    def adapter_name(self, push: int) -> str:
        """A new name per push (and per run): vLLM keys its prefix cache by adapter, so none is reused."""
        return f"{self.adapter}-{push}"

    def close(self) -> None:
        """The child stops; a server at rollout.server.url drops this run's adapter. The weight folders go."""
        if self.process is not None:
            self.process.stop()
        elif self.push_adapter and self.accelerator.is_main_process:
            post(f"{self.client.url}/v1/unload_lora_adapter", {"lora_name": self.model_name}, self.client.timeout)
        if self.accelerator.is_main_process:
            shutil.rmtree(self.folder, ignore_errors=True)
