"""Algorithm iterations (jaxflow.iterations): registry and selection, ReMax's greedy baseline
and Safe-RLHF's Lagrangian advantages and multiplier against NumPy on stub worker groups whose
outputs are known, and one iteration of every program end to end on tiny random models over
8 simulated devices."""

import json

import numpy as np
import pytest

import jaxflow.algos as algos
import jaxflow.iterations as iterations
import jaxflow.models as models
from jaxflow import configs
from jaxflow.configs.run_spec import algorithm_settings
from jaxflow.data.batch import Batch
from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.data.tasks import get_task
from jaxflow.mesh import Placement
from jaxflow.rewards import token_level_scores
from jaxflow.sampling import SamplingParams
from jaxflow.workers import (
    ActorConfig,
    CriticConfig,
    LocalWorkerGroup,
    OptimConfig,
    RewardFn,
    RoleSettings,
    RolloutConfig,
    RuleRewardWorker,
    Workers,
    build_local_workers,
)

TOKENIZER = CharTokenizer()
EXPECTED = {
    "ppo_tiny": "ppo",
    "grpo_tiny": "grpo",
    "rloo_tiny": "rloo",
    "reinforce_pp_tiny": "reinforce_pp",
    "remax_tiny": "remax",
    "safe_rlhf_tiny": "safe_rlhf",
}


# ------------------------------------------------------------------ registry and selection


def test_registry_and_selection():
    assert set(EXPECTED.values()) <= set(iterations.algorithm_names())
    with pytest.raises(algos.UnknownNameError, match="ppo, reinforce_pp, remax, rloo, safe_rlhf"):
        iterations.get_algorithm("dpo")
    for name, program in EXPECTED.items():
        assert iterations.select_algorithm(algorithm_settings(configs.get_config(name))) == program, name
    cfg = configs.get_config("ppo_tiny")
    for estimator, program in (
        ("grpo_passk", "grpo"),
        ("gpg", "grpo"),
        ("opo", "grpo"),
        ("reinforce_plus_plus_baseline", "reinforce_pp"),
        ("remax", "remax"),
    ):
        cfg.algorithm.adv_estimator = estimator
        assert iterations.select_algorithm(algorithm_settings(cfg)) == program
    cfg.jaxflow.safe_rlhf.enable = True  # wins over the estimator
    assert iterations.select_algorithm(algorithm_settings(cfg)) == "safe_rlhf"
    cfg.jaxflow.safe_rlhf.enable = False
    cfg.algorithm.adv_estimator = "nope"
    with pytest.raises(algos.UnknownNameError, match="gae"):
        iterations.select_algorithm(algorithm_settings(cfg))
    assert iterations.select_algorithm(algos.AlgorithmSettings()) == "ppo"
    assert (
        iterations.select_algorithm(algos.AlgorithmSettings(safe_rlhf=algos.SafeRLHFConfig(enable=True))) == "safe_rlhf"
    )

    @iterations.register_algorithm("my_algo")
    def my_algo(w, prompts, cfg, state):
        return {}

    try:
        assert iterations.get_algorithm("my_algo") is my_algo
    finally:
        iterations.ALGORITHM_REGISTRY.unregister("my_algo")


def test_iterations_refuse_other_estimators():
    state = iterations.AlgoState()
    for name, estimator in (("grpo", "gae"), ("rloo", "grpo"), ("remax", "grpo"), ("ppo", "remax")):
        cfg = algos.AlgorithmSettings(algos.AlgorithmConfig(adv_estimator=estimator))
        with pytest.raises(ValueError, match=estimator):
            iterations.get_algorithm(name)(None, None, cfg, state)


def test_algo_state_round_trip():
    cfg = configs.get_config("safe_rlhf_tiny")
    cfg.algorithm.use_kl_in_reward = True
    settings = algorithm_settings(cfg)
    state = iterations.SafeRLHFState.initial(settings)
    assert state.state_dict() == {"kl_coef": 0.001, "lagrange_multiplier": 1.0}
    state.kl_coef, state.lagrange_multiplier = 0.0123, 0.75
    restored = iterations.SafeRLHFState()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert restored == state
    assert restored.kl_controller(settings.algorithm).value == 0.0123
    assert restored.lagrange(settings.safe_rlhf).value == 0.75
    grpo = algorithm_settings(configs.get_config("grpo_tiny"))
    assert iterations.algorithm_for(grpo).state.initial(grpo).state_dict() == {}
    with pytest.raises(ValueError, match="kl_coef"):
        restored.load_state_dict({"kl_coeff": 1.0})


# ------------------------------------------------------------------ stub worker groups


def encode(texts, R, after_eos=""):
    """Responses [B, R] (text + EOS, right-padded; ``after_eos`` written into the padding,
    outside the mask) and their mask."""
    ids = np.full((len(texts), R), TOKENIZER.pad_token_id, np.int32)
    mask = np.zeros_like(ids)
    for i, t in enumerate(texts):
        tok = TOKENIZER.encode(t, add_special_tokens=False) + [TOKENIZER.eos_token_id]
        ids[i, : len(tok)], mask[i, : len(tok)] = tok, 1
        junk = TOKENIZER.encode(after_eos, add_special_tokens=False)[: R - len(tok)]
        ids[i, len(tok) : len(tok) + len(junk)] = junk
    return ids, mask


class StubActor:
    """An actor group whose sampled responses (``n`` per prompt) and greedy responses (one per
    prompt, on ``sampling="greedy"``) are given; `update` records its batch."""

    def __init__(self, sampled, greedy=None, seed=0):
        self.sampled, self.greedy = sampled, greedy
        self.rng = np.random.default_rng(seed)
        self.updates = []

    def rollout_metrics(self):
        return [{}]  # no probe (one rank's metrics)

    def generate(self, prompts, sampling="train", step=None, prompt_offset=0):
        if "uid" not in prompts:
            prompts = prompts.update(non_tensors={"uid": [f"p{i}" for i in range(len(prompts))]})
        responses, mask = self.greedy if sampling == "greedy" else self.sampled
        n = len(responses) // len(prompts)
        return prompts.repeat(n).update(tensors={"responses": responses, "response_mask": mask})

    def generation_seconds(self):
        return [{}]  # one rank, no timed parts

    def log_probs(self, batch):
        mask = batch["response_mask"]
        return Batch.from_dict({"old_log_probs": (self.rng.normal(size=mask.shape) * mask).astype(np.float32)})

    def update(self, batch, step=None):
        self.updates.append(batch)
        return {"actor/pg_loss": 0.0}


class StubRef:
    def __init__(self, seed=1):
        self.rng = np.random.default_rng(seed)

    def log_probs(self, batch):
        mask = batch["response_mask"]
        return Batch.from_dict({"ref_log_prob": (self.rng.normal(size=mask.shape) * mask).astype(np.float32)})


def token_sum_reward(batch):
    """A reward whose score is the sum of the valid token ids / 10 (on the last token)."""
    mask = np.asarray(batch["response_mask"])
    scores = (np.asarray(batch["responses"]) * mask).sum(-1) / 10.0
    return Batch.from_dict({"token_level_scores": token_level_scores(scores, mask)})


def stub_prompts(num, answers=None):
    non_tensors = {}
    if answers is not None:
        non_tensors = {"data_source": ["jaxflow/addition"] * num, "ground_truth": answers}
    return Batch.from_dict(
        {"prompt_ids": np.ones((num, 2), np.int32), "prompt_mask": np.ones((num, 2), np.int32)}, non_tensors
    )


def reward_to_go(r, mask):
    rm = r * mask
    return np.flip(np.cumsum(np.flip(rm, -1), -1), -1)


def test_remax_baseline_and_advantages_match_numpy():
    B, n, R = 3, 4, 6
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, R + 1, B * n)
    s_mask = (np.arange(R)[None] < lengths[:, None]).astype(np.int32)
    sampled = (rng.integers(4, 20, (B * n, R)) * s_mask).astype(np.int32)
    greedy = encode(["12", "3", "999"], R)
    w = Workers(actor=StubActor((sampled, s_mask), greedy), ref=StubRef(), reward=token_sum_reward)
    cfg = algos.AlgorithmSettings(
        algos.AlgorithmConfig(
            adv_estimator="remax",
            use_kl_in_reward=True,
            kl_penalty="kl",
            kl_ctrl=algos.KLControlConfig(type="adaptive", kl_coef=0.05, target_kl=0.1, horizon=100.0),
        )
    )
    state = iterations.get_algorithm("remax").state.initial(cfg)
    metrics = iterations.get_algorithm("remax")(w, stub_prompts(B), cfg, state)
    batch = w.actor.updates[-1]

    b = (greedy[0] * greedy[1]).sum(-1) / 10.0  # the greedy responses' scores
    np.testing.assert_allclose(batch["reward_baselines"], np.repeat(b, n), rtol=1e-6)
    uid = np.asarray(batch["uid"]).reshape(B, n)
    assert (uid == uid[:, :1]).all() and len(set(uid[:, 0])) == B  # n samples per prompt, in order
    scores = (sampled * s_mask).sum(-1) / 10.0
    kl = (np.asarray(batch["old_log_probs"]) - np.asarray(batch["ref_log_prob"])) * s_mask
    rewards = token_level_scores(scores, s_mask) - 0.05 * kl
    np.testing.assert_allclose(batch["token_level_rewards"], rewards, rtol=1e-5, atol=1e-6)
    want = reward_to_go(rewards, s_mask) - np.repeat(b, n)[:, None] * s_mask
    np.testing.assert_allclose(batch["advantages"], want, rtol=1e-5, atol=1e-5)
    # The adaptive KL coefficient moved as the controller's formula says, and the state kept it.
    current_kl = np.mean(kl.sum(-1) / s_mask.sum(-1))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl, rel=1e-5)
    want_coef = 0.05 * (1 + np.clip(current_kl / 0.1 - 1, -0.2, 0.2) * (B * n) / 100.0)
    assert state.kl_coef == pytest.approx(want_coef, rel=1e-6)
    assert metrics["critic/reward_baseline/mean"] == pytest.approx(b.mean())
    assert {"timing_s/gen", "timing_s/gen_max", "timing_s/ref", "timing_s/adv", "timing_s/update_actor"} <= set(metrics)


def grpo_numpy(seq, uid, mask, eps=1e-6):
    adv = np.zeros_like(seq)
    for u in set(uid):
        g = np.asarray(uid) == u
        adv[g] = (seq[g] - seq[g].mean()) / (seq[g].std(ddof=1) + eps)
    return adv[:, None] * mask


@pytest.mark.parametrize("scale", ["linear", "log"])
def test_safe_rlhf_lagrangian_advantages_and_multiplier(scale):
    B, n, R = 4, 4, 6
    answers = ["12", "19", "90", "7"]
    rng = np.random.default_rng(1)
    texts = [answers[i] if rng.random() < 0.5 else str(rng.integers(0, 100)) for i in range(B) for _ in range(n)]
    responses, mask = encode(texts, R, after_eos="9")  # a '9' after EOS (masked out) costs nothing
    w = Workers(actor=StubActor((responses, mask)), reward=RewardFn(rule=LocalWorkerGroup(RuleRewardWorker(TOKENIZER))))
    safe = algos.SafeRLHFConfig(
        enable=True,
        cost_rule="forbidden_chars",
        forbidden_chars="9",
        cost_threshold=0.2,
        lambda_init=0.5,
        lambda_lr=0.3,
        lambda_update_scale=scale,
    )
    cfg = algos.AlgorithmSettings(algos.AlgorithmConfig(adv_estimator="grpo"), safe)
    state = iterations.get_algorithm("safe_rlhf").state.initial(cfg)
    lam = 0.5
    scores = np.asarray([float(t == answers[i // n]) for i, t in enumerate(texts)], np.float32)
    costs = np.asarray([float("9" in t) for t in texts], np.float32)
    assert 0 < costs.sum() < len(costs) and 0 < scores.sum() < len(scores)
    for _ in range(2):
        metrics = iterations.get_algorithm("safe_rlhf")(w, stub_prompts(B, answers), cfg, state)
        batch = w.actor.updates[-1]
        np.testing.assert_array_equal(np.asarray(batch["token_level_cost"]).sum(-1), costs)
        uid = list(batch["uid"])
        a_r = grpo_numpy(scores, uid, mask)
        a_c = grpo_numpy(costs, uid, mask)
        np.testing.assert_allclose(batch["reward_advantages"], a_r, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(batch["cost_advantages"], a_c, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(batch["advantages"], (a_r - lam * a_c) / (1 + lam), rtol=1e-5, atol=1e-5)
        assert metrics["safe_rlhf/lambda"] == pytest.approx(lam)
        j_c = costs.mean()
        lam = max(0.0, lam + 0.3 * (j_c - 0.2)) if scale == "linear" else lam * np.exp(0.3 * (j_c - 0.2))
        assert metrics["safe_rlhf/episode_cost"] == pytest.approx(j_c)
        assert metrics["safe_rlhf/cost_violation"] == pytest.approx(j_c - 0.2)
        assert state.lagrange_multiplier == pytest.approx(lam, rel=1e-6)
        assert metrics["safe_rlhf/lambda_next"] == pytest.approx(lam, rel=1e-6)
    assert metrics["critic/score/mean"] == pytest.approx(scores.mean())
    assert "timing_s/cost" in metrics


def test_rule_costs_on_decoded_text():
    responses, mask = encode(["12", "19", "", "x", "9x"], 5, after_eos="9")  # '9's after each EOS
    texts = RuleRewardWorker(TOKENIZER).decode(responses, mask)
    assert texts == ["12", "19", "", "x", "9x"]  # valid tokens only, EOS skipped
    np.testing.assert_array_equal(iterations.rule_costs("forbidden_chars", mask, texts, "9"), [0, 1, 0, 0, 1])
    np.testing.assert_array_equal(iterations.rule_costs("forbidden_chars", mask, texts, "x2"), [1, 0, 0, 1, 1])
    np.testing.assert_array_equal(iterations.rule_costs("length", mask), mask.sum(-1))
    with pytest.raises(ValueError, match="forbidden_chars, length"):
        iterations.rule_costs("toxicity", mask, texts)


def test_multiplier_cap_and_projection():
    for scale, init, j_c, cap, want in (
        ("linear", 0.1, 0.0, None, 0.0),
        ("linear", 1.0, 10.0, 2.0, 2.0),
        ("log", 1.0, 10.0, 3.0, 3.0),
    ):
        state = iterations.SafeRLHFState(lagrange_multiplier=init)
        settings = algos.SafeRLHFConfig(cost_threshold=1.0, lambda_lr=0.5, lambda_update_scale=scale, lambda_max=cap)
        m = state.lagrange(settings)
        m.update(j_c)
        state.store(multiplier=m)
        assert state.lagrange_multiplier == pytest.approx(want)


# ------------------------------------------------------------------ end to end, tiny models

CFG = models.get_preset("tiny_llama", vocab_size=128, num_layers=1)
NUM_PROMPTS, N, PROMPT_LEN, MAX_NEW = 8, 2, 8, 8
VERL_METRICS = {
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/reward",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/step",
}


@pytest.fixture(scope="module")
def prompts():
    rows = get_task("addition").make_examples(NUM_PROMPTS, seed=0)
    ids = np.full((NUM_PROMPTS, PROMPT_LEN), TOKENIZER.pad_token_id, np.int32)
    mask = np.zeros_like(ids)
    for i, row in enumerate(rows):
        text = TOKENIZER.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        tokens = TOKENIZER.encode(text, add_special_tokens=False)
        ids[i, PROMPT_LEN - len(tokens) :], mask[i, PROMPT_LEN - len(tokens) :] = tokens, 1
    return iterations.batch_from_prompts(
        {
            "prompt_ids": ids,
            "prompt_mask": mask,
            "data_source": [r["data_source"] for r in rows],
            "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
        }
    )


@pytest.fixture(scope="module")
def workers():
    """Actor (+ generation layout), reference, critic and cost model all on the 8 devices."""
    placement = Placement.colocated(
        roles=("actor", "ref", "critic", "cost"),
        meshes={"actor": "dp=2,fsdp=2,tp=2"},
        gen_tp={"actor": 2},
        models={r: CFG for r in ("actor", "ref", "critic", "cost")},
    )
    lm = models.init_model(CFG, "lm", seed=0)
    return build_local_workers(
        placement,
        actor=lm,
        ref=lm,
        critic=models.init_model(CFG, "value", seed=1),
        cost_model=models.init_model(CFG, "reward", seed=2),
        rule_reward=RuleRewardWorker(TOKENIZER),
        settings=RoleSettings(
            actor_config=ActorConfig(ppo_mini_batch_size=8, optim=OptimConfig(lr=1e-4)),
            critic_config=CriticConfig(ppo_mini_batch_size=8, optim=OptimConfig(lr=1e-4)),
            rollout=RolloutConfig(
                train=SamplingParams(
                    n=N,
                    max_new_tokens=MAX_NEW,
                    eos_token_ids=TOKENIZER.eos_token_id,
                    pad_token_id=TOKENIZER.pad_token_id,
                    seed=0,
                )
            ),
        ),
    )


def _run(w, prompts, cfg, extra=()):
    settings = algorithm_settings(cfg)
    name = iterations.select_algorithm(settings)
    state = iterations.get_algorithm(name).state.initial(settings)
    metrics = iterations.get_algorithm(name)(w, prompts, settings, state)
    bad = {k: v for k, v in metrics.items() if not np.isfinite(v)}
    assert not bad, bad
    missing = (VERL_METRICS | set(extra)) - set(metrics)
    assert not missing, missing
    assert metrics["actor/update_skipped"] == 0
    restored = type(state)()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert restored == state
    return metrics, state


def test_ppo_end_to_end(workers, prompts):
    cfg = configs.get_config("ppo_tiny")
    w = Workers(actor=workers.actor, ref=workers.ref, critic=workers.critic, reward=workers.reward)
    metrics, state = _run(
        w,
        prompts,
        cfg,
        (
            "critic/vf_loss",
            "critic/values/mean",
            "actor/reward_kl_penalty",
            "timing_s/ref",
            "timing_s/values",
            "timing_s/update_critic",
        ),
    )
    assert state.kl_coef == cfg.algorithm.kl_ctrl.kl_coef  # fixed controller


@pytest.mark.parametrize("config", ["grpo_tiny", "rloo_tiny", "reinforce_pp_tiny"])
def test_critic_free_iterations_end_to_end(workers, prompts, config):
    cfg = configs.get_config(config)
    w = Workers(actor=workers.actor, ref=workers.ref, reward=workers.reward)
    metrics, _ = _run(w, prompts, cfg)
    assert not any(k.startswith("critic/vf") for k in metrics)
    assert ("actor/reward_kl_penalty" in metrics) == cfg.algorithm.use_kl_in_reward


def test_remax_end_to_end(workers, prompts):
    cfg = configs.get_config("remax_tiny")
    w = Workers(actor=workers.actor, ref=workers.ref, reward=workers.reward)
    metrics, _ = _run(w, prompts, cfg, ("critic/reward_baseline/mean", "timing_s/gen_max"))
    assert 0 <= metrics["critic/reward_baseline/mean"] <= 1  # the addition task scores 0 or 1


def test_safe_rlhf_rule_cost_end_to_end(workers, prompts):
    cfg = configs.get_config("safe_rlhf_tiny")  # grpo, rule cost forbidden_chars "9"
    w = Workers(actor=workers.actor, ref=workers.ref, reward=workers.reward)
    metrics, state = _run(
        w, prompts, cfg, ("safe_rlhf/episode_cost", "safe_rlhf/lambda", "safe_rlhf/cost_violation", "timing_s/cost")
    )
    s = cfg.jaxflow.safe_rlhf
    assert metrics["safe_rlhf/lambda"] == s.lambda_init
    want = max(0.0, s.lambda_init + s.lambda_lr * (metrics["safe_rlhf/episode_cost"] - s.cost_threshold))
    assert state.lagrange_multiplier == pytest.approx(want)


def test_safe_rlhf_cost_model_gae_end_to_end(workers, prompts):
    """Cost from a cost model (w.cost), GAE with the reward critic, KL in the reward, log scale."""
    cfg = configs.get_config("safe_rlhf_tiny")
    cfg.algorithm.adv_estimator = "gae"
    cfg.algorithm.use_kl_in_reward = True
    cfg.jaxflow.safe_rlhf.lambda_update_scale = "log"
    metrics, state = _run(workers, prompts, cfg, ("critic/vf_loss", "actor/reward_kl_penalty", "timing_s/cost"))
    s = cfg.jaxflow.safe_rlhf
    want = s.lambda_init * np.exp(s.lambda_lr * (metrics["safe_rlhf/episode_cost"] - s.cost_threshold))
    assert state.lagrange_multiplier == pytest.approx(want, rel=1e-6)
    assert metrics["safe_rlhf/cost/max"] != metrics["safe_rlhf/cost/min"]  # a model's real-valued costs
    assert state.kl_coef == cfg.algorithm.kl_ctrl.kl_coef
