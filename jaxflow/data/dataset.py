"""Prompt datasets in verl's schema (parquet or jsonl), tokenised, batched and resumable.

A row holds ``data_source`` (selects the reward function), the prompt under ``prompt_key``
(default ``"prompt"``: a list of chat messages ``[{"role": ..., "content": ...}]`` or a plain
string), ``reward_model: {"ground_truth": ...}`` and optionally ``extra_info`` (a dict) and
``ability``. :class:`PromptDataset` reads files, renders each prompt with the tokenizer's chat
template (a plain string counts as one user message; ``use_chat_template=False`` encodes
strings as they are), tokenises, and handles prompts longer than ``max_prompt_length`` per
``truncation``:

- ``"error"`` (default): raise, naming the file, row and length;
- ``"left"``: keep the last ``max_prompt_length`` tokens; ``"right"``: keep the first ones;
- ``"filter"``: drop the row.

``dataset.stats`` reports ``num_rows`` read, ``num_truncated``, ``num_filtered`` and
``num_kept``.

:class:`PromptDataLoader` yields :class:`PromptBatch` es: ``prompt_ids [B, P]`` int32
left-padded with the pad id to ``P = max_prompt_length`` (one static shape for jit),
``prompt_mask [B, P]`` int32 (1 on tokens), and the host columns. Epoch ``e`` visits the rows
in the order ``default_rng([seed, e]).permutation(N)``, so the position ``(epoch, index)`` of
:meth:`PromptDataLoader.state_dict` restores the data order exactly after a restart.

Malformed input raises :class:`DatasetError` (a ``ValueError``) naming the problem: unsupported
extension, missing column (with the present ones), empty dataset, a jsonl line that is not
UTF-8 or not a JSON object, a bad prompt, an over-long prompt with ``truncation="error"``.
A missing file raises ``FileNotFoundError``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

SUPPORTED_EXTENSIONS = (".parquet", ".jsonl")
TRUNCATION_MODES = ("error", "left", "right", "filter")


class DatasetError(ValueError):
    """A dataset file or row is malformed; the message names the file, row and problem."""


# ---------------------------------------------------------------------- files


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All rows of a ``.parquet`` or ``.jsonl`` file as dicts."""
    return [row for row, _ in _read_rows_with_location(os.fspath(path))]


def write_rows(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, overwrite: bool = False) -> str:
    """Writes rows to ``path`` (``.parquet`` or ``.jsonl``, by extension); returns the path.

    An existing file is never replaced unless ``overwrite``: the name is claimed with an
    exclusive create, so a file that appears meanwhile is not clobbered either.

    Raises:
      FileExistsError: ``path`` exists (and not ``overwrite``).
    """
    path = os.fspath(path)
    ext = _extension(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Claim the final name exclusively, or (overwrite) write beside it and rename over it.
    target = f"{path}.tmp-{os.getpid()}" if overwrite else path
    try:
        f = open(target, "xb")
    except FileExistsError:
        raise FileExistsError(f"{path} already exists; not replacing it (choose another path or remove it)") from None
    try:
        with f:
            if ext == ".parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.Table.from_pylist([dict(r) for r in rows]), f)
            else:
                for row in rows:
                    f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
    except BaseException:
        os.unlink(target)  # the file this call created, half-written
        raise
    if overwrite:
        os.replace(target, path)
    return path


def write_task_dataset(
    task: Any, path: str | os.PathLike, n: int, seed: int = 0, split: str = "train", sft: bool = False
) -> str:
    """Writes ``n`` rows of a built-in task (a :class:`~jaxflow.data.tasks.Task` or its name)."""
    from jaxflow.data import tasks as tasks_lib

    if isinstance(task, str):
        task = tasks_lib.get_task(task)
    rows = task.make_sft_examples(n, seed, split) if sft else task.make_examples(n, seed, split)
    return write_rows(rows, path)


def write_builtin_datasets(
    directory: str | os.PathLike,
    tasks: Sequence[Any] = ("addition",),
    n_train: int = 4096,
    n_test: int = 256,
    seed: int = 0,
    fmt: str = "parquet",
) -> dict[str, str]:
    """Writes ``train.<fmt>`` and ``test.<fmt>`` of the given tasks (mixed evenly) into
    ``directory``, as verl's data preprocessing scripts do; returns ``{split: path}``.
    Existing files are never replaced (``FileExistsError`` before anything is written)."""
    from jaxflow.data import tasks as tasks_lib

    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"fmt must be 'parquet' or 'jsonl', got {fmt!r}")
    paths = {split: os.path.join(os.fspath(directory), f"{split}.{fmt}") for split in ("train", "test")}
    for path in paths.values():
        if os.path.exists(path):
            raise FileExistsError(f"{path} already exists; not replacing it (choose another directory or remove it)")
    for split, n in (("train", n_train), ("test", n_test)):
        write_rows(tasks_lib.make_mixed_examples(list(tasks), n, seed=seed, split=split), paths[split])
    return paths


def _extension(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUPPORTED_EXTENSIONS:
        raise DatasetError(
            f"{path}: unsupported file extension {ext or '(none)'!r}; supported: {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    return ext


def _read_rows_with_location(path: str) -> list[tuple[dict[str, Any], str]]:
    """Rows with a location string for messages ("row 3" or "line 4")."""
    ext = _extension(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    if ext == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types
            raise DatasetError(f"{path}: cannot read parquet: {type(e).__name__}: {e}") from e
        return [(row, f"row {i}") for i, row in enumerate(table.to_pylist())]
    rows = []
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.strip()
        if not raw:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DatasetError(
                f"{path}: line {lineno} is not valid UTF-8 ({e.reason} at byte {e.start} of the line)"
            ) from None
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: line {lineno} is not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{path}: line {lineno} is a JSON {type(row).__name__}, expected an object")
        rows.append((row, f"line {lineno}"))
    return rows


# ---------------------------------------------------------------------- dataset


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """One batch of prompts.

    Attributes:
      prompt_ids: ``[B, P]`` int32, left-padded with the tokenizer's pad id.
      prompt_mask: ``[B, P]`` int32, 1 on prompt tokens.
      data_source, ground_truth, extra_info: host columns for the reward.
      raw_prompt: the prompt as stored (messages or text).
      prompt_text: the prompt as rendered by the chat template (before truncation).
      index: ``[B]`` int64 row numbers in the dataset.
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    data_source: list[str]
    ground_truth: list[Any]
    extra_info: list[dict[str, Any]]
    raw_prompt: list[Any]
    prompt_text: list[str]
    index: np.ndarray

    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])


def _located_rows(files: list[str], rows: Sequence[Mapping[str, Any]] | None) -> list[tuple[dict, str, str]]:
    """``[(row, file, where in it)]`` of the files in order, or of the rows held in memory
    (``files`` naming them); a `DatasetError` when there are none."""
    if rows is not None:
        located = [(dict(row), ", ".join(files), f"row {i}") for i, row in enumerate(rows)]
    else:
        located = [(row, path, where) for path in files for row, where in _read_rows_with_location(path)]
    if not located:
        raise DatasetError(f"dataset is empty: no rows in {', '.join(files)}")
    return located


class PromptDataset:
    """Tokenised prompts of one or more files (see the module docstring).

    Args:
      files: a path or list of paths (``.parquet`` / ``.jsonl``), concatenated in order.
      tokenizer: anything with ``apply_chat_template``, ``encode`` and ``pad_token_id``
        (:class:`~jaxflow.data.tokenizer.Tokenizer`, or a transformers tokenizer).
      prompt_key: the prompt column.
      max_prompt_length: ``P``; longer prompts are handled per ``truncation``.
      truncation: ``"error"``, ``"left"``, ``"right"`` or ``"filter"``.
      use_chat_template: render prompts with the chat template (else string prompts are
        encoded as they are, with the tokenizer's own special tokens).
      rows: instead of files, rows held in memory (e.g. a built-in task's); ``files`` is then
        a name for them in messages.
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        truncation: str = "error",
        use_chat_template: bool = True,
        rows: Sequence[Mapping[str, Any]] | None = None,
    ):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token to pad prompts with")
        if isinstance(files, (str, os.PathLike)):
            files = [files]
        files = [os.fspath(f) for f in files]
        if not files:
            raise DatasetError("no dataset files given")
        self.files = files
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = int(max_prompt_length)
        self.truncation = truncation
        self.use_chat_template = use_chat_template

        located = _located_rows(files, rows)

        texts, columns = [], []
        for row, path, where in located:
            _check_columns(path, row, self.prompt_key, where)
            texts.append(self._render(row[self.prompt_key], path, where))
            columns.append(_host_columns(row, self.prompt_key, path, where))
        ids = _encode_all(tokenizer, texts, add_special_tokens=not use_chat_template)

        keep, num_truncated = self._fit_lengths(ids, located)
        num_filtered = len(located) - len(keep)
        if not keep:
            raise DatasetError(
                f"dataset is empty after filtering: all {len(located)} prompts are longer than "
                f"max_prompt_length={self.max_prompt_length}"
            )
        self._columns = [columns[k] for k in keep]
        self._texts = [texts[k] for k in keep]
        self._where = [f"{located[k][1]}: {located[k][2]}" for k in keep]
        self.stats = {
            "num_rows": len(located),
            "num_truncated": num_truncated,
            "num_filtered": num_filtered,
            "num_kept": len(keep),
        }
        if num_truncated or num_filtered:
            logger.info(
                "prompt dataset %s: %d rows, %d truncated (%s), %d filtered as longer than %d tokens",
                ", ".join(files),
                len(located),
                num_truncated,
                truncation,
                num_filtered,
                self.max_prompt_length,
            )

    def _fit_lengths(self, ids: Sequence[Sequence[int]], located: list) -> tuple[list[int], int]:
        """Keeps the prompts (their ids in ``self._ids``) no longer than ``max_prompt_length``,
        truncating or dropping longer ones as ``truncation`` says (``error``: a `DatasetError`
        naming the row). Returns the kept rows' indices and how many were truncated."""
        keep, num_truncated = [], 0
        self._ids: list[np.ndarray] = []
        for k, token_ids in enumerate(ids):
            length = len(token_ids)
            if length > self.max_prompt_length:
                if self.truncation == "error":
                    _, path, where = located[k]
                    raise DatasetError(
                        f"{path}: the prompt of {where} has {length} tokens, more than "
                        f"max_prompt_length={self.max_prompt_length}; raise max_prompt_length or "
                        "set truncation to 'left', 'right' or 'filter'"
                    )
                if self.truncation == "filter":
                    continue
                num_truncated += 1
                token_ids = (
                    token_ids[-self.max_prompt_length :]
                    if self.truncation == "left"
                    else token_ids[: self.max_prompt_length]
                )
            keep.append(k)
            self._ids.append(np.asarray(token_ids, np.int32))
        return keep, num_truncated

    def _render(self, prompt: Any, path: str, where: str) -> str:
        if isinstance(prompt, str):
            if not self.use_chat_template:
                return prompt
            prompt = [{"role": "user", "content": prompt}]
        elif not self.use_chat_template:
            raise DatasetError(f"{path}: {where}: prompt is a list of messages but use_chat_template=False")
        if (
            not isinstance(prompt, (list, tuple))
            or not prompt
            or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt
            )
        ):
            raise DatasetError(
                f"{path}: {where}: column {self.prompt_key!r} must be a string or a non-empty list of "
                f"{{'role': str, 'content': str}} messages, got {prompt!r:.200}"
            )
        return self.tokenizer.apply_chat_template([dict(m) for m in prompt], add_generation_prompt=True, tokenize=False)

    def __len__(self) -> int:
        return len(self._ids)

    def check_ground_truths(self, allowed: tuple[type, ...], why: str) -> None:
        """Raises :class:`DatasetError` naming the first row whose ground truth is not one of
        ``allowed`` (e.g. a null, or a list where a scorer compares one string)."""
        for where, columns in zip(self._where, self._columns):
            truth = columns["ground_truth"]
            if not isinstance(truth, allowed) or isinstance(truth, bool):
                raise DatasetError(
                    f"{where}: reward_model.ground_truth is {truth!r:.100} ({type(truth).__name__}); {why}"
                )

    def prompt_ids(self, i: int) -> np.ndarray:
        """The (possibly truncated) token ids of row ``i``."""
        return self._ids[i]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"prompt_ids": self._ids[i], "prompt_text": self._texts[i], **self._columns[i]}

    def batch(self, indices: Sequence[int]) -> PromptBatch:
        """The rows ``indices`` as a left-padded :class:`PromptBatch`."""
        indices = np.asarray(indices, np.int64)
        length = self.max_prompt_length
        ids_BxP = np.full((len(indices), length), self.tokenizer.pad_token_id, np.int32)
        mask_BxP = np.zeros((len(indices), length), np.int32)
        for b, i in enumerate(indices):
            row_ids = self._ids[i]
            ids_BxP[b, length - len(row_ids) :] = row_ids
            mask_BxP[b, length - len(row_ids) :] = 1
        cols = [self._columns[i] for i in indices]
        return PromptBatch(
            prompt_ids=ids_BxP,
            prompt_mask=mask_BxP,
            data_source=[c["data_source"] for c in cols],
            ground_truth=[c["ground_truth"] for c in cols],
            extra_info=[c["extra_info"] for c in cols],
            raw_prompt=[c["raw_prompt"] for c in cols],
            prompt_text=[self._texts[i] for i in indices],
            index=indices,
        )


def _check_columns(path: str, row: Mapping[str, Any], prompt_key: str, where: str) -> None:
    for column in (prompt_key, "data_source", "reward_model"):
        if column not in row:
            if where.startswith("line"):  # jsonl: keys can differ per line
                raise DatasetError(f"{path}: {where} has no key {column!r}; present keys: {sorted(row)}")
            raise DatasetError(f"{path}: column {column!r} not found; present columns: {sorted(row)}")


def _host_columns(row: Mapping[str, Any], prompt_key: str, path: str, where: str) -> dict[str, Any]:
    reward_model = row["reward_model"]
    if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
        raise DatasetError(
            f"{path}: {where}: reward_model must be a dict with a 'ground_truth' key, got {reward_model!r:.200}"
        )
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, Mapping):
        raise DatasetError(f"{path}: {where}: extra_info must be a dict, got {type(extra_info).__name__}")
    return {
        "data_source": row["data_source"],
        "ground_truth": reward_model["ground_truth"],
        "extra_info": dict(extra_info),
        "raw_prompt": row[prompt_key],
        "ability": row.get("ability"),
    }


def _encode_all(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
    return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]


# ---------------------------------------------------------------------- loader


class PromptDataLoader:
    """Batches of a :class:`PromptDataset`, shuffled per epoch, resumable.

    Args:
      dataset: the prompts.
      batch_size: prompts per batch.
      shuffle: visit rows in a seeded random order (a fresh one per epoch).
      seed: the shuffling seed.
      drop_last: skip an epoch's last incomplete batch (keeps shapes static).
      num_epochs: stop after this many epochs (None: never stop).
    """

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        num_epochs: int | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise DatasetError(
                f"dataset has {len(dataset)} prompts, fewer than batch_size={batch_size} "
                "(with drop_last=True no batch could be made)"
            )
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.num_epochs = num_epochs
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order = np.arange(0)

    @property
    def steps_per_epoch(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        if self.num_epochs is None:
            raise TypeError("an endless PromptDataLoader (num_epochs=None) has no length")
        return self.steps_per_epoch * self.num_epochs

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row order of ``epoch`` (a pure function of seed and epoch)."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(n)

    def __iter__(self) -> Iterator[PromptBatch]:
        return self

    def __next__(self) -> PromptBatch:
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        if self._order_epoch != self.epoch:
            self._order = self.epoch_order(self.epoch)
            self._order_epoch = self.epoch
        n = len(self.dataset)
        indices = self._order[self.index : self.index + self.batch_size]
        self.index += len(indices)
        remaining = n - self.index
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.index = 0
        return self.dataset.batch(indices)

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch (store it in a checkpoint)."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "num_rows": len(self.dataset),
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resumes at a position from :meth:`state_dict`.

        Raises:
          ValueError: the state was saved with a different seed or number of rows (the order
            could not be restored).
        """
        for key, current in (("seed", self.seed), ("num_rows", len(self.dataset))):
            if key in state and int(state[key]) != current:
                raise ValueError(
                    f"cannot resume the data order: the saved {key} is {state[key]}, this loader's is {current}"
                )
        if not 0 <= int(state["index"]) <= len(self.dataset):
            raise ValueError(f"saved data index {state['index']} is outside the dataset of {len(self.dataset)} rows")
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])


# ---------------------------------------------------------------------- SFT


def tokenize_sft_examples(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    max_prompt_length: int,
    max_response_length: int,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
) -> dict[str, np.ndarray]:
    """Demonstrations (e.g. :meth:`~jaxflow.data.tasks.Task.make_sft_examples`) as arrays.

    Returns ``prompt_ids``/``prompt_mask`` ``[N, P]`` (left-padded, as for RL) and
    ``responses``/``response_mask`` ``[N, R]`` (the response then EOS, right-padded), all
    int32, in the layout the rollout produces, so the SFT loss and the policy share code.

    Raises:
      DatasetError: a prompt or response (with its EOS) longer than its limit.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("SFT responses end with EOS but the tokenizer has no eos token")
    n = len(rows)
    prompt_ids = np.full((n, max_prompt_length), tokenizer.pad_token_id, np.int32)
    prompt_mask = np.zeros((n, max_prompt_length), np.int32)
    responses = np.full((n, max_response_length), tokenizer.pad_token_id, np.int32)
    response_mask = np.zeros((n, max_response_length), np.int32)
    for i, row in enumerate(rows):
        prompt = row[prompt_key]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        p = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        p_ids = tokenizer.encode(p, add_special_tokens=False)
        r_ids = tokenizer.encode(str(row[response_key]), add_special_tokens=False) + [tokenizer.eos_token_id]
        if len(p_ids) > max_prompt_length or len(r_ids) > max_response_length:
            raise DatasetError(
                f"SFT example {i}: prompt {len(p_ids)} / response {len(r_ids)} tokens exceed "
                f"max_prompt_length={max_prompt_length} / max_response_length={max_response_length}"
            )
        prompt_ids[i, max_prompt_length - len(p_ids) :] = p_ids
        prompt_mask[i, max_prompt_length - len(p_ids) :] = 1
        responses[i, : len(r_ids)] = r_ids
        response_mask[i, : len(r_ids)] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "response_mask": response_mask,
    }
