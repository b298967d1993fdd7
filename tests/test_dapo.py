"""DAPO as verl runs it: dynamic sampling (``algorithm.filter_groups``) against verl's DAPO
trainer loop on stub worker groups whose answers are scheduled, the overlong reward shaping
(``reward_model.overlong_buffer``) against verl's DAPO reward manager, and the trainer feeding
the loop more prompt batches."""

import numpy as np
import pytest

import jaxflow.algos as algos
import jaxflow.iterations as iterations
from jaxflow.configs import load_config
from jaxflow.data.batch import Batch
from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.iterations import dynamic_sampling, steps
from jaxflow.rewards import OverlongBuffer, token_level_scores
from jaxflow.workers import RuleRewardWorker, Workers
from tests.verl_reference import ref_dapo_reward, ref_dynamic_sampling, ref_kept_traj_idxs

TOKENIZER = CharTokenizer()
B, N, R = 4, 3, 5  # prompts per generation batch, samples per prompt, response length
RIGHT, WRONG = 5, 7  # the stub's answer tokens


class ScheduledActor:
    """An actor group whose answers are scheduled: in its ``g``-th generation batch, sample
    ``j`` of prompt ``i`` is right when ``right_GxBxN[g, i, j]``; a right answer is one token
    longer, so ``seq_reward`` and ``acc`` differ. Records its calls."""

    def __init__(self, right_GxBxN, seed=0):
        self.right = right_GxBxN
        self.rng = np.random.default_rng(seed)
        self.offsets, self.log_prob_rows, self.updates = [], [], []

    def generate(self, prompts, sampling="train", step=None, prompt_offset=0):
        right = self.right[len(self.offsets)].reshape(-1)
        self.offsets.append(prompt_offset)
        uid = [f"{step}:{prompt_offset + i}" for i in range(len(prompts))]
        lengths = np.where(right, 3, 2)
        mask = (np.arange(R)[None, :] < lengths[:, None]).astype(np.int32)
        responses = np.where(right, RIGHT, WRONG)[:, None] * mask
        return (
            prompts.update(non_tensors={"uid": uid})
            .repeat(N)
            .update(tensors={"responses": responses.astype(np.int32), "response_mask": mask})
        )

    def generation_seconds(self):
        return [{}]

    def log_probs(self, batch):
        self.log_prob_rows.append(len(batch))
        mask = batch["response_mask"]
        return Batch.from_dict({"old_log_probs": (self.rng.normal(size=mask.shape) * 0.1 * mask).astype(np.float32)})

    def update(self, batch, step=None):
        self.updates.append(batch)
        return {"actor/pg_loss": 0.0}


class StubRef:
    def log_probs(self, batch):
        mask = batch["response_mask"]
        return Batch.from_dict({"ref_log_prob": (-0.5 * mask).astype(np.float32)})


def acc_reward(batch):
    """Scores a right answer 1 plus a quarter of its length (so seq_reward varies with the length;
    quarters keep a group's equal values' std exactly 0), and reports ``acc``."""
    mask = np.asarray(batch["response_mask"])
    acc = (np.asarray(batch["responses"])[:, 0] == RIGHT).astype(np.float32)
    scores = acc + mask.sum(-1) / 4
    return Batch.from_dict({"token_level_scores": token_level_scores(scores, mask)}, {"reward_extra/acc": acc})


def prompt_batches():
    counter = iter(range(1000))

    def batch():
        first = next(counter) * B
        return Batch.from_dict(
            {"prompt_ids": np.full((B, 2), first, np.int32), "prompt_mask": np.ones((B, 2), np.int32)}
        )

    return batch


def settings(metric="acc", max_num_gen_batches=0, use_kl_in_reward=False):
    return algos.AlgorithmSettings(
        algos.AlgorithmConfig(
            adv_estimator="grpo",
            use_kl_in_reward=use_kl_in_reward,
            filter_groups=algos.FilterGroupsConfig(True, metric, max_num_gen_batches),
        )
    )


def schedule(seed, G=8):
    """Answers of ``G`` generation batches in which about half the groups are all right or all
    wrong."""
    rng = np.random.default_rng(seed)
    uniform = rng.random((G, B, 1)) < 0.5
    return np.where(uniform, rng.random((G, B, 1)) < 0.5, rng.random((G, B, N)) < 0.5)


def gen_batches(right, metric):
    """Each generation batch's ``(uids, metric values)`` as verl's trainer sees them."""
    out = []
    for g in range(len(right)):
        flat = right[g].reshape(-1)
        values = flat.astype(float) if metric == "acc" else flat + np.where(flat, 3, 2) / 4  # acc_reward's
        out.append(([f"7:{g * B + i // N}" for i in range(B * N)], list(values)))
    return out


def reference(right, metric, max_num_gen_batches=0):
    """verl's loop over the same generation batches: kept ``(g, row)`` and the batches used."""
    return ref_dynamic_sampling(gen_batches(right, metric), B, N, max_num_gen_batches)


@pytest.mark.parametrize("metric", ["acc", "seq_reward"])
@pytest.mark.parametrize("use_kl_in_reward", [False, True])
def test_dynamic_sampling_keeps_the_groups_verl_keeps(metric, use_kl_in_reward):
    right = schedule(seed=3 + use_kl_in_reward)
    actor = ScheduledActor(right)
    w = Workers(actor=actor, ref=StubRef(), critic=None, reward=acc_reward)
    s = settings(metric, use_kl_in_reward=use_kl_in_reward)
    kl_ctrl = algos.get_kl_controller(s.algorithm.kl_ctrl) if use_kl_in_reward else None
    more = prompt_batches()
    batch, metrics = dynamic_sampling.sample_groups(
        w, more(), more, s, kl_ctrl, steps.StepTimer(), step=7, old_log_probs=use_kl_in_reward
    )
    kept, used = reference(right, metric)
    assert used > 1  # the schedule makes it sample more than one batch
    assert actor.offsets == [g * B for g in range(used)]  # each batch's prompts continue the step's ids
    assert list(batch["uid"]) == [f"7:{g * B + i // N}" for g, i in kept]
    np.testing.assert_array_equal(
        batch["responses"][:, 0], [RIGHT if right[g].reshape(-1)[i] else WRONG for g, i in kept]
    )
    # the prompts travel with their samples (the stub's prompt ids hold the batch's first prompt id)
    np.testing.assert_array_equal(batch["prompt_ids"][:, 0], [g * B for g, _ in kept])
    groups_kept = [ref_kept_traj_idxs(*gen)[1] for gen in gen_batches(right, metric)[:used]]
    assert metrics["train/num_gen_batches"] == used
    assert metrics["training/filter_groups/evicted_samples"] == used * B - sum(groups_kept)
    assert metrics["training/filter_groups/discarded_surplus_samples"] == sum(groups_kept) - B
    # the log-probs are scored on the kept batch only, unless the in-reward KL needs them first
    assert actor.log_prob_rows == ([B * N] * used if use_kl_in_reward else [])
    assert "ref_log_prob" in batch and len(batch) == B * N
    if use_kl_in_reward:
        assert "token_level_rewards" in batch and "actor/reward_kl_penalty" in metrics


def test_exhausted_generation_budget_is_verls_error():
    right = np.zeros((4, B, N), bool)
    right[1, 0, 0] = True  # one group with signal in 4 batches
    with pytest.raises(ValueError, match="Generated too many"):
        reference(right, "acc", max_num_gen_batches=3)
    w = Workers(actor=ScheduledActor(right), ref=None, critic=None, reward=acc_reward)
    more = prompt_batches()
    with pytest.raises(ValueError, match=r"gen_batches=3 >= max_num_gen_batches=3: 1 of the 4 prompt groups"):
        dynamic_sampling.sample_groups(w, more(), more, settings(max_num_gen_batches=3), None, steps.StepTimer())


def test_an_unreported_metric_is_named():
    w = Workers(actor=ScheduledActor(schedule(0)), ref=None, critic=None, reward=acc_reward)
    more = prompt_batches()
    with pytest.raises(KeyError, match=r"metric='score': the reward reported no such value; it reported \['acc'\]"):
        dynamic_sampling.sample_groups(w, more(), more, settings("score"), None, steps.StepTimer())


def test_ppo_iteration_trains_on_the_filtered_batch():
    right = schedule(seed=5)
    actor = ScheduledActor(right)
    w = Workers(actor=actor, ref=None, critic=None, reward=acc_reward)
    more = prompt_batches()
    metrics = iterations.ppo_iteration(w, more(), settings(), step=7, next_prompts=more)
    kept, used = reference(right, "acc")
    [trained] = actor.updates
    assert list(trained["uid"]) == [f"7:{g * B + i // N}" for g, i in kept]
    # GRPO's advantages of groups with signal: no group is all zeros
    adv = np.asarray(trained["advantages"])[:, 0].reshape(B, N)
    assert np.all(np.abs(adv).sum(axis=1) > 0)
    assert metrics["train/num_gen_batches"] == used
    with pytest.raises(ValueError, match="needs next_prompts"):
        iterations.ppo_iteration(w, more(), settings(), step=8)


def test_overlong_shaping_is_verls_dapo_reward_manager():
    """The rule scorer with the overlong buffer: each response's reward is verl's DAPO reward
    manager's (the score plus min(-(l - (L_max - L_cache)) / L_cache * factor, 0), l counting
    EOS), on its last token; ``acc`` is the function's own score, ``overlong_reward`` and
    ``overlong`` are reported with ``log``."""
    L_max, buffer, factor = 8, 3, 0.7
    texts = ["5", "12", "5x", "5xxxx", "5xxxxx", "5xxxxxx"]  # 2..8 tokens with EOS
    truths = ["5", "12", "5", "5", "5", "7"]
    ids = np.full((len(texts), L_max), TOKENIZER.pad_token_id, np.int32)
    mask = np.zeros_like(ids)
    for i, t in enumerate(texts):
        tok = TOKENIZER.encode(t, add_special_tokens=False)[: L_max - 1] + [TOKENIZER.eos_token_id]
        ids[i, : len(tok)], mask[i, : len(tok)] = tok, 1
    batch = Batch.from_dict(
        {"responses": ids, "response_mask": mask},
        {"data_source": ["jaxflow/addition"] * len(texts), "ground_truth": truths},
    )
    plain = RuleRewardWorker(TOKENIZER).scores(batch)[0]
    worker = RuleRewardWorker(TOKENIZER, overlong=OverlongBuffer(buffer, factor, L_max, log=True))
    out, metrics = worker.scores(batch)
    acc = np.asarray(plain["token_level_scores"]).sum(-1)
    assert acc.tolist() == [1, 1, 0, 0, 0, 0]  # the addition task's exact-match score
    want = [ref_dapo_reward(a, int(m.sum()), L_max, buffer, factor) for a, m in zip(acc, mask)]
    got = np.asarray(out["token_level_scores"])
    np.testing.assert_allclose(got.sum(-1), [w[0] for w in want], rtol=1e-6)
    last = mask.sum(-1) - 1
    np.testing.assert_array_equal(got, token_level_scores(got[np.arange(len(texts)), last], mask))  # on the last token
    np.testing.assert_array_equal(out["reward_extra/acc"], acc)
    np.testing.assert_allclose(out["reward_extra/overlong_reward"], [w[1] for w in want], rtol=1e-6)
    np.testing.assert_array_equal(out["reward_extra/overlong"], [w[1] < 0 for w in want])
    assert sum(w[1] < 0 for w in want) == 3  # 6, 7 and 8 tokens are in the buffer
    assert metrics["reward/mean"] == pytest.approx(acc.mean())  # the scorer's, before shaping


@pytest.mark.parametrize("length,limit,words", [(0, 8, "must be positive"), (9, 8, "exceeds the response length 8")])
def test_overlong_buffer_refuses_what_verl_asserts(length, limit, words):
    with pytest.raises(ValueError, match=words):
        OverlongBuffer(length, 1.0, limit)


# A random policy's first character is a digit one time in ten: about 0.9^8 = 43% of the groups
# of 8 samples hold no digit (no signal), the others some.
FIRST_DIGIT = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str[:1].isdigit())
"""


def test_the_trainer_feeds_dynamic_sampling_more_prompt_batches(tmp_path):
    """dapo_tiny (tiny random model, 2 steps, a reward with signal for it): each step logs its
    generation batches and the groups it dropped, and the data loader moved on by exactly the
    batches sampled."""
    from jaxflow.trainer.rl import RLTrainer

    reward = tmp_path / "first_digit.py"
    reward.write_text(FIRST_DIGIT)
    cfg = load_config(
        "dapo_tiny",
        [
            f"custom_reward_function.path={reward}",
            "jaxflow.placement.type=colocated",
            "jaxflow.model.num_layers=1",
            "jaxflow.model.hidden_size=64",
            "jaxflow.model.intermediate_size=128",
            "jaxflow.sft.warm_start_steps=0",
            "trainer.total_training_steps=2",
            "trainer.test_freq=-1",
            "trainer.val_before_train=False",
            "trainer.logger=['console']",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "jaxflow.data.num_train_examples=256",
            "jaxflow.data.num_val_examples=8",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    trainer = RLTrainer(cfg)
    try:
        rows = [trainer.train_step(step) for step in (1, 2)]
    finally:
        trainer.scorer.close()
        trainer.close()
    batches = sum(r["train/num_gen_batches"] for r in rows)
    assert batches > 2 and sum(r["training/filter_groups/evicted_samples"] for r in rows) > 0
    assert trainer.loader.index == batches * 8
    for r in rows:
        kept = r["train/num_gen_batches"] * 8 - r["training/filter_groups/evicted_samples"]
        assert kept - r["training/filter_groups/discarded_surplus_samples"] == 8
        assert np.isfinite(r["actor/pg_loss"])
