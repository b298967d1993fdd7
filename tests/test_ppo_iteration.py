"""DESIGN.md's target user code, end to end on tiny random models and 8 simulated devices:
PPO (GAE, critic, in-reward KL) in two placements (all colocated; actor+ref on 4 devices and
critic+reward on the other 4) with the built-in addition task's rule reward, GRPO (no critic)
through the same program, and the batch-level glue it uses."""

import jax
import numpy as np
import pytest

import jaxflow.algos as algos
import jaxflow.iterations as iterations
import jaxflow.models as models
from jaxflow.data.batch import Batch
from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.data.tasks import get_task
from jaxflow.iterations import steps
from jaxflow.mesh import Placement
from jaxflow.rewards import RewardScorer
from jaxflow.sampling import SamplingParams
from jaxflow.workers import (
    ActorConfig,
    CriticConfig,
    OptimConfig,
    RoleSettings,
    RolloutConfig,
    RuleRewardWorker,
    Workers,
    build_local_workers,
)
from tests.verl_reference import ref_gdpo

CFG = models.get_preset("tiny_llama", vocab_size=128, num_layers=1)  # one layer: half the compile time
ROLE_MODELS = {"actor": CFG, "ref": CFG, "critic": CFG, "reward": CFG}
NUM_PROMPTS, N, PROMPT_LEN, MAX_NEW = 8, 2, 8, 8
ACTOR = ActorConfig(ppo_mini_batch_size=8, optim=OptimConfig(lr=1e-4))  # 16 responses: 2 steps
CRITIC = CriticConfig(ppo_mini_batch_size=8, optim=OptimConfig(lr=1e-4))
TOKENIZER = CharTokenizer()
ROLLOUT = RolloutConfig(
    train=SamplingParams(
        n=N, max_new_tokens=MAX_NEW, eos_token_ids=TOKENIZER.eos_token_id, pad_token_id=TOKENIZER.pad_token_id, seed=0
    )
)
PPO = algos.AlgorithmSettings(
    algos.AlgorithmConfig(
        adv_estimator="gae",
        gamma=1.0,
        lam=0.95,
        use_kl_in_reward=True,
        kl_penalty="kl",
        kl_ctrl=algos.KLControlConfig(type="adaptive", kl_coef=0.01, target_kl=0.1, horizon=100.0),
    )
)
GRPO = algos.AlgorithmSettings(algos.AlgorithmConfig(adv_estimator="grpo"))
PLACEMENTS = {
    "colocated": lambda: Placement.colocated(
        roles=("actor", "ref", "critic", "reward"),
        meshes={"actor": "dp=2,fsdp=2,tp=2"},
        gen_tp={"actor": 2},
        models=ROLE_MODELS,
    ),
    "split": lambda: Placement.split(
        groups=(("actor", "ref"), ("critic", "reward")),
        meshes={"actor": "fsdp=2,tp=2"},
        gen_tp={"actor": 2},
        models=ROLE_MODELS,
    ),
}


@pytest.fixture(scope="module")
def prompts():
    rows = get_task("addition").make_examples(NUM_PROMPTS, seed=0)
    ids = np.full((NUM_PROMPTS, PROMPT_LEN), TOKENIZER.pad_token_id, np.int32)
    mask = np.zeros_like(ids)
    for i, row in enumerate(rows):
        text = TOKENIZER.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        tokens = TOKENIZER.encode(text, add_special_tokens=False)  # "<bos>12+34="
        ids[i, PROMPT_LEN - len(tokens) :], mask[i, PROMPT_LEN - len(tokens) :] = tokens, 1
    return iterations.batch_from_prompts(
        {
            "prompt_ids": ids,
            "prompt_mask": mask,
            "data_source": [r["data_source"] for r in rows],
            "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
            "extra_info": [r["extra_info"] for r in rows],
        }
    )


@pytest.fixture(scope="module")
def modules():
    return {
        "lm": models.init_model(CFG, "lm", seed=0),
        "value": models.init_model(CFG, "value", seed=1),
        "reward": models.init_model(CFG, "reward", seed=2),
    }


@pytest.fixture(scope="module", params=sorted(PLACEMENTS))
def workers(request, modules):
    placement = PLACEMENTS[request.param]()
    # The split placement also runs a reward model (on the critic's pool) beside the rules.
    reward_model = modules["reward"] if request.param == "split" else None
    w = build_local_workers(
        placement,
        actor=modules["lm"],
        ref=modules["lm"],
        critic=modules["value"],
        reward_model=reward_model,
        rule_reward=RuleRewardWorker(TOKENIZER),
        settings=RoleSettings(actor_config=ACTOR, critic_config=CRITIC, rollout=ROLLOUT),
    )
    return request.param, placement, w


def _assert_finite(metrics):
    bad = {k: v for k, v in metrics.items() if not np.isfinite(v)}
    assert not bad, bad


@pytest.mark.slow
def test_ppo_iteration(workers, prompts):
    name, placement, w = workers
    actor0 = jax.device_get(w.actor.worker.params)
    critic0 = jax.device_get(w.critic.worker.params)
    kl_ctrl = algos.get_kl_controller(PPO.algorithm.kl_ctrl)
    for _ in range(2):
        metrics = iterations.ppo_iteration(w, prompts, PPO, kl_ctrl)
        _assert_finite(metrics)
    expected = {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "actor/update_skipped",
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/grad_norm",
        "critic/vpred_mean",
        "actor/reward_kl_penalty",
        "critic/score/mean",
        "critic/advantages/mean",
        "response_length/mean",
        "reward/mean",
        "reward/source/jaxflow/addition/mean",
    }
    assert expected <= metrics.keys(), expected - metrics.keys()
    assert metrics["actor/update_skipped"] == 0 and metrics["critic/update_skipped"] == 0
    assert 1 <= metrics["response_length/mean"] <= MAX_NEW
    assert kl_ctrl.value != PPO.algorithm.kl_ctrl.kl_coef  # the adaptive controller moved
    for before, group in ((actor0, w.actor), (critic0, w.critic)):
        moved = max(
            np.abs(np.asarray(a) - np.asarray(b)).max()
            for a, b in zip(jax.tree.leaves(jax.device_get(group.worker.params)), jax.tree.leaves(before))
        )
        assert moved > 0, group.name
    # The params stayed on their pools.
    for role, group in (("actor", w.actor), ("critic", w.critic)):
        ids = {d.id for x in jax.tree.leaves(group.worker.params) for d in x.sharding.device_set}
        assert ids == set(placement.pool(role).device_ids)


def test_rollout_log_probs_match_recomputed(workers, prompts):
    """The sampler (generation layout) and the actor's log-prob pass (training layout, other
    program) compute the same log_softmax(logits / T) of the sampled tokens."""
    _, _, w = workers
    batch = w.actor.generate(prompts)  # the shapes of the iterations: nothing new to compile
    assert len(batch) == NUM_PROMPTS * N
    np.testing.assert_array_equal(batch["uid"][0::N], batch["uid"][1::N])
    assert len(set(batch["uid"])) == NUM_PROMPTS
    np.testing.assert_array_equal(batch["prompt_ids"], np.repeat(prompts["prompt_ids"], N, axis=0))
    np.testing.assert_array_equal(batch["ground_truth"], np.repeat(prompts["ground_truth"], N))
    batch |= w.actor.log_probs(batch)
    mask = np.asarray(batch["response_mask"]) > 0
    np.testing.assert_allclose(
        np.asarray(batch["old_log_probs"])[mask], np.asarray(batch["rollout_log_probs"])[mask], atol=2e-5, rtol=0
    )
    assert np.all(np.asarray(batch["old_log_probs"])[~mask] == 0)


def test_grpo_without_critic(workers, prompts):
    _, _, w = workers
    grpo = Workers(actor=w.actor, ref=w.ref, critic=None, reward=w.reward)
    metrics = iterations.ppo_iteration(grpo, prompts, GRPO)
    _assert_finite(metrics)
    assert not any(k.startswith("critic/vf") for k in metrics)
    assert metrics["actor/update_skipped"] == 0


# ------------------------------------------------------------------ batch-level glue


def _rollout_like(rows=6, R=5, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, R + 1, rows)
    mask = (np.arange(R)[None] < lengths[:, None]).astype(np.int32)
    scores = np.zeros((rows, R), np.float32)
    scores[np.arange(rows), lengths - 1] = rng.integers(0, 2, rows)
    return Batch.from_dict(
        {
            "response_mask": mask,
            "token_level_scores": scores,
            "old_log_probs": rng.normal(size=(rows, R)).astype(np.float32),
            "ref_log_prob": rng.normal(size=(rows, R)).astype(np.float32),
            "values": rng.normal(size=(rows, R)).astype(np.float32) * mask,
        },
        {"uid": ["a", "a", "b", "b", "c", "c"][:rows]},
    )


def test_kl_penalty_and_gae_on_batch_columns():
    batch = _rollout_like()
    out, m = iterations.apply_kl_penalty_to_batch(batch, 0.2, "kl")
    rewards, kl = algos.apply_kl_penalty(
        batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"], batch["response_mask"], 0.2, "kl"
    )
    np.testing.assert_allclose(out["token_level_rewards"], rewards, rtol=1e-6)
    assert m == {"actor/reward_kl_penalty": pytest.approx(float(kl)), "actor/reward_kl_penalty_coeff": 0.2}
    adv = iterations.compute_advantage(out, "gae", gamma=0.9, lam=0.8)
    want_a, want_r = algos.compute_gae_advantage_return(
        out["token_level_rewards"], batch["values"], batch["response_mask"], 0.9, 0.8
    )
    np.testing.assert_allclose(adv["advantages"], want_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adv["returns"], want_r, rtol=1e-5, atol=1e-6)


def test_grpo_groups_come_from_uid():
    batch = _rollout_like()
    adv = np.asarray(iterations.compute_advantage(batch, "grpo")["advantages"])  # scores used as rewards
    seq = batch["token_level_scores"].sum(-1)
    mask = batch["response_mask"]
    for g in (slice(0, 2), slice(2, 4), slice(4, 6)):
        s = seq[g]
        want = (s - s.mean()) / (s.std(ddof=1) + 1e-6) if len(s) > 1 else s * 0
        np.testing.assert_allclose(adv[g], want[:, None] * mask[g], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(iterations.group_ids_from_uid(np.array(["x", "y", "x"], object)), [0, 1, 0])


def test_gdpo_reads_the_reward_functions_named_values():
    """A reward function returning a dict of named scores: the rule scorer keeps them as
    ``reward_extra/<key>`` columns (0 where the function failed), and gdpo normalises the
    dimensions named by ``gdpo_reward_keys`` (verl's algorithm.gdpo_reward_keys)."""

    def two_scores(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise ValueError("no score for this one")
        return {"score": 0.0, "fmt": float(len(solution_str) % 3), "acc": float(solution_str == ground_truth)}

    texts = ["12", "7", "12", "boom", "3", "33"]
    responses = np.zeros((6, 5), np.int32)
    mask = np.zeros((6, 5), np.int32)
    for i, text in enumerate(texts):
        ids = TOKENIZER.encode(text, add_special_tokens=False)
        responses[i, : len(ids)], mask[i, : len(ids)] = ids, 1
    batch = Batch.from_dict(
        {"responses": responses, "response_mask": mask},
        {"data_source": ["s"] * 6, "ground_truth": ["12", "12", "3", "3", "3", "3"], "uid": list("aabbcc")},
    )
    worker = RuleRewardWorker(TOKENIZER, RewardScorer(compute_score=two_scores, isolation="inline"))
    scored, _ = worker.scores(batch)
    np.testing.assert_array_equal(scored["reward_extra/acc"], [1, 0, 0, 0, 1, 0])
    np.testing.assert_array_equal(scored["reward_extra/fmt"], [2, 1, 2, 0, 1, 2])  # "boom" failed: 0
    batch = batch | scored
    weights = (0.5, 2.0)
    adv = iterations.compute_advantage(batch, "gdpo", gdpo_reward_keys=("acc", "fmt"), gdpo_reward_weights=weights)
    scores = np.stack([scored["reward_extra/acc"], scored["reward_extra/fmt"]]).astype(np.float64)
    want, _ = ref_gdpo(scores, weights, mask.astype(np.float64), iterations.group_ids_from_uid(batch["uid"]))
    np.testing.assert_allclose(adv["advantages"], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(KeyError, match=r"'length'.*\['acc', 'fmt'\]"):
        iterations.compute_advantage(batch, "gdpo", gdpo_reward_keys=("acc", "length"))
    partial = batch.update(non_tensors={"reward_extra/acc": np.array([1, 0, np.nan, 0, 1, 0], np.float32)})
    with pytest.raises(ValueError, match="only 5 of 6 samples"):
        iterations.compute_advantage(partial, "gdpo", gdpo_reward_keys=("acc",))


def test_bypass_mode_rollout_takes_the_rollouts_log_probs(workers, prompts, monkeypatch):
    """verl's bypass mode: old_log_probs are the rollout's own (no actor forward), and planners
    know the update then reads them."""
    _, _, w = workers
    monkeypatch.setattr(w.actor, "log_probs", lambda *a, **k: pytest.fail("bypass mode recomputed old_log_probs"))
    batch, _ = steps.rollout(w, prompts, steps.StepTimer(), step=0, bypass_mode=True)
    np.testing.assert_array_equal(np.asarray(batch["old_log_probs"]), np.asarray(batch["rollout_log_probs"]))
    bypass = algos.AlgorithmSettings(
        algos.AlgorithmConfig(adv_estimator="grpo", rollout_correction=algos.RolloutCorrectionConfig(bypass_mode=True))
    )
    assert iterations.rollout_scores_old_log_probs(bypass) and not iterations.rollout_scores_old_log_probs(GRPO)
