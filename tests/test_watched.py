"""Every guard watches what it says it watches, and a rollback knows which way is better.

The trainer.max_kl guard reads kl/mean, k1 to the reference, which is computed for it whatever the KL terms (a run
with algorithm.use_kl_loss=false used to average zeros); trainer.max_kl=0 runs no reference forward. Each guard or
rollback metric whose input a configuration would leave absent is refused at start-up in one sentence naming the key.
val/perplexity is the policy's perplexity of held-out reference text (data.val_reference), and trainer.best_metric
rolls back on it downwards (lower is better), against its best or against the pre-trained value.
"""
import json
import math
import os
import re

import pytest
import torch

from conftest import make_tiny_model, read_metrics, REPO
from infra import cli
from infra.config import ConfigError
from test_faults import no_model_loads  # noqa: F401 (a fixture)
from test_ppo import checkpoint_tensors, REWARD_FILE, run_ppo, workdir  # noqa: F401 (workdir is a fixture)
from test_recovery import OneProcess


def config(*overrides):
    return cli.load_config(f"{REPO}/configs.yaml", list(overrides))


# ---- the KL guard without a KL term


def test_the_kl_guard_watches_a_run_without_a_kl_term_and_stops_it(workdir, tmp_path):  # noqa: F811
    """GRPO with algorithm.use_kl_loss=false and a learning rate that drives the tiny model away: the reference's
    log-probs are computed for the guard (time/ref_s), kl/mean is in every step's row, start-up names the guard in one
    line, and the run stops on trainer.max_kl with its sentence before trainer.total_steps."""
    out = tmp_path / "watched"
    proc = run_ppo(workdir, out, "algorithm.use_kl_loss=false", "actor.optim.lr=0.05", "trainer.total_steps=4",
                   "trainer.max_kl=0.02", "trainer.max_kl_window=1", "trainer.test_freq=0", "trainer.save_freq=0")
    steps = [line for line in read_metrics(out) if line["step"] > 0]
    assert all("kl/mean" in line and "time/ref_s" in line for line in steps), steps
    assert "guards: kl/mean (k1 to the reference, computed each step) over 1 steps > 0.02 stops" in proc.stdout
    last = steps[-1]
    assert last["step"] < 4 and last["kl/mean"] > 0.02
    assert (f"stopping at step {last['step']}: kl/mean over the last 1 steps {last['kl/mean']:.4f} > trainer.max_kl "
            f"0.02 (checkpoint saved)") in proc.stdout


def test_max_kl_0_without_a_kl_term_runs_no_reference_forward(workdir, tmp_path):  # noqa: F811
    """trainer.max_kl=0 and no KL term: step 4 skips the reference pass (its timer time/ref_s never runs), so no
    kl/mean either; start-up says that no guard is on."""
    out = tmp_path / "unwatched"
    proc = run_ppo(workdir, out, "algorithm.use_kl_loss=false", "trainer.total_steps=2", "trainer.test_freq=0",
                   "trainer.save_freq=0")
    steps = [line for line in read_metrics(out) if line["step"] > 0]
    assert len(steps) == 2 and not any("time/ref_s" in line or "kl/mean" in line for line in steps)
    assert "guards: none (trainer.max_kl, min_entropy, best_metric are off)" in proc.stdout


def test_a_full_fine_tune_loads_a_reference_for_the_guard_alone():
    """Without LoRA the reference is a frozen copy (with LoRA the adapter-off actor): needs_reference, which
    load_models and step 4 both read, is true for the guard alone and false only with no KL term and max_kl=0."""
    from infra.checks import needs_reference
    assert needs_reference(config("algorithm.use_kl_loss=false", "model.lora_rank=0"))  # max_kl 0.1, the default
    assert not needs_reference(config("algorithm.use_kl_loss=false", "trainer.max_kl=0"))
    assert needs_reference(config("algorithm.use_kl_loss=false", "algorithm.use_kl_in_reward=true", "trainer.max_kl=0"))


def test_the_entropy_guard_reads_an_entropy_every_update_computes():
    """policy/entropy comes from every actor update (ActorLoss's forward with_entropy=True, whatever
    actor.entropy_coef), so trainer.min_entropy is never blind: below it the guard warns or stops, as
    min_entropy_action says."""
    import ppo
    from infra.train_state import TrainState
    from kl import KLController
    from losses import Counts

    class Uniform:  # the Forward of a policy uniform over 5 tokens: entropy log 5 at every position
        def logprobs(self, policy, micro, with_entropy=False):
            assert with_entropy
            return torch.full((1, 3), -math.log(5)), torch.full((1, 3), math.log(5))
    loss = ppo.ActorLoss.from_config(config("actor.entropy_coef=0", "algorithm.use_kl_loss=false"), Uniform())
    micro = {"loss_mask": torch.ones(1, 3), "advantages": torch.zeros(1, 3), "response_mask": torch.ones(1, 3)}
    _, metrics = loss(None, micro, Counts(3.0, 1.0))
    assert metrics["policy/entropy"] == pytest.approx(math.log(5))
    said, message = [], f"policy/entropy {math.log(5):.4f} < trainer.min_entropy 2.0"
    for action, stop in (("warn", None), ("stop", message)):
        t = config("trainer.min_entropy=2.0", f"trainer.min_entropy_action={action}", "trainer.max_kl=0").trainer
        assert ppo.guards(t, TrainState(KLController("fixed", 0.1, 6.0, 10000), {}), metrics, warn=said.append) == stop
    assert said == ["warning: " + message]


# ---- refused at start-up: a rollback or best metric whose input would be absent


@pytest.mark.parametrize("overrides, sentence", [
    (["trainer.best_metric=val/score/mean", "trainer.rollback_tolerance=0.1", "trainer.test_freq=0"],
     "trainer.rollback_tolerance acts at a validation during training, and trainer.test_freq=0 validates only after "
     "the last step: set trainer.test_freq > 0"),
    (["trainer.best_metric=val/perplexity", "trainer.rollback_baseline=pretrained", "trainer.rollback_tolerance=1",
      "trainer.val_before_train=false"],
     "trainer.rollback_baseline=pretrained compares each validation with the one before training: set "
     "trainer.rollback_tolerance and trainer.val_before_train=true"),
    (["trainer.best_metric=val/perplexity", "trainer.rollback_baseline=pretrained"],
     "trainer.rollback_baseline=pretrained compares each validation with the one before training: set "
     "trainer.rollback_tolerance and trainer.val_before_train=true"),
    (["trainer.best_metric=val/perplexity", "data.val_files=null"],
     "trainer.best_metric=val/perplexity needs validation: set data.val_files"),
], ids=["rollback, no validation during training", "pretrained baseline, no validation before",
        "pretrained baseline, no tolerance", "best metric, no validation data"])
def test_a_rollback_without_its_input_is_refused(overrides, sentence):
    """A rollback that could never act, or act against a value never measured, fails before anything loads."""
    from infra.checks import check_combinations
    with pytest.raises(ConfigError) as e:
        check_combinations(config(*overrides))
    assert str(e.value) == sentence


@pytest.fixture(scope="module")
def answered(tmp_path_factory):
    """A tiny model, and arithmetic train/val parquets whose rows carry extra_info.answer ("6 + 7 = 13")."""
    import data
    root = tmp_path_factory.mktemp("answered")
    make_tiny_model(root / "model")
    (root / "reward.py").write_text(REWARD_FILE)  # what run_ppo's base_args score with
    rows = data.make_arithmetic(64 + 8, seed=0, answers=True)
    data.write_parquet(rows[:64], str(root / "train.parquet"))
    data.write_parquet(rows[64:], str(root / "val.parquet"))
    data.write_parquet([{**row, "extra_info": {"index": row["extra_info"]["index"]}} for row in rows[64:]],
                       str(root / "bare.parquet"))
    data.write_parquet([{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"},
                        {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}], str(root / "pairs.parquet"))
    return root


def test_perplexity_as_best_metric_without_reference_text_is_refused(answered, tmp_path, no_model_loads):
    """trainer.best_metric=val/perplexity where no validation row has data.val_reference's field (or it is null):
    one sentence naming both keys, before any model loads."""
    import ppo
    from test_faults import ppo_config
    cfg = ppo_config(answered, tmp_path / "out", f"data.val_files={answered}/bare.parquet",
                     "trainer.best_metric=val/perplexity")
    with pytest.raises(ConfigError) as e:
        ppo.main(cfg)
    assert str(e.value) == (
        "trainer.best_metric=val/perplexity needs held-out reference text, and there is none (extra_info.answer of 0 "
        "of the 8 validation rows; set data.val_reference to a field they have, or a parquet): set "
        "data.val_reference to a field the validation rows have or to a parquet of preference pairs")


def test_the_reference_text_is_the_field_the_rows_have_or_a_preference_file(answered):
    """data.val_reference: extra_info.answer of each validation row that has it, ground_truth, or a parquet of
    preference pairs (its chosen responses, each after its own prompt); each response ends with the EOS; the names
    validation logs then include val/perplexity, and only then."""
    from data import load_prompts
    from infra.models import policy_tokenizer
    from validation import logged_names, reference_text
    cfg = config(f"model.path={answered}/model", f"data.train_files={answered}/train.parquet",
                 f"data.val_files={answered}/val.parquet")
    tokenizer = policy_tokenizer(cfg.model)
    _, val_rows = load_prompts(cfg.data, tokenizer, print)
    eos = tokenizer.eos_token_id
    answers = reference_text(cfg, val_rows, tokenizer)
    assert answers.source == "on extra_info.answer of 8 of the 8 validation rows"
    assert [r["reference_ids"] for r in answers.rows] == [
        tokenizer(row["extra_info"]["answer"], add_special_tokens=False)["input_ids"] + [eos] for row in val_rows]
    assert [r["prompt_ids"] for r in answers.rows] == [row["prompt_ids"] for row in val_rows]
    truths = reference_text(config(*[f"data.val_reference=ground_truth"]), val_rows, tokenizer)
    assert tokenizer.decode(truths.rows[0]["reference_ids"][:-1]) == val_rows[0]["ground_truth"]
    pairs = reference_text(config(f"data.val_reference={answered}/pairs.parquet"), val_rows, tokenizer)
    assert [tokenizer.decode(r["reference_ids"][:-1]) for r in pairs.rows] == ["2", "4"]
    assert not reference_text(config("data.val_reference=null"), val_rows, tokenizer).rows
    assert "val/perplexity" in logged_names(cfg, {"arithmetic"}, perplexity=True)
    assert "val/perplexity" not in logged_names(cfg, {"arithmetic"})


def test_perplexity_is_exp_of_the_mean_token_nll_over_all_references(answered):
    """held_out_perplexity equals exp(−mean log-softmax of each reference token), computed here with a plain loop
    over one sequence at a time (no padding, temperature 1 whatever rollout.temperature), micro-batches of 3."""
    import dataclasses
    from transformers import AutoModelForCausalLM
    from infra.batches import Forward
    from validation import held_out_perplexity, References
    model = AutoModelForCausalLM.from_pretrained(answered / "model").eval()
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_ids": torch.randint(3, 100, (int(q),), generator=g).tolist(),
             "reference_ids": torch.randint(3, 100, (int(r),), generator=g).tolist()} for q, r in
            [(4, 2), (6, 5), (3, 1), (5, 3), (2, 4)]]
    nll, count = 0.0, 0
    for row in rows:
        ids = torch.tensor([row["prompt_ids"] + row["reference_ids"]])
        logp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        nll -= logp[len(row["prompt_ids"]) - 1:].sum().item()
        count += len(row["reference_ids"])

    class Accelerator(OneProcess):
        process_index, device = 0, torch.device("cpu")

        def reduce(self, tensor, reduction):
            return tensor
    got = held_out_perplexity(model, Forward(0.7, None, "padded"), References(rows, 0, 3, "test"), Accelerator())
    assert got["val/perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert held_out_perplexity(model, Forward(1.0, None, "padded"), References([], 0, 3, "none"), Accelerator()) == {}
    assert dataclasses.is_dataclass(References)


# ---- a rollback in either direction


def test_lower_is_better_for_perplexities_and_losses_unless_said():
    """trainer.best_metric_mode=auto: min for a name ending in perplexity or loss, max for any other; min and max
    say it for a metric of one's own."""
    from infra.checks import lower_is_better
    for name, lower in [("val/perplexity", True), ("val/env/loss", True), ("val/score/mean", False),
                        ("val/pass@4/mean", False)]:
        assert lower_is_better(config(f"trainer.best_metric={name}").trainer) is lower
    assert lower_is_better(config("trainer.best_metric=val/env/steps", "trainer.best_metric_mode=min").trainer)
    assert not lower_is_better(config("trainer.best_metric=val/perplexity", "trainer.best_metric_mode=max").trainer)


@pytest.fixture
def keeper(tmp_path):
    """keep_best on a Linear layer after one Adam step, in an output_dir with a base fingerprint; returns
    (keep: (value, step, *overrides) → keep_best's sentence, state, layer, output_dir)."""
    from infra.train_state import keep_best, TrainState
    from kl import KLController
    from test_faults import write
    out = tmp_path / "run"
    write(out / "base_models.json", json.dumps({"model.path": {"path": "m", "fingerprint": "a" * 64}}))
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state = TrainState(KLController("fixed", 0.1, 6.0, 10000), {})

    def keep(value, step, *overrides):
        state.step = step
        cfg = cli.load_config(None, ["trainer.best_metric=val/perplexity", "trainer.rollback_tolerance=1",
                                     f"trainer.output_dir={out}", "data.val_files=v.parquet", *overrides])
        with torch.no_grad():
            layer.weight.add_(1.0)  # each validation sees weights of its own
        return keep_best(OneProcess(), cfg, {"val/perplexity": value}, state, {"policy": (layer, optimizer)})
    return keep, state, layer, out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_best_keeps_the_lowest_perplexity_and_a_rise_rolls_back(keeper):
    """val/perplexity, lower is better: the validation before training (step 0) keeps no best/; 5 then 4 become
    best/ in turn, 4.5 (within the tolerance 1 of 4) does nothing, 6 (2 above 4) rolls back to best/'s weights,
    saying so."""
    keep, state, layer, out = keeper
    assert keep(10.0, 0) is None and state.pretrained == 10.0 and not (out / "best").exists()
    assert keep(5.0, 1) is None and state.best == {"step": 1, "value": 5.0}
    assert keep(4.0, 2) is None and state.best == {"step": 2, "value": 4.0}
    at_best = layer.weight.detach().clone()
    assert keep(4.5, 3) is None and state.rollbacks == 0
    said = keep(6.0, 4)
    assert said.startswith("rollback at step 4: val/perplexity 6 rose more than trainer.rollback_tolerance 1 above "
                           "its best, 4 at step 2; best/'s weights") and state.rollbacks == 1
    assert torch.equal(layer.weight, at_best)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_worse_than_pretrained_rolls_back_to_best_or_stops_where_there_is_none(keeper):
    """trainer.rollback_baseline=pretrained: against the value before training. Worse by more than the tolerance at
    the first validation, with no best/ yet, stops the run (RunError, one sentence); later, with a best/, it rolls
    back to it."""
    from infra.runs import RunError
    keep, state, layer, out = keeper
    pre = "trainer.rollback_baseline=pretrained"
    assert keep(10.0, 0, pre) is None
    with pytest.raises(RunError) as e:
        keep(11.5, 1, pre)
    assert str(e.value) == ("stopping at step 1: val/perplexity 11.5 rose more than trainer.rollback_tolerance 1 "
                            "above its value before training, 10, and no best/ exists yet to roll back to "
                            "(trainer.rollback_baseline=pretrained); no final/ written")
    assert keep(10.5, 1, pre) is None and state.best == {"step": 1, "value": 10.5}  # worse, but within 1
    at_best = layer.weight.detach().clone()
    assert keep(10.8, 2, pre) is None and state.rollbacks == 0  # worse than best/, but within 1 of 10
    assert keep(12.0, 3, pre).startswith("rollback at step 3: val/perplexity 12 rose more than "
                                         "trainer.rollback_tolerance 1 above its value before training, 10; ")
    assert torch.equal(layer.weight, at_best) and state.rollbacks == 1


def test_a_run_whose_perplexity_rises_rolls_back_on_it(answered, tmp_path):
    """A 3-step LoRA GRPO run at 10× the tests' learning rate, validating every step with
    trainer.best_metric=val/perplexity (lower is better) and a tolerance of 0: val/perplexity is logged at every
    validation (the pre-trained value at step 0); it falls at step 2 (best/) and rises at step 3, which rolls back
    once (train/rollbacks 0, 0, 1), and the step_3 checkpoint saved after it holds exactly best/'s weights."""
    out = tmp_path / "run"
    proc = run_ppo(answered, out, "actor.optim.lr=0.01", "trainer.total_steps=3", "trainer.test_freq=1",
                   "trainer.save_freq=1", "trainer.keep_checkpoints=4", "trainer.best_metric=val/perplexity",
                   "trainer.rollback_tolerance=0", "trainer.max_rollbacks=1", "trainer.sample_freq=0")
    lines = read_metrics(out)
    perplexity = [line["val/perplexity"] for line in lines]
    assert [line["step"] for line in lines] == [0, 1, 2, 3] and all(p > 1 for p in perplexity)
    assert perplexity[2] < perplexity[1] and perplexity[3] > perplexity[2], perplexity
    assert [line["train/rollbacks"] for line in lines[1:]] == [0, 0, 1]
    assert (f"rollback at step 3: val/perplexity {perplexity[3]:.4g} rose more than trainer.rollback_tolerance 0 "
            f"above its best, {perplexity[2]:.4g} at step 2") in proc.stdout
    assert "val/perplexity: on extra_info.answer of 8 of the 8 validation rows" in proc.stdout
    with open(out / "best" / "state.json") as f:
        assert json.load(f)["best"] == {"step": 2, "value": perplexity[2]}
    best, step_3 = checkpoint_tensors(out / "best"), checkpoint_tensors(out / "step_3")
    assert best.keys() == step_3.keys() and all(torch.equal(best[k], step_3[k]) for k in best)
    assert os.path.getsize(out / "curves.png") > 1000


def test_a_run_worse_than_pretrained_with_no_best_yet_stops(answered, tmp_path):
    """trainer.rollback_baseline=pretrained: at a learning rate of 0.3 the first validation's perplexity is far
    above the pre-trained one, and no best/ exists yet: the run stops in one sentence, exit 1, without final/."""
    out = tmp_path / "run"
    proc = run_ppo(answered, out, "actor.optim.lr=0.3", "trainer.total_steps=2", "trainer.test_freq=1",
                   "trainer.best_metric=val/perplexity", "trainer.rollback_baseline=pretrained",
                   "trainer.rollback_tolerance=50", "trainer.sample_freq=0", expect_ok=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    pretrained = read_metrics(out)[0]["val/perplexity"]
    assert re.search(rf"stopping at step 1: val/perplexity [0-9.]+ rose more than trainer.rollback_tolerance 50 "
                     rf"above its value before training, {pretrained:.4g}, and no best/ exists yet", proc.stderr)
    assert not (out / "final").exists()
