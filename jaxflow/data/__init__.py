"""Data: the `Batch` that moves between roles (verl's DataProto), prompt datasets and their
loader (verl's parquet schema), tokenizers, and the built-in tasks."""

from jaxflow.data.batch import Batch
from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.data.dataset import (
    DatasetError,
    PromptBatch,
    PromptDataLoader,
    PromptDataset,
    tokenize_sft_examples,
    write_builtin_datasets,
)
from jaxflow.data.tasks import Task, get_task
from jaxflow.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "Batch",
    "CharTokenizer",
    "DatasetError",
    "PromptBatch",
    "PromptDataLoader",
    "PromptDataset",
    "Task",
    "Tokenizer",
    "get_task",
    "load_tokenizer",
    "tokenize_sft_examples",
    "write_builtin_datasets",
]
