"""Multi-turn rollouts with tools and environments: a conversation alternates model turns and
tool or environment turns until the model answers without a tool call (and its environment,
if any, says done), a turn limit, or the response's token budget.

An `Environment` (one per conversation) is told each model turn that calls no tool
(``step(action) -> (observation, reward, done)``); its reward lands on that turn's last token
(``token_rewards``: turn-level rewards, and the final one at the end, where the advantage
estimators read ``token_level_rewards``), its observation is appended as an untrained turn.

Token in, token out: the model's tokens are kept exactly as sampled (never decoded and
encoded again); a tool turn is rendered once (``AgentConfig.tool_turn``: the chat template's
tool role around the answers) and encoded once, then appended. Every turn of every
conversation that is still going is sampled in one engine call (`generate_turns`: the
caller's engine, e.g. `engine_turns` over the rollout engine); the tool calls of all
conversations of a turn run concurrently (`jaxflow.agents.tools.ToolExecutor`), so one slow
tool does not add up over conversations.

KV reuse. `engine_turns` (`jaxflow.sampling.EngineTurns`, the actor's multi-turn sampler too)
keeps each conversation's KV pages in the engine between its turns
(`jaxflow.sampling.session.KVSession`): a model turn runs the model only on the tokens
appended since the conversation's last turn (the last sampled token and the tool or
observation turn), not on the whole conversation again. A conversation that ended gives its
pages back at the next turn's call, and all are given back when `run_agent` returns (it calls
the sampler's ``release()``). The tokens and log-probs are those of sampling each turn from
the whole conversation (bit for bit for a ``batch_invariant`` model; else to the float32
rounding of the model's projections in decode vs prefill shapes). With a mesh the session
runs as one replica spanning it (``reuse_kv=False``: every turn prefilled from the whole
conversation, split over the mesh's replicas).

The result (`AgentRollout`) has the single-turn rollout's columns, ``[B, R]`` after the prompt:
``responses`` (model and tool tokens in order), ``response_mask`` (every real token),
``loss_mask`` (1 on the model's own tokens only: `UpdateLoopConfig.use_loss_mask` trains on
those) and ``rollout_log_probs`` (the sampled tokens' log-probs, 0 on tool tokens), plus
per-conversation counts for the metrics."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from jaxflow.agents.tools import FORMATS, ToolExecutor, ToolResult, parse_tool_calls, sample_tool_kwargs


def hermes_tool_turn(results: Sequence[ToolResult]) -> str:
    """The tool turn of the Qwen2.5 / Qwen3 chat templates (ChatML with the ``tool`` answers
    wrapped in ``<tool_response>``), ending where the next assistant turn starts."""
    body = "\n".join(f"<tool_response>\n{r.content}\n</tool_response>" for r in results)
    return f"<|im_end|>\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def chatml_user_turn(observation: str) -> str:
    """An environment's observation as the next user turn of a ChatML template."""
    return f"<|im_end|>\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"


class Environment(Protocol):
    """A multi-step task: ``reset(sample)`` starts it for a dataset sample and returns the
    first observation (text appended after the prompt, untrained; None or "" for none);
    ``step(action)`` takes the text of a model turn and returns ``(observation, reward,
    done)``."""

    def reset(self, sample: Any) -> str | None: ...

    def step(self, action: str) -> tuple[str | None, float, bool]: ...


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """``fmt``: the tool-call format (`jaxflow.agents.tools.FORMATS`); ``max_assistant_turns``:
    model turns per conversation; ``max_user_turns``: tool and observation turns after the
    model's (verl's; 0: no limit; at the limit the conversation ends after the model's turn);
    ``max_response_tokens``: the response's budget (model and
    tool tokens; a tool turn that does not fit ends the conversation, cut); ``tool_turn``:
    renders a turn's tool answers (default: `hermes_tool_turn`); ``observation_turn``: an
    environment's observation (default: `chatml_user_turn`)."""

    fmt: str = "hermes"
    max_assistant_turns: int = 4
    max_response_tokens: int = 256
    max_user_turns: int = 0
    tool_turn: Callable[[Sequence[ToolResult]], str] = hermes_tool_turn
    observation_turn: Callable[[str], str] = chatml_user_turn

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {self.fmt!r}")
        if self.max_assistant_turns < 1 or self.max_response_tokens < 1:
            raise ValueError("max_assistant_turns and max_response_tokens must be >= 1")
        if self.max_user_turns < 0:
            raise ValueError(f"max_user_turns must be >= 0 (0: no limit), got {self.max_user_turns}")


@dataclasses.dataclass(frozen=True)
class AgentRollout:
    """``[B, R]`` columns after each prompt (see the module docstring) and per conversation:
    ``turns`` (model turns), ``tool_calls``, ``tool_errors``, ``tool_timeouts``, and
    ``tokens_by_source`` (``{"model": [B], "tool": [B]}``: the tool count holds environment
    observations too); ``token_rewards`` [B, R]: each environment reward on the last token of
    the model turn it answered (zeros without environments)."""

    responses: np.ndarray
    response_mask: np.ndarray
    loss_mask: np.ndarray
    rollout_log_probs: np.ndarray
    token_rewards: np.ndarray
    turns: np.ndarray
    tool_calls: np.ndarray
    tool_errors: np.ndarray
    tool_timeouts: np.ndarray
    tokens_by_source: dict[str, np.ndarray]

    def metrics(self) -> dict[str, float]:
        """Means over the conversations (verl-style names)."""
        return {
            "agent/turns/mean": float(self.turns.mean()),
            "agent/tool_calls/mean": float(self.tool_calls.mean()),
            "agent/tool_call_rate": float((self.tool_calls > 0).mean()),  # conversations with a call
            "agent/tool_errors/sum": float(self.tool_errors.sum()),
            "agent/tool_timeouts/sum": float(self.tool_timeouts.sum()),
            "agent/model_tokens/mean": float(self.tokens_by_source["model"].mean()),
            "agent/tool_tokens/mean": float(self.tokens_by_source["tool"].mean()),
            "agent/conversation_length/mean": float(self.response_mask.sum(1).mean()),
            "agent/conversation_length/max": float(self.response_mask.sum(1).max()),
        }


# A model turn sampler: token-id lists (each the whole conversation so far), each one's token
# budget and each one's conversation index (which keys its randomness) -> per conversation the
# new tokens and their log-probs. One that has a ``release()`` method (`engine_turns`') holds
# state for the conversations between turns; `run_agent` calls it once every conversation has
# ended.
TurnSampler = Callable[[list[list[int]], list[int], list[int]], list[tuple[list[int], list[float]]]]


@dataclasses.dataclass
class _Conversation:
    """One conversation's response so far (after its prompt), token by token."""

    budget: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    trained: list[int] = dataclasses.field(default_factory=list)
    rewards: dict[int, float] = dataclasses.field(default_factory=dict)  # token index -> reward
    turns: int = 0
    user_turns: int = 0  # tool and observation turns answering the model's
    calls: int = 0
    errors: int = 0
    timeouts: int = 0

    @property
    def room(self) -> int:
        return self.budget - len(self.tokens)

    def model_turn(self, new: Sequence[int], log_probs: Sequence[float]) -> list[int]:
        """The sampled tokens (cut at the budget) appended as they are; returns them."""
        kept = list(new)[: self.room]
        self.tokens += kept
        self.log_probs += list(log_probs)[: len(kept)]
        self.trained += [1] * len(kept)
        self.turns += 1
        return kept

    def untrained_turn(self, turn: list[int]) -> bool:
        """A tool or observation turn (cut at the budget); whether a model turn still fits."""
        fits = len(turn) < self.room
        turn = turn[: self.room]
        self.tokens += turn
        self.log_probs += [0.0] * len(turn)
        self.trained += [0] * len(turn)
        return fits

    def reward(self, value: float) -> None:
        """An environment's reward for the model turn just taken (on its last token)."""
        last = len(self.tokens) - 1
        self.rewards[last] = self.rewards.get(last, 0.0) + float(value)


def run_agent(
    prompts: Sequence[Sequence[int]],
    generate_turns: TurnSampler,
    encode: Callable[[str], list[int]],
    decode: Callable[[Sequence[int]], str],
    executor: ToolExecutor,
    config: AgentConfig = AgentConfig(),
    pad_token_id: int = 0,
    environments: Sequence[Environment] | None = None,
    samples: Sequence[Any] | None = None,
) -> AgentRollout:
    """Run one conversation per prompt (token ids) to its end and return the rollout; with
    ``environments`` (one per prompt, started with ``samples``), the model turns without a
    tool call go to them."""
    if environments is not None and len(environments) != len(prompts):
        raise ValueError(f"{len(environments)} environments for {len(prompts)} prompts")
    convs = [_Conversation(config.max_response_tokens) for _ in prompts]
    active = list(range(len(prompts)))
    for i, env in enumerate(environments or ()):
        first = env.reset(None if samples is None else samples[i])
        if first and not convs[i].untrained_turn(encode(config.observation_turn(first))):
            active.remove(i)
    while active:
        outs = generate_turns(
            [list(prompts[i]) + convs[i].tokens for i in active], [convs[i].room for i in active], active
        )
        tool_calls, still = {}, []
        for i, (new, log_probs) in zip(active, outs):
            c = convs[i]
            text = decode(c.model_turn(new, log_probs))
            parsed = parse_tool_calls(text, config.fmt)
            more = c.turns < config.max_assistant_turns and c.room > 0
            if config.max_user_turns:
                more = more and c.user_turns < config.max_user_turns
            if parsed and more:
                tool_calls[i] = parsed
            elif environments is not None:
                observation, reward, done = environments[i].step(text)
                c.reward(reward)
                if not done and more:
                    c.user_turns += 1
                    if c.untrained_turn(encode(config.observation_turn(observation or ""))):
                        still.append(i)
        calls = [(i, call) for i in tool_calls for call in tool_calls[i]]
        kwargs = [sample_tool_kwargs(samples[i] if samples else None, call.name) for i, call in calls]
        answers = iter(executor.run([call for _, call in calls], kwargs))  # all at once
        for i, parsed in tool_calls.items():
            results = [next(answers) for _ in parsed]
            c = convs[i]
            c.calls += len(parsed)
            c.errors += sum(not r.ok and not r.timed_out for r in results)
            c.timeouts += sum(r.timed_out for r in results)
            c.user_turns += 1
            if c.untrained_turn(encode(config.tool_turn(results))):
                still.append(i)
        active = sorted(still)
    release = getattr(generate_turns, "release", None)
    if release is not None:
        release()
    return _rollout(convs, config.max_response_tokens, pad_token_id)


def _rollout(convs: Sequence[_Conversation], R: int, pad_token_id: int) -> AgentRollout:
    """The conversations as ``[B, R]`` columns (right-padded) and counts."""
    B = len(convs)
    responses = np.full((B, R), pad_token_id, np.int32)
    response_mask, loss_mask = np.zeros((B, R), np.int32), np.zeros((B, R), np.int32)
    log_probs, token_rewards = np.zeros((B, R), np.float32), np.zeros((B, R), np.float32)
    for i, c in enumerate(convs):
        n = len(c.tokens)
        responses[i, :n] = c.tokens
        response_mask[i, :n] = 1
        loss_mask[i, :n] = c.trained
        log_probs[i, :n] = c.log_probs
        for t, r in c.rewards.items():
            token_rewards[i, t] = r
    model = loss_mask.sum(1)
    counts = {
        name: np.asarray([getattr(c, name) for c in convs], np.int32)
        for name in ("turns", "calls", "errors", "timeouts")
    }
    return AgentRollout(
        responses=responses,
        response_mask=response_mask,
        loss_mask=loss_mask,
        rollout_log_probs=log_probs,
        token_rewards=token_rewards,
        turns=counts["turns"],
        tool_calls=counts["calls"],
        tool_errors=counts["errors"],
        tool_timeouts=counts["timeouts"],
        tokens_by_source={"model": model, "tool": response_mask.sum(1) - model},
    )


def engine_turns(model: Any, params: Any, *, reuse_kv: bool = True, **engine: Any) -> TurnSampler:
    """A `TurnSampler` over the rollout engine for ``model`` (a `CausalLM`) with ``params``
    (`SamplingParams`; ``max_new_tokens`` is the most one turn samples, each conversation's
    budget cuts it further): each turn ends at an EOS id (``params.eos_token_ids``, e.g.
    ``<|im_end|>``). The actor's multi-turn rollouts' sampler,
    `jaxflow.sampling.EngineTurns`: ``reuse_kv`` keeps the conversations' KV pages in the
    engine between turns (on any ``mesh``: one replica spanning it); else each turn is
    `jaxflow.sampling.generate_from_state` on the left-padded conversations. ``engine``:
    ``mesh``, ``rules``, ``options``, ``tokenizer``, ``stop_strings``, ``rng``,
    ``row_ids``."""
    from flax import nnx

    from jaxflow.sampling import EngineTurns

    return EngineTurns(*nnx.split(model), params, reuse_kv=reuse_kv, **engine)
