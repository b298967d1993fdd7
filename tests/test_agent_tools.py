"""Tool calls (`jaxflow.agents.tools`): parsed from the Qwen (hermes) and Llama 3 formats, run
under time limits, every failure answered to the model as an error, never raised; and the
multi-turn loop (`jaxflow.agents.loop`): token in, token out, tool turns masked out of the
loss."""

import dataclasses
import json
import threading
import time

import numpy as np
import pytest
from flax import nnx

from jaxflow.agents import (
    CALCULATOR,
    AgentConfig,
    Tool,
    ToolExecutor,
    ToolResult,
    calculate,
    chatml_user_turn,
    engine_turns,
    hermes_tool_turn,
    parse_tool_calls,
    run_agent,
    sample_tool_kwargs,
)


def _slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


SLOW = Tool(
    "sleep",
    "Sleep.",
    {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
    _slow,
    timeout_s=0.3,
)


def test_hermes_calls_are_parsed_and_malformed_ones_carry_an_error():
    text = (
        "I will compute.\n<tool_call>\n"
        + json.dumps({"name": "calculator", "arguments": {"expression": "2 + 3"}})
        + "\n</tool_call>\n<tool_call>{'name': bad}</tool_call>"
        + '<tool_call>{"arguments": {}}</tool_call>'
        + '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7\\"}"}</tool_call>'
        + '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}'
    )
    calls = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("calculator", {"expression": "2 + 3"}, True),
        ("", None, False),  # not JSON
        ("", None, False),  # no name
        ("calculator", {"expression": "7"}, True),  # arguments JSON-encoded, as some models send them
        ("calculator", {"expression": "1"}, False),  # the tag is not closed
    ]
    assert "not valid JSON" in calls[1].error and "not closed" in calls[4].error
    assert parse_tool_calls("The answer is 5.", "hermes") == []


def test_llama3_calls_are_parsed():
    one = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "6*7"}}<|eom_id|>'
    assert [(c.name, c.arguments) for c in parse_tool_calls(one, "llama3")] == [("calculator", {"expression": "6*7"})]
    two = '{"name": "a", "parameters": {"x": "1;2"}}; {"name": "b", "parameters": {}}'
    assert [(c.name, c.arguments) for c in parse_tool_calls(two, "llama3")] == [("a", {"x": "1;2"}), ("b", {})]
    assert parse_tool_calls("Plain prose, no call.", "llama3") == []
    [bad] = parse_tool_calls("<|python_tag|>print(1)", "llama3")
    assert bad.error and bad.arguments is None
    with pytest.raises(ValueError, match="format must be one of"):
        parse_tool_calls("", "chatml")


def test_every_failure_is_an_answer_and_is_counted():
    executor = ToolExecutor([CALCULATOR, SLOW])
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "123456789123456789 * 987654321987654321"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>'
        '<tool_call>{"name": "sleep", "arguments": {"seconds": 5}}</tool_call>'
        "<tool_call>not json</tool_call>"
    )
    t0 = time.monotonic()
    results = executor.run(parse_tool_calls(text, "hermes"))
    assert time.monotonic() - t0 < 3  # the slow call is cut at its 0.3 s limit
    assert results[0].ok and results[0].content == str(123456789123456789 * 987654321987654321)
    assert [r.ok for r in results] == [True] + [False] * 7
    assert "unknown tool 'search'" in results[1].content
    assert "missing required argument(s) ['expression']" in results[2].content
    assert "must be string, got int" in results[3].content
    assert "ZeroDivisionError" in results[4].content
    assert "only numbers" in results[5].content
    assert results[6].timed_out and "timed out after 0.3 s" in results[6].content
    assert "not valid JSON" in results[7].content
    assert dict(executor.counts) == {"calls": 8, "errors": 6, "timeouts": 1}
    executor.close()


def test_calls_run_concurrently():
    started = []
    barrier = threading.Barrier(3, timeout=5)

    def meet(i: int) -> str:
        started.append(i)
        barrier.wait()  # all three must run at once to pass
        return str(i)

    tool = Tool("meet", "", {"type": "object", "properties": {"i": {"type": "integer"}}}, meet, timeout_s=10)
    executor = ToolExecutor([tool])
    calls = parse_tool_calls(
        "".join(f'<tool_call>{{"name": "meet", "arguments": {{"i": {i}}}}}</tool_call>' for i in range(3))
    )
    assert [r.content for r in executor.run(calls)] == ["0", "1", "2"]
    executor.close()


def test_the_calculator_is_exact_and_refuses_everything_else():
    assert calculate("(2 + 3) * 4 - 7 // 2") == str((2 + 3) * 4 - 7 // 2)
    assert calculate("2 ** 64") == str(2**64)
    for bad in ("2 ** 1000", "x + 1", "abs(-1)", "().__class__", "9" * 5000):
        with pytest.raises(ValueError):
            calculate(bad)
    assert CALCULATOR.schema()["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match="tool name"):
        Tool("no spaces", "", {}, calculate)


# --- the multi-turn loop ---------------------------------------------------------------------

TWO_CHARS = 1000  # a token whose text is two characters: re-encoding it would give 2 tokens


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def _decode(ids) -> str:
    return "".join("ab" if i == TWO_CHARS else chr(i) for i in ids)


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def _scripted(conversations, budgets, rows):
    """Prompt "A": a tool call, then after the answer "ab" + "=42"; "B": answers at once;
    "C": calls the tool every turn; each turn's log-probs are -(its index + 1) / 10."""
    out = []
    for conv, budget in zip(conversations, budgets):
        text = _decode(conv)
        if text.startswith("A"):
            new = [TWO_CHARS] + _encode("=42") if "<tool_response>" in text else _encode(CALL)
        elif text.startswith("B"):
            new = _encode("no tools needed")
        else:
            new = _encode(CALL)
        out.append((new[:budget], [-(k + 1) / 10 for k in range(len(new[:budget]))]))
    return out


def test_the_loop_keeps_the_model_tokens_and_masks_the_tool_turns():
    executor = ToolExecutor([CALCULATOR])
    config = AgentConfig(max_assistant_turns=3, max_response_tokens=400)
    out = run_agent([_encode("A?"), _encode("B?"), _encode("C?")], _scripted, _encode, _decode, executor, config)
    tool_turn = _encode(hermes_tool_turn([ToolResult("calculator", "42", ok=True)]))
    want_a = _encode(CALL) + tool_turn + [TWO_CHARS] + _encode("=42")
    n = len(want_a)
    assert out.responses[0, :n].tolist() == want_a  # the two-character token stays one token
    assert out.response_mask[0].sum() == n and out.responses[0, n:].tolist() == [0] * (400 - n)
    assert out.loss_mask[0, :n].tolist() == [1] * len(CALL) + [0] * len(tool_turn) + [1] * 4
    model_logp = [-(k + 1) / 10 for k in range(len(CALL))] + [0.0] * len(tool_turn) + [-0.1, -0.2, -0.3, -0.4]
    np.testing.assert_allclose(out.rollout_log_probs[0, :n], model_logp, rtol=1e-6)
    assert out.turns.tolist() == [2, 1, 3] and out.tool_calls.tolist() == [1, 0, 2]  # "C" stops at 3 turns
    assert out.loss_mask[1].sum() == out.response_mask[1].sum() == len("no tools needed")
    assert out.tokens_by_source["tool"].tolist() == [len(tool_turn), 0, 2 * len(tool_turn)]
    metrics = out.metrics()
    assert metrics["agent/tool_calls/mean"] == 1.0 and executor.counts["calls"] == 3
    # "C": two calls and their answers (354 tokens), then a third call cut at the 400-token budget
    assert metrics["agent/conversation_length/max"] == 400
    assert out.tokens_by_source["model"][2] == 400 - 2 * len(tool_turn)
    # A budget that a tool turn does not fit ends the conversation, cut at the budget.
    short = run_agent([_encode("C?")], _scripted, _encode, _decode, executor, AgentConfig(max_response_tokens=100))
    assert short.response_mask.sum() == 100 and short.turns.tolist() == [1]
    assert short.loss_mask[0].tolist() == [1] * len(CALL) + [0] * (100 - len(CALL))
    # max_user_turns (verl's): "C" gets one tool turn, then its second call ends the conversation.
    one_answer = AgentConfig(max_assistant_turns=3, max_user_turns=1, max_response_tokens=400)
    limited = run_agent([_encode("C?")], _scripted, _encode, _decode, executor, one_answer)
    assert limited.turns.tolist() == [2] and limited.tool_calls.tolist() == [1]
    assert limited.response_mask.sum() == 2 * len(CALL) + len(tool_turn)
    executor.close()


def _check(guess: str, ground_truth: str) -> str:
    return "right" if guess == ground_truth else "wrong"


CHECK = Tool(
    "check",
    "Checks a guess against the sample's answer.",
    {"type": "object", "properties": {"guess": {"type": "string"}}, "required": ["guess"]},
    _check,
)


def test_a_samples_tools_kwargs_reach_its_tool_calls_and_the_model_cannot_set_them():
    """verl's ``extra_info.tools_kwargs[tool]["create_kwargs"]``: each conversation's tool calls
    get its own row's keyword arguments beside the model's; a model that passes one itself is
    answered with an error (not in the tool's schema)."""
    honest = '<tool_call>{"name": "check", "arguments": {"guess": "7"}}</tool_call>'
    forged = '<tool_call>{"name": "check", "arguments": {"guess": "7", "ground_truth": "7"}}</tool_call>'

    def guesser(conversations, budgets, rows):
        texts = [_decode(c) for c in conversations]
        turns = [_encode("ok" if "<tool_response>" in t else forged if t == "F" else honest) for t in texts]
        return [(t, [-1.0] * len(t)) for t in turns]

    def row(truth):
        return {"extra_info": {"tools_kwargs": {"check": {"create_kwargs": {"ground_truth": truth}}}}}

    executor = ToolExecutor([CHECK])
    prompts, samples = [_encode("Q"), _encode("Q"), _encode("F")], [row("7"), row("8"), row("8")]
    out = run_agent(prompts, guesser, _encode, _decode, executor, AgentConfig(), samples=samples)
    answers = [_decode(r[(m > 0) & (lm == 0)]) for r, m, lm in zip(out.responses, out.response_mask, out.loss_mask)]
    refused = "Error: unknown argument(s) ['ground_truth']; check takes ['guess']"
    want = [ToolResult("check", "right", True), ToolResult("check", "wrong", True), ToolResult("check", refused, False)]
    assert answers == [hermes_tool_turn([w]) for w in want]
    assert out.tool_errors.tolist() == [0, 0, 1]
    executor.close()
    assert sample_tool_kwargs(row("7"), "check") == {"ground_truth": "7"} and sample_tool_kwargs(None, "check") == {}
    with pytest.raises(ValueError, match=r"tools_kwargs\['check'\].create_kwargs must be a dict"):
        sample_tool_kwargs({"extra_info": {"tools_kwargs": {"check": {"create_kwargs": "7"}}}}, "check")


# The engine's tests share one model, sampler and shapes (4 conversations of at most 18
# tokens, pages of 4 tokens, a fixed pool for `generate`), so that they compile two programs
# between them: the session's and `generate`'s.
PROMPTS = [[5, 6], [9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33]]
BUDGET = 13  # max_response_tokens: the longest conversation is 5 + 13 = 18 tokens


@pytest.fixture(scope="module")
def tiny_lm():
    """A one-layer random llama of 64 tokens, for the engine's turns."""
    import jaxflow.models as models

    return models.init_model(models.get_preset("tiny_llama", vocab_size=64, num_layers=1), "lm", seed=0)


def _engine_settings():
    """(`SamplingParams`, `EngineOptions`) of the engine's tests: 3 tokens a turn at
    temperature 1 (the engine's keys per row and token make a draw the same in every path), no
    EOS."""
    from jaxflow.sampling import EngineOptions, SamplingParams

    params = SamplingParams(max_new_tokens=3, temperature=1.0, eos_token_ids=(), seed=3)
    return params, EngineOptions(page_size=4, kv_tokens=256)


def test_engine_turns_are_the_engines_samples(tiny_lm):
    """`engine_turns` (its KV pages kept between turns, the default) over the rollout engine:
    a conversation without tool calls is one turn whose tokens and log-probs are
    `jaxflow.sampling.generate`'s own for that prompt, bit for bit (a first turn prefills the
    whole prompt, as `generate` does)."""
    from jaxflow.sampling import generate

    params, options = _engine_settings()
    sampler = engine_turns(tiny_lm, params, options=options)
    out = run_agent(
        PROMPTS,
        sampler,
        lambda text: [],
        lambda ids: "",  # nothing parses as a tool call
        ToolExecutor([]),
        AgentConfig(max_response_tokens=BUDGET),
    )
    ids, mask = np.zeros((4, 5), np.int32), np.zeros((4, 5), np.int32)
    for row, prompt in enumerate(PROMPTS):
        ids[row, 5 - len(prompt) :], mask[row, 5 - len(prompt) :] = prompt, 1
    want = generate(tiny_lm, ids, mask, params, options=options)
    np.testing.assert_array_equal(out.responses[:, :3], np.asarray(want.responses))
    np.testing.assert_array_equal(out.rollout_log_probs[:, :3], np.asarray(want.log_probs))
    assert out.loss_mask.tolist() == out.response_mask.tolist() == [[1] * 3 + [0] * (BUDGET - 3)] * 4
    assert sampler.stats[0]["pages_held"] > 0 and sampler.session is None  # the session's call, its pages given back


class _Replies:
    """An environment that answers every turn with the same ``reply`` and is done after
    ``turns`` turns."""

    def __init__(self, reply: str, turns: int):
        self.reply, self.turns, self.taken = reply, turns, 0

    def reset(self, sample):
        return None

    def step(self, action):
        self.taken += 1
        return self.reply, 0.0, self.taken >= self.turns


def test_kv_reuse_prefills_only_the_new_tokens_and_samples_what_a_reprefill_samples(tiny_lm):
    """Four conversations (prompts of 2 to 5 tokens, replies of 1 to 3 tokens, one done after
    two turns, one cut by its budget in its third) sampled by `engine_turns` with the KV pages
    kept between turns and with every turn prefilled again: the same tokens, the
    log-probs within 8 float32 ulps (a resumed conversation's keys and values were computed by
    decode steps, a re-prefill's by prefill chunks: XLA:CPU's products round a row differently
    by the matrices' shapes; one ulp was seen). Turn 2 runs the model on the last sampled token
    and the reply only, turn 3 likewise for the three conversations left; the one that ended
    holds no pages after turn 3, and `run_agent` gives every page back at the end."""
    params, options = _engine_settings()
    replies, turns = ["a", "bc", "def", "g"], [3, 2, 3, 3]
    config = AgentConfig(max_assistant_turns=3, max_response_tokens=BUDGET, observation_turn=lambda text: text)
    runs = {}
    for reuse in (True, False):
        sampler = engine_turns(tiny_lm, params, reuse_kv=reuse, options=options)
        envs = [_Replies(r, t) for r, t in zip(replies, turns)]
        out = run_agent(
            PROMPTS,
            sampler,
            lambda text: [ord(c) - 87 for c in text],
            lambda ids: "",
            ToolExecutor([]),
            config,
            environments=envs,
        )
        runs[reuse] = out, sampler
    (kept, sampler), (again, _) = runs[True], runs[False]
    np.testing.assert_array_equal(kept.responses, again.responses)
    np.testing.assert_allclose(kept.rollout_log_probs, again.rollout_log_probs, rtol=8 * 2.0**-23, atol=0)
    assert kept.turns.tolist() == [3, 2, 3, 3] and kept.response_mask.sum(1).tolist() == [11, 8, 13, 11]
    prefilled = [np.asarray(s["prefill_tokens"]).tolist() for s in sampler.stats]
    assert prefilled == [[2, 5, 3, 4], [1 + 1, 1 + 2, 1 + 3, 1 + 1], [1 + 1, 1 + 3, 1 + 1]]
    reprefilled = [np.asarray(s["prefill_tokens"]).tolist() for s in runs[False][1].stats]
    assert reprefilled[2] == [2 + 8, 3 + 12, 4 + 8]  # the whole conversation, every turn
    # after turn 3: conversations 0, 2, 3 cache their tokens but the last sampled (pages of 4)
    assert sampler.stats[2]["pages_held"] == -(-(2 + 10) // 4) + -(-(3 + 12) // 4) + -(-(4 + 10) // 4)
    assert sampler.session is None


def test_a_session_resumes_the_conversations_that_continue_and_frees_the_others(tiny_lm):
    """`KVSession` directly (the shapes of the test above: its program, no compilation): a
    conversation that diverges inside its cached tokens is prefilled from its first token, one
    left out of a call gives its pages back, a conversation that would pass ``max_len`` is
    refused, ``release`` frees every page."""
    from jaxflow.sampling import KVSession

    params, options = _engine_settings()
    with pytest.raises(ValueError, match="n = 1"):
        KVSession(*nnx.split(tiny_lm), dataclasses.replace(params, n=2), conversations=4, max_len=18)
    session = KVSession(*nnx.split(tiny_lm), params, conversations=4, max_len=5 + BUDGET, options=options)
    prompts = PROMPTS
    first = session.generate(prompts, 3)
    assert np.asarray(first.stats["prefill_tokens"]).tolist() == [2, 5, 3, 4]
    assert session.pages_held == sum(-(-(len(p) + 2) // 4) for p in prompts)  # prompt + 2 sampled tokens cached
    sampled = np.asarray(first.responses).tolist()
    convs = [prompts[0] + sampled[0] + [40], [9, 10, 11, 12, 14, 1, 2], prompts[2] + sampled[2] + [41, 42]]
    second = session.generate(convs, 3)  # conversation 3 left out, conversation 1 diverges at its 5th token
    assert np.asarray(second.stats["prefill_tokens"]).tolist() == [1 + 1, 7, 1 + 2]
    assert session.pages_held == sum(-(-(len(c) + 2) // 4) for c in convs)
    with pytest.raises(ValueError, match="max_len=18"):
        session.generate([list(range(1, 17))], 3)  # 16 tokens and 3 new
    session.release()
    assert session.pages_held == 0


class _Guess:
    """Guess a digit: "higher" / "lower" and -0.1 per miss, 1.0 and done on a hit."""

    def reset(self, sample):
        self.secret = sample["secret"]
        return "Guess a digit."

    def step(self, action):
        guess = int(action.strip()[-1])
        if guess == self.secret:
            return None, 1.0, True
        return ("higher" if guess < self.secret else "lower"), -0.1, False


def _guesser(conversations, budgets, rows):
    """Guesses 3, then 5, then 7, ... (one more per answer it got)."""
    out = []
    for conv in conversations:
        text = _decode(conv)
        guess = 3 + 2 * (text.count("higher") + text.count("lower"))
        new = _encode(f"I guess {guess}")
        out.append((new, [-0.5] * len(new)))
    return out


def test_environment_rewards_land_on_their_turns_and_reach_the_estimators():
    """Two conversations with a guessing environment (secrets 7 and 9, three model turns at
    most): each reward sits on the last token of the turn it answered, observations are
    untrained, and the advantage estimators read them as token-level rewards (GRPO: the
    group-normalised sums; GAE with gamma = lam = 1 and zero values over the trained tokens:
    the reward-to-go), checked against NumPy."""
    import jax.numpy as jnp

    from jaxflow.algos import compute_gae_advantage_return, compute_grpo_outcome_advantage

    envs = [_Guess(), _Guess()]
    config = AgentConfig(max_assistant_turns=3, max_response_tokens=300)
    prompts = [_encode("P:"), _encode("P:")]
    out = run_agent(
        prompts,
        _guesser,
        _encode,
        _decode,
        ToolExecutor([]),
        config,
        environments=envs,
        samples=[{"secret": 7}, {"secret": 9}],
    )
    turn = len("I guess 3")
    first, higher = len(_encode(chatml_user_turn("Guess a digit."))), len(_encode(chatml_user_turn("higher")))
    want_mask = [0] * first + [1] * turn + [0] * higher + [1] * turn + [0] * higher + [1] * turn
    assert out.turns.tolist() == [3, 3]
    for row in (0, 1):
        assert out.loss_mask[row, : len(want_mask)].tolist() == want_mask
        assert out.response_mask[row].sum() == len(want_mask)
    ends = [first + turn - 1, first + 2 * turn + higher - 1, first + 3 * turn + 2 * higher - 1]
    want_rewards = np.zeros((2, 300), np.float32)
    want_rewards[0, ends] = [-0.1, -0.1, 1.0]
    want_rewards[1, ends] = [-0.1, -0.1, -0.1]  # no hit within three turns
    np.testing.assert_allclose(out.token_rewards, want_rewards, rtol=1e-6)
    assert _decode(out.responses[0, : len(want_mask)]).endswith("I guess 7")
    m = out.loss_mask
    grpo, _ = compute_grpo_outcome_advantage(jnp.asarray(out.token_rewards), jnp.asarray(m), jnp.asarray([0, 0]))
    scores = want_rewards.sum(1)
    z = (scores - scores.mean()) / (scores.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(np.asarray(grpo), z[:, None] * m, rtol=1e-5, atol=1e-6)
    _, returns = compute_gae_advantage_return(
        jnp.asarray(out.token_rewards), jnp.zeros((2, 300)), jnp.asarray(m), gamma=1.0, lam=1.0
    )
    to_go = np.cumsum(want_rewards[:, ::-1], axis=1)[:, ::-1]  # rewards sit on trained tokens only
    np.testing.assert_allclose(np.asarray(returns) * m, to_go * m, rtol=1e-5, atol=1e-6)
