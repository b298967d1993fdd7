"""Built-in verifiable tasks, generated from a seed: RL runs that need no download.

Each task draws short problems (prompts of at most ~12 characters, answers of at most ~6) that
a tiny transformer with :class:`~jaxflow.data.char_tokenizer.CharTokenizer` learns in minutes
on a CPU:

===============  =====================  ==========  ==============================
data_source      prompt                 answer      parameters
===============  =====================  ==========  ==============================
jaxflow/addition ``12+345=``            ``357``     ``digits`` (default 2: 0..99)
jaxflow/sort     ``sort:3140=``         ``0134``    ``min_len``/``max_len`` (3..5)
jaxflow/reverse  ``rev:abcd=``          ``dcba``    ``min_len``/``max_len`` (3..5)
jaxflow/reverse_ ``rev:314=``           ``413``     ``min_len``/``max_len`` (3..3),
digits                                              30% held out (the default task)
jaxflow/         ``mul:482*937=``       ``451634``  ``digits`` (3), ``tool_fraction``
calculator                                          (0.25), ``sum_fraction`` (0): a
                                                    tool task (below)
jaxflow/code     ``code:x*7+2=``        tests       a code task (below)
===============  =====================  ==========  ==============================

``make_examples(n, seed, split)`` returns verl-schema rows::

    {"data_source": "jaxflow/addition",
     "prompt": [{"role": "user", "content": "12+34="}],
     "ability": "arithmetic",
     "reward_model": {"style": "rule", "ground_truth": "46"},
     "extra_info": {"split": "train", "index": 0, "question": "12+34=", "answer": "46"}}

Splits are disjoint whatever the seeds: a problem belongs to ``test`` when a CRC32 of its prompt
falls in the lowest ``test_fraction`` of the range, else to ``train``; sampling draws from the
task's distribution and keeps the problems of the requested split. The test split is drawn
without repeats while it holds unseen problems (so a held-out score counts distinct problems),
then with repeats; the train split with repeats. The same ``(n, seed, split)`` always gives
the same rows.

``make_sft_examples`` gives the same problems as prompt/response pairs, the demonstrations for
a supervised warm start before RL (the SFT data appends EOS to the response).

The calculator task is for multi-turn rollouts (``actor_rollout_ref.rollout.multi_turn``): its
products are too large for a tiny model to compute, so it scores by calling the ``calculator``
tool (`jaxflow.agents.CALCULATOR`) in the hermes format and copying the tool's answer. Its
demonstrations answer products directly except a ``tool_fraction`` of them, which are the whole
conversation: the call, the tool's turn (`tool_response_turn`) and the answer; a
``sum_fraction`` of them are instead sums worked through the tool the same way. So a model
warm-started on them can call the tool and copy its answer (learnt on the sums), mostly answers
products directly (and wrongly) and sometimes calls the tool on them, which RL can reinforce.

The code task asks for a one-line Python function ``f(x)`` computing an affine expression; its
ground truth is hidden tests (``assert f(3) == 23``, five of them, JSON), its demonstration the
function (``def f(x):\n    return x*7+2``). Its reward is the sandboxed code scorer
(`jaxflow.rewards.score_code`, data_source ``jaxflow/code``: the fraction of tests passed),
not `task_reward` (``Task.rule_reward`` is False).

Reward (`task_reward`, registered for each data_source by `jaxflow.workers.reward`): 1.0 when the
response's final answer (after the last tool response, if any), up to an ``<eos>`` and with
surrounding whitespace stripped, equals the answer; else 0.0. ``partial_credit=True`` gives
instead the fraction of answer positions matched (a denser, optional signal).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import string
import zlib
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

SPLITS = ("train", "test")
DISTINCT_TRIES = 1000  # test split: draws of repeats refused before the split counts as exhausted
_EOS_TEXT = "<eos>"
TOOL_RESPONSE_END = "</tool_response>"


def tool_response_turn(contents: Sequence[str]) -> str:
    """A tool turn for tokenizers without a chat template of roles (the built-in character
    tokenizer): each answer between ``<tool_response>`` and ``</tool_response>``, the next
    model turn following at once. (ChatML templates: `jaxflow.agents.hermes_tool_turn`.)"""
    return "".join(f"<tool_response>{c}{TOOL_RESPONSE_END}" for c in contents)


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call in the hermes format (compact JSON), as a demonstration writes it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, separators=(',', ':'))}</tool_call>"


@dataclasses.dataclass(frozen=True)
class Task(abc.ABC):
    """A generator of (prompt, answer) problems; subclasses define :meth:`sample`.

    A subclass names itself in its class statement, ``class MyTask(Task, name="my",
    ability="..."):``; its ``data_source`` is ``jaxflow/<name>``. A subclass of a task keeps
    what it does not name again.

    Attributes:
      test_fraction: share of the problem space reserved for the test split.
    """

    name: ClassVar[str] = ""
    data_source: ClassVar[str] = ""
    ability: ClassVar[str] = ""
    rule_reward: ClassVar[bool] = True  # scored by `task_reward` (else by its data_source's own reward)
    test_fraction: float = 0.1

    def __init_subclass__(cls, *, name: str | None = None, ability: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name, cls.data_source = name, f"jaxflow/{name}"
        if ability is not None:
            cls.ability = ability

    @abc.abstractmethod
    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        """One random ``(prompt_text, answer)``."""

    def split_of(self, prompt: str) -> str:
        """``"test"`` or ``"train"``: the split ``prompt`` belongs to (fixed, seed-free)."""
        bucket = zlib.crc32(f"{self.data_source}|{prompt}".encode()) % 1_000_000
        return "test" if bucket < self.test_fraction * 1_000_000 else "train"

    def problems(self, n: int, seed: int = 0, split: str = "train") -> list[tuple[str, str]]:
        """``n`` deterministic ``(prompt_text, answer)`` pairs from ``split``."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = np.random.default_rng([int(seed), SPLITS.index(split), zlib.crc32(self.data_source.encode())])
        out: list[tuple[str, str]] = []
        max_draws = 1000 * n + 10_000
        draws = 0
        seen: set[str] = set()
        stale = 0  # consecutive test-split draws that found no unseen problem
        while len(out) < n:
            draws += 1
            if draws > max_draws:
                raise ValueError(
                    f"{self.data_source}: could not draw {n} problems for split {split!r} "
                    f"(test_fraction={self.test_fraction}); the split is (nearly) empty"
                )
            prompt, answer = self.sample(rng)
            if self.split_of(prompt) != split:
                continue
            if split == "test" and prompt in seen and stale < DISTINCT_TRIES:
                stale += 1
                continue
            if prompt not in seen:
                stale = 0
                seen.add(prompt)
            out.append((prompt, answer))
        return out

    def make_examples(self, n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
        """``n`` verl-schema rows (see the module docstring)."""
        return [self._row(i, prompt, answer, split) for i, (prompt, answer) in enumerate(self.problems(n, seed, split))]

    def make_sft_examples(self, n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
        """``n`` demonstrations: the rows of :meth:`make_examples` plus ``"response"`` (the answer)."""
        rows = self.make_examples(n, seed, split)
        for row in rows:
            row["response"] = row["reward_model"]["ground_truth"]
        return rows

    def _row(self, index: int, prompt: str, answer: str, split: str) -> dict[str, Any]:
        return {
            "data_source": self.data_source,
            "prompt": [{"role": "user", "content": prompt}],
            "ability": self.ability,
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "question": prompt, "answer": answer},
        }


@dataclasses.dataclass(frozen=True)
class AdditionTask(Task, name="addition", ability="arithmetic"):
    """``a+b=`` -> ``a+b`` for ``a, b`` uniform in ``[0, 10**digits)``."""

    digits: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 5:
            raise ValueError(f"addition digits must be in 1..5 (prompts stay short), got {self.digits}")

    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        a, b = (int(x) for x in rng.integers(0, 10**self.digits, size=2))
        return f"{a}+{b}=", str(a + b)


@dataclasses.dataclass(frozen=True)
class _SequenceTask(Task):
    """``<prefix>:<text>=`` -> ``answer(text)`` for a ``text`` of ``min_len..max_len``
    characters drawn uniformly from ``alphabet`` (both named in the class statement, as the
    task's ``name``)."""

    min_len: int = 3
    max_len: int = 5
    alphabet: ClassVar[str] = ""
    prefix: ClassVar[str] = ""

    def __init_subclass__(cls, *, alphabet: str | None = None, prefix: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if alphabet is not None:
            cls.alphabet = alphabet
        if prefix is not None:
            cls.prefix = prefix

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len <= 6:
            raise ValueError(f"{self.name}: need 1 <= min_len <= max_len <= 6, got {self.min_len}, {self.max_len}")

    @staticmethod
    @abc.abstractmethod
    def answer(text: str) -> str:
        """The answer to the problem ``text``."""

    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        length = int(rng.integers(self.min_len, self.max_len + 1))
        text = "".join(self.alphabet[int(i)] for i in rng.integers(0, len(self.alphabet), size=length))
        return f"{self.prefix}:{text}=", self.answer(text)


@dataclasses.dataclass(frozen=True)
class SortDigitsTask(_SequenceTask, name="sort", ability="sorting", alphabet=string.digits, prefix="sort"):
    """``sort:3140=`` -> ``0134``: the digits in ascending order."""

    @staticmethod
    def answer(text: str) -> str:
        return "".join(sorted(text))


@dataclasses.dataclass(frozen=True)
class ReverseTask(_SequenceTask, name="reverse", ability="string", alphabet=string.ascii_lowercase, prefix="rev"):
    """``rev:abcd=`` -> ``dcba``: lowercase letters reversed."""

    @staticmethod
    def answer(text: str) -> str:
        return text[::-1]


@dataclasses.dataclass(frozen=True)
class ReverseDigitsTask(ReverseTask, name="reverse_digits", alphabet=string.digits):
    """``rev:314=`` -> ``413``: a digit string reversed. The default task of the tiny configs:
    with three digits, 30% of the 1000 strings (about 300) are held out, and a policy that
    learns to reverse solves those it never trained on."""

    min_len: int = 3
    max_len: int = 3
    test_fraction: float = 0.3


@dataclasses.dataclass(frozen=True)
class CalculatorTask(Task, name="calculator", ability="tool"):
    """``mul:482*937=`` -> ``451634``: a product of two ``digits``-digit numbers, meant to be
    computed by calling the ``calculator`` tool (module docstring).

    Its demonstrations (:meth:`make_sft_examples`): a ``sum_fraction`` of them are sums of two
    ``digits + 2``-digit numbers (``add:48211+93702=``, answers of as many digits as the
    products'), each worked through the tool: the call, the tool's answer, the answer copied.
    The others are products, answered directly except a ``tool_fraction`` of them, worked
    through the tool. So the sums teach the call and the copy without showing that products
    need the tool; RL finds that out. (Which demonstrations call the tool is fixed per problem
    by its prompt.) The RL prompts and the held-out problems are products only."""

    digits: int = 3
    tool_fraction: float = 0.25
    sum_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not 2 <= self.digits <= 6:
            raise ValueError(f"calculator digits must be in 2..6, got {self.digits}")
        for name in ("tool_fraction", "sum_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"calculator {name} must be in [0, 1], got {getattr(self, name)}")

    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        a, b = (int(x) for x in rng.integers(10 ** (self.digits - 1), 10**self.digits, size=2))
        return f"mul:{a}*{b}=", str(a * b)

    def sum_problems(self, n: int, seed: int = 0) -> list[tuple[str, str]]:
        """``n`` deterministic sums ``("add:48211+93702=", "141913")`` of two ``digits + 2``-digit
        numbers (never held out: the held-out problems are products)."""
        rng = np.random.default_rng([int(seed), zlib.crc32(b"jaxflow/calculator/sums")])
        low, high = 10 ** (self.digits + 1), 10 ** (self.digits + 2)
        pairs = rng.integers(low, high, size=(n, 2))
        return [(f"add:{a}+{b}=", str(int(a) + int(b))) for a, b in pairs]

    def make_sft_examples(self, n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
        num_sums = round(n * self.sum_fraction) if split == "train" else 0  # held out: products only
        rows = super().make_sft_examples(n - num_sums, seed, split)
        for row in rows:
            if zlib.crc32(f"tool|{row['extra_info']['question']}".encode()) % 1000 < self.tool_fraction * 1000:
                row["response"] = _worked_with_tool(row["extra_info"]["question"], row["response"])
        sums = [self._row(0, prompt, answer, split) for prompt, answer in self.sum_problems(num_sums, seed)]
        for row in sums:
            row["response"] = _worked_with_tool(row["extra_info"]["question"], row["reward_model"]["ground_truth"])
        if not sums:
            return rows
        both = rows + sums
        out = [both[i] for i in np.random.default_rng([int(seed), 11]).permutation(n)]
        for i, row in enumerate(out):
            row["extra_info"]["index"] = i
        return out


def _worked_with_tool(question: str, answer: str) -> str:
    """The demonstration of ``question`` (``mul:482*937=``) through the calculator: the hermes
    call with the expression, the tool's turn with ``answer``, then ``answer``."""
    expression = question.split(":", 1)[1].removesuffix("=")
    call = hermes_call("calculator", {"expression": expression})
    return f"{call}{_EOS_TEXT}{tool_response_turn([answer])}{answer}"


@dataclasses.dataclass(frozen=True)
class CodeTask(Task, name="code", ability="code"):
    """``code:x*7+2=`` -> hidden tests of ``f(x) = x*7+2`` (module docstring): ``a`` in
    1..9, ``op`` one of ``+ - *``, ``b`` in 0..9; ``tests`` tests at x = -3, 0, 1, 4, 10."""

    rule_reward: ClassVar[bool] = False
    test_fraction: float = 0.2
    POINTS: ClassVar[tuple[int, ...]] = (-3, 0, 1, 4, 10)

    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        a, b, op = int(rng.integers(1, 10)), int(rng.integers(0, 10)), "+-*"[int(rng.integers(0, 3))]
        expression = f"x*{a}{op}{b}"
        f = eval(f"lambda x: {expression}")  # our own arithmetic, not user text
        return f"code:{expression}=", json.dumps([f"assert f({x}) == {f(x)}" for x in self.POINTS])

    def make_sft_examples(self, n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
        rows = self.make_examples(n, seed, split)
        for row in rows:
            expression = row["extra_info"]["question"].removeprefix("code:").removesuffix("=")
            row["response"] = f"def f(x):\n    return {expression}"
        return rows


TASKS: dict[str, type[Task]] = {
    t.name: t for t in (AdditionTask, SortDigitsTask, ReverseTask, ReverseDigitsTask, CalculatorTask, CodeTask)
}


def get_task(name: str, **params: Any) -> Task:
    """The task called ``name`` (``"addition"`` or ``"jaxflow/addition"``) with ``params``."""
    by_source = {t.data_source: t for t in TASKS.values()}
    cls = TASKS.get(name) or by_source.get(name)
    if cls is None:
        raise KeyError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return cls(**params)


def make_mixed_examples(
    tasks: Sequence[Task | str], n: int, seed: int = 0, split: str = "train", sft: bool = False
) -> list[dict[str, Any]]:
    """``n`` rows drawn evenly from several tasks, shuffled deterministically, reindexed."""
    tasks = [get_task(t) if isinstance(t, str) else t for t in tasks]
    if not tasks:
        raise ValueError("make_mixed_examples needs at least one task")
    per_task = math.ceil(n / len(tasks))
    rows = []
    for k, task in enumerate(tasks):
        make = task.make_sft_examples if sft else task.make_examples
        rows.extend(make(per_task, seed=seed * 1009 + k, split=split))
    order = np.random.default_rng([int(seed), SPLITS.index(split), 7]).permutation(len(rows))[:n]
    out = [rows[i] for i in order]
    for i, row in enumerate(out):
        row["extra_info"]["index"] = i
    return out


def task_reward(
    solution_str: str, ground_truth: str, extra_info: dict | None = None, partial_credit: bool = False
) -> float:
    """1.0 for the exact final answer (after the last tool response, if any) before any
    ``<eos>`` (whitespace-stripped), else 0.0.

    With ``partial_credit``: the fraction of answer positions that match, divided by the longer
    of the two lengths (so extra characters cost too).
    """
    del extra_info
    answer = solution_str.rsplit(TOOL_RESPONSE_END, 1)[-1].split(_EOS_TEXT, 1)[0].strip()
    truth = str(ground_truth).strip()
    if answer == truth:
        return 1.0
    if not partial_credit:
        return 0.0
    matched = sum(a == b for a, b in zip(answer, truth))
    return matched / max(len(answer), len(truth), 1)
