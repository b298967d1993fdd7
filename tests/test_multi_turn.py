"""Multi-turn rollouts through the run (``actor_rollout_ref.rollout.multi_turn``): the actor's
conversations with tools (`jaxflow.workers.multi_turn`), the keys that configure them, the
built-in tool task, and GRPO and PPO steps trained on them.

- With no tool call, a conversation is the single-turn rollout (the same tokens: same row keys).
- Through the trainer (GRPO and PPO), with the engine scripted to call the calculator on half
  the rows: the reward reads the answer after the tool's, the ``agent/*`` metrics count the
  turns and calls, and only the model's own tokens train (``loss_mask``, checked on the batch
  the update receives).
"""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest
from flax import nnx

import jaxflow.models as models
from jaxflow.agents.rollout import load_tools
from jaxflow.configs import ConfigError, load_config
from jaxflow.configs.run_spec import describe_run
from jaxflow.data.batch import Batch
from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.data.tasks import get_task, hermes_call, task_reward, tool_response_turn
from jaxflow.mesh import MeshSpec
from jaxflow.workers import ActorWorker
from tests.test_placement_invariance import SMALL, run_steps

TOOLS = ["actor_rollout_ref.rollout.multi_turn.enable=True", "jaxflow.agent.tools=['calculator']"]


def test_without_a_tool_call_a_conversation_is_the_single_turn_rollout():
    """A random model calls no tool: each conversation is one model turn, whose tokens are the
    single-turn rollout's bit for bit (n = 2 samples per prompt, the same keys) and whose
    log-probs are its to float32 rounding, every token trained."""
    tok = CharTokenizer()
    cfg = models.get_preset("tiny_llama", vocab_size=tok.vocab_size, num_layers=1, hidden_size=64)
    model = models.init_model(cfg, seed=0)
    overrides = ["data.max_response_length=8", "actor_rollout_ref.rollout.n=2", "jaxflow.placement.type=colocated"]
    spec = describe_run(load_config("grpo_tool_tiny", overrides), tokenizer=tok)
    assert spec.rollout.multi_turn is not None and spec.actor.use_loss_mask
    mesh = MeshSpec(fsdp=2).build(jax.devices()[:2])
    ids = np.asarray([tok.encode(p) for p in ("<bos>mul:12*34=", "<bos>mul:56*78=", "<bos>mul:90*12=")], np.int32)
    prompts = Batch.from_dict({"prompt_ids": ids, "prompt_mask": np.ones_like(ids)})
    multi = ActorWorker(nnx.split(model), mesh, "train", rollout=spec.rollout).generate(prompts, step=5)
    single_rollout = dataclasses.replace(spec.rollout, multi_turn=None)
    single = ActorWorker(nnx.split(model), mesh, "train", rollout=single_rollout).generate(prompts, step=5)
    for key in ("responses", "response_mask"):
        np.testing.assert_array_equal(np.asarray(multi[key]), np.asarray(single[key]), err_msg=key)
    # The same tokens; their log-probs to float32 rounding: the conversations prefill each
    # sample's prompt on its own, the single-turn rollout once for both (other matmul shapes).
    np.testing.assert_allclose(
        np.asarray(multi["rollout_log_probs"]), np.asarray(single["rollout_log_probs"]), rtol=1e-6, atol=0
    )
    np.testing.assert_array_equal(np.asarray(multi["loss_mask"]), np.asarray(multi["response_mask"]))
    assert "loss_mask" not in single


class _Twice:
    """An environment that answers a conversation's first model turn with "ok" and ends it
    after the second."""

    def reset(self, sample):
        self.turns = 0

    def step(self, action):
        self.turns += 1
        return "ok", 0.0, self.turns == 2


def test_kv_reuse_prefills_only_what_each_turn_appended_on_the_generation_mesh():
    """The actor's multi-turn rollout on a 2-device generation mesh (one replica, tp = 2) with
    an environment that answers every first turn: with the KV pages kept between turns (the
    default) turn 2 runs the model on the last sampled token and the "ok" only (1 + 2
    tokens a conversation), where prefilling every turn again runs it on the whole
    conversation (prompt, 4 sampled tokens, "ok"); both sample the same tokens, the log-probs
    within 8 float32 ulps (decode vs prefill shapes, as tests/test_agent_tools.py)."""
    from jaxflow.agents import AgentConfig
    from jaxflow.agents.rollout import MultiTurn
    from jaxflow.mesh import GENERATE_RULES, state_shardings
    from jaxflow.sampling import EngineOptions, SamplingParams
    from jaxflow.workers.multi_turn import keeps_kv_pages, multi_turn_rollout

    tok = CharTokenizer()
    model = models.init_model(models.get_preset("tiny_llama", vocab_size=tok.vocab_size, num_layers=1), seed=0)
    mesh = MeshSpec(tp=2).build(jax.devices()[:2])
    assert keeps_kv_pages(True, mesh, GENERATE_RULES) and not keeps_kv_pages(False, mesh, GENERATE_RULES)
    replicas = MeshSpec(dp=2, tp=2).build(jax.devices()[:4])  # would repeat each other's work
    assert not keeps_kv_pages(True, replicas, GENERATE_RULES) and keeps_kv_pages(True, None, GENERATE_RULES)
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, GENERATE_RULES, mesh))  # the heads split over tp
    ids = np.asarray([tok.encode(p) for p in ("<bos>mul:12*34=", "<bos>mul:56*78=")], np.int32)
    plen = ids.shape[1]
    multi = MultiTurn(AgentConfig(max_assistant_turns=2, max_response_tokens=16), (), environment=_Twice)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, eos_token_ids=(), n=2, seed=1)
    runs = {
        reuse: multi_turn_rollout(
            dataclasses.replace(multi, reuse_kv=reuse),
            tok,
            graphdef,
            state,
            ids,
            np.ones_like(ids),
            params,
            jax.random.key(7),
            np.asarray([3, 8]),
            mesh=mesh,
            rules=GENERATE_RULES,
            options=EngineOptions(page_size=4),
        )
        for reuse in (True, False)
    }
    (kept, kept_metrics), (again, again_metrics) = runs[True], runs[False]
    np.testing.assert_array_equal(kept["responses"], again["responses"])
    np.testing.assert_allclose(kept["rollout_log_probs"], again["rollout_log_probs"], rtol=8 * 2.0**-23, atol=0)
    assert kept["loss_mask"][:, :10].tolist() == [[1] * 4 + [0] * 2 + [1] * 4] * 4
    assert kept_metrics["agent/turns/mean"] == 2
    assert kept_metrics["agent/prefill_tokens/sum"] == 4 * plen + 4 * (1 + 2)
    assert again_metrics["agent/prefill_tokens/sum"] == 4 * plen + 4 * (plen + 4 + 2)


def test_the_calculator_task_and_its_reward():
    """Demonstrations: a quarter call the tool (the call, the tool's turn, the answer); the
    reward reads the answer after the last tool response."""
    task = get_task("calculator")
    rows = task.make_sft_examples(400)
    calls = [r for r in rows if r["response"].startswith("<tool_call>")]
    assert 0.15 < len(calls) / len(rows) < 0.35
    a, b = calls[0]["extra_info"]["question"].removeprefix("mul:").removesuffix("=").split("*")
    answer = str(int(a) * int(b))
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}, separators=(",", ":"))
    assert calls[0]["response"] == f"<tool_call>{call}</tool_call><eos><tool_response>{answer}</tool_response>{answer}"
    assert task_reward(f"<tool_call>x</tool_call>{tool_response_turn(['99'])} 99 ", "99") == 1.0
    assert task_reward(f"{tool_response_turn(['99'])}98", "99") == 0.0
    assert task_reward("99", "99") == 1.0  # a direct answer


def test_the_calculator_tasks_sums_teach_the_tool_on_other_problems():
    """With ``sum_fraction``: that share of the training demonstrations are sums, each worked
    through the tool (answers as long as the products'); the products keep their own
    ``tool_fraction``; the held-out demonstrations are products only."""
    task = get_task("calculator", tool_fraction=0.1, sum_fraction=0.5)
    rows = task.make_sft_examples(400)
    sums = [r for r in rows if r["extra_info"]["question"].startswith("add:")]
    products = [r for r in rows if r["extra_info"]["question"].startswith("mul:")]
    assert len(sums) == 200 and len(products) == 200
    assert sorted(r["extra_info"]["index"] for r in rows) == list(range(400))
    for row in sums:
        a, b = row["extra_info"]["question"].removeprefix("add:").removesuffix("=").split("+")
        assert len(a) == len(b) == 5
        answer = str(int(a) + int(b))
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}, separators=(",", ":"))
        assert row["response"] == f"<tool_call>{call}</tool_call><eos><tool_response>{answer}</tool_response>{answer}"
        assert row["reward_model"]["ground_truth"] == answer
    with_tool = sum(r["response"].startswith("<tool_call>") for r in products)
    assert 0.04 < with_tool / len(products) < 0.16
    held_out = task.make_sft_examples(100, split="test")
    assert all(r["extra_info"]["question"].startswith("mul:") for r in held_out)
    assert task.make_examples(50) == get_task("calculator").make_examples(50)  # the RL prompts: products


def test_tool_keys_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="jaxflow.agent.tools: unknown tool 'abacus'"):
        load_config("grpo_tool_tiny", ["jaxflow.agent.tools=['abacus']"])
    with pytest.raises(ConfigError, match="multi_turn.enable: multi-turn rollouts need tools"):
        load_config("grpo_tool_tiny", ["jaxflow.agent.tools=[]"])
    with pytest.raises(ConfigError, match="multi_turn.format: must be one of hermes, llama3"):
        load_config("grpo_tool_tiny", ["actor_rollout_ref.rollout.multi_turn.format=xml"])
    with pytest.raises(ConfigError, match="multi_turn.enable: multi-turn rollouts run on the local backend"):
        load_config("grpo_tool_tiny", ["jaxflow.backend=ray"])
    (tmp_path / "my_tools.py").write_text("def lookup(key):\n    return {'a': '1'}.get(key, 'none')\n")
    schema = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    config = tmp_path / "tools.json"
    config.write_text(
        json.dumps({"tools": [{"name": "calculator"}, {"callable": "my_tools.py:lookup", "tool_schema": schema}]})
    )
    tools = load_tools([], str(config))
    assert [t.name for t in tools] == ["calculator", "lookup"] and tools[1].fn(key="a") == "1"
    config.write_text(json.dumps({"tools": [{"callable": "my_tools.py:missing", "tool_schema": schema}]}))
    with pytest.raises(ConfigError, match="multi_turn.tool_config_path: tool callable 'my_tools.py:missing'"):
        load_config("grpo_tool_tiny", [f"actor_rollout_ref.rollout.multi_turn.tool_config_path={config}"])


class _ScriptedTurns:
    """Stands in for `jaxflow.sampling.EngineTurns` in the conversations (built as it is, then
    called with the whole conversations): a conversation whose prompt's first operand is even
    calls the calculator, then copies its answer; an odd one answers 1 at once. Records every
    call's conversations (their indices)."""

    def __init__(self, tok):
        self.tok, self.calls, self.stats = tok, [], []

    def build(self, graphdef, state, params, **engine):
        self.params = params
        return self

    def __call__(self, conversations, budgets, rows):
        self.calls.append((len(conversations), list(rows)))
        out = []
        for conv, budget in zip(conversations, budgets):
            text = self.tok.decode(conv, skip_special_tokens=False)
            question = text.split("mul:")[1].split("=")[0]
            if "</tool_response>" in text:
                turn = text.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]
            elif int(question.split("*")[0]) % 2 == 0:
                turn = hermes_call("calculator", {"expression": question})  # 75 tokens
            else:
                turn = "1"
            new = (self.tok.encode(turn, add_special_tokens=False) + [self.tok.eos_token_id])[
                : min(budget, self.params.max_new_tokens)
            ]
            out.append((new, [-0.5] * len(new)))
        return out


@pytest.mark.parametrize("config", ["grpo_tool_tiny", "ppo_tiny"])
def test_the_trainer_trains_on_conversations(config, tmp_path, monkeypatch):
    """A step: the conversations that call the calculator answer right, the others wrong
    (score = calls per conversation = model turns - 1); the update's batch masks the tool's
    tokens out of the loss; GRPO and PPO (GAE with a critic) alike."""
    import jaxflow.workers.actor as actor_module
    import jaxflow.workers.multi_turn as multi_turn

    tok = CharTokenizer()
    engine = _ScriptedTurns(tok)
    monkeypatch.setattr(multi_turn, "EngineTurns", engine.build)
    updates = []
    update = actor_module.ActorWorker.update

    @functools.wraps(update)
    def recording_update(self, batch, *args, **kwargs):
        updates.append(jax.device_get({k: batch[k] for k in ("responses", "response_mask", "loss_mask")}))
        return update(self, batch, *args, **kwargs)

    monkeypatch.setattr(actor_module.ActorWorker, "update", recording_update)
    overrides = [*SMALL, *TOOLS, "jaxflow.data.builtin_task=calculator", "data.max_prompt_length=16"]
    overrides += ["data.max_response_length=128", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"]
    metrics = run_steps(config, overrides, 1, tmp_path)
    for m in metrics:
        assert 0 < m["critic/score/mean"] < 1  # the prompts with an even first operand
        assert m["agent/tool_calls/mean"] == pytest.approx(m["critic/score/mean"])
        assert m["agent/turns/mean"] == pytest.approx(1 + m["agent/tool_calls/mean"])
        assert m["agent/tool_errors/sum"] == 0
    assert len(engine.calls) == 2 and engine.calls[0][0] == 32  # 8 prompts x 4: turn 1 all, turn 2 the callers
    assert sorted(engine.calls[1][1]) == engine.calls[1][1] and len(engine.calls[1][1]) < 32
    (batch,) = updates[:1]
    texts = [
        tok.decode(r[m > 0].tolist(), skip_special_tokens=False)
        for r, m in zip(batch["responses"], batch["response_mask"])
    ]
    for text, row, loss in zip(texts, batch["responses"], batch["loss_mask"]):
        trained = tok.decode(row[loss > 0].tolist(), skip_special_tokens=False)
        if "<tool_response>" in text:
            answer = text.split("<tool_response>")[1].split("</tool_response>")[0]
            assert trained == text.split("<tool_response>")[0] + answer + "<eos>"  # the call and the answer
        else:
            assert trained == text == "1<eos>"


def test_the_in_reward_kl_penalty_skips_tool_tokens():
    """PPO's in-reward KL (``kl`` estimator: old - ref) on a multi-turn batch: the penalty and
    the current KL (the masked mean over the sequences' token means) count the model's tokens
    only, against NumPy."""
    from jaxflow.iterations.batch_ops import apply_kl_penalty_to_batch

    rng = np.random.default_rng(0)
    B, R, beta = 3, 6, 0.2
    response_mask = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]], np.int32)
    loss_mask = np.array([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]], np.int32)
    old, ref = rng.normal(size=(B, R)).astype(np.float32), rng.normal(size=(B, R)).astype(np.float32)
    scores = np.zeros((B, R), np.float32)
    scores[[0, 1, 2], [4, 5, 1]] = [1.0, 0.0, 1.0]
    batch = Batch.from_dict(
        {"token_level_scores": scores, "old_log_probs": old, "ref_log_prob": ref, "response_mask": response_mask}
    )
    out, metrics = apply_kl_penalty_to_batch(batch | Batch.from_dict({"loss_mask": loss_mask}), beta)
    kl = (old - ref) * loss_mask
    np.testing.assert_allclose(np.asarray(out["token_level_rewards"]), scores - beta * kl, rtol=1e-6, atol=1e-7)
    want = np.mean(kl.sum(1) / loss_mask.sum(1))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(want, rel=1e-6)
    _, unmasked = apply_kl_penalty_to_batch(batch, beta)  # single-turn: every response token
    assert unmasked["actor/reward_kl_penalty"] != pytest.approx(want)


def test_gae_steps_over_tool_tokens():
    """GAE on a multi-turn batch (``loss_mask`` marks the model's tokens) gives the model's
    tokens the advantages and returns of the same conversation with the tool tokens cut out."""
    from jaxflow.iterations.batch_ops import compute_advantage

    rng = np.random.default_rng(1)
    B, R = 4, 9
    loss_mask = np.ones((B, R), np.int32)
    loss_mask[:, 3:6] = 0  # a tool turn in the middle of every conversation
    loss_mask[1, 8] = 0  # the last token is padding for this one
    response_mask = np.ones((B, R), np.int32)
    response_mask[1, 8] = 0
    rewards = np.zeros((B, R), np.float32)
    rewards[:, 7] = rng.normal(size=B)
    values = rng.normal(size=(B, R)).astype(np.float32)
    columns = {"token_level_rewards": rewards, "values": values, "response_mask": response_mask}
    multi = compute_advantage(Batch.from_dict(columns | {"loss_mask": loss_mask}), "gae", gamma=0.9, lam=0.8)
    keep = np.r_[0:3, 6:9]  # the model's positions, the tool turn cut out
    cut = {k: v[:, keep] for k, v in columns.items()}
    cut["response_mask"] = loss_mask[:, keep]
    single = compute_advantage(Batch.from_dict(cut), "gae", gamma=0.9, lam=0.8)
    model = loss_mask[:, keep] > 0
    for key in ("advantages", "returns"):
        got = np.asarray(multi[key])[:, keep][model]
        np.testing.assert_allclose(got, np.asarray(single[key])[model], rtol=1e-5, atol=1e-6, err_msg=key)


ENVIRONMENT = '''
class Stepper:
    """Two turns: "Say:" first; each model turn rewarded (first, then last) and the conversation done after two."""

    def __init__(self, first, last):
        self.first, self.last = first, last

    def reset(self, sample):
        assert sample["data_source"] == "jaxflow/calculator" and sample["ground_truth"].isdigit()
        self.turns = 0
        return "Say:"

    def step(self, action):
        self.turns += 1
        if self.turns == 1:
            return "More:", self.first, False
        return None, self.last, True
'''


class _Sayer:
    """Stands in for `jaxflow.sampling.EngineTurns` (built as it is): every turn answers "7"."""

    def __init__(self, graphdef, state, params, **engine):
        tok = CharTokenizer()
        self.say, self.stats = tok.encode("7", add_special_tokens=False) + [tok.eos_token_id], []

    def __call__(self, conversations, budgets, rows):
        return [(self.say, [-0.5] * len(self.say)) for _ in conversations]


@pytest.mark.parametrize("config", ["grpo_tool_tiny", "ppo_tiny"])
def test_environment_rewards_reach_the_scores_turn_by_turn(config, tmp_path, monkeypatch):
    """``multi_turn.interaction_config_path``: each conversation's environment (built from
    the config's callable, started with its sample's row) rewards both model turns (0.25, then
    0.5); the scores are those plus the task's (0: "7" is no product), so every step scores
    0.75, with two model turns and the observations as untrained tokens; GRPO and PPO."""
    import jaxflow.workers.multi_turn as multi_turn

    monkeypatch.setattr(multi_turn, "EngineTurns", _Sayer)
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    interaction = {
        "interaction": [{"name": "stepper", "callable": "env.py:Stepper", "config": {"first": 0.25, "last": 0.5}}]
    }
    (tmp_path / "interaction.json").write_text(json.dumps(interaction))
    overrides = [*SMALL, "actor_rollout_ref.rollout.multi_turn.enable=True", "jaxflow.agent.tools=[]"]
    overrides += [
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp_path / 'interaction.json'}",
        "jaxflow.data.builtin_task=calculator",
        "data.max_prompt_length=16",
        "data.max_response_length=16",
    ]
    (m,) = run_steps(config, overrides, 1, tmp_path / "run")
    assert m["critic/score/mean"] == pytest.approx(0.75) and m["critic/score/min"] == pytest.approx(0.75)
    assert m["agent/turns/mean"] == 2 and m["agent/tool_calls/mean"] == 0
    assert m["agent/model_tokens/mean"] == 4 and m["agent/tool_tokens/mean"] == len("Say:") + len("More:")
