"""Built-in tasks, tokenizers (against transformers) and prompt datasets."""

import json
import logging

import numpy as np
import pytest

from jaxflow.data import dataset as ds
from jaxflow.data import tasks
from jaxflow.data import tokenizer as tokenizer_lib
from jaxflow.data.char_tokenizer import CharTokenizer
from jaxflow.rewards import get_reward_fn
from jaxflow.workers import reward as _rule_scorer  # noqa: F401  (registers the built-in tasks' reward)

# --------------------------------------------------------------------------- tasks

CHECKS = {
    "addition": lambda q: str(sum(int(x) for x in q[:-1].split("+"))),
    "sort": lambda q: "".join(sorted(q[len("sort:") : -1])),
    "reverse": lambda q: q[len("rev:") : -1][::-1],
}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_task_rows_schema_answers_and_lengths(name):
    task = tasks.get_task(name)
    rows = task.make_examples(300, seed=3, split="train")
    assert rows == task.make_examples(300, seed=3, split="train")  # deterministic
    assert rows != task.make_examples(300, seed=4, split="train")
    for i, row in enumerate(rows):
        question = row["prompt"][0]["content"]
        assert row["data_source"] == f"jaxflow/{name}" and row["prompt"][0]["role"] == "user"
        assert row["reward_model"] == {"style": "rule", "ground_truth": CHECKS[name](question)}
        assert row["extra_info"] == {
            "split": "train",
            "index": i,
            "question": question,
            "answer": CHECKS[name](question),
        }
        assert len(question) <= 12 and len(row["reward_model"]["ground_truth"]) <= 6
        assert row["ability"]


@pytest.mark.parametrize("name, params", [("addition", {"digits": 1}), ("addition", {}), ("sort", {}), ("reverse", {})])
def test_task_splits_are_disjoint(name, params):
    task = tasks.get_task(name, **params)
    train = {r["prompt"][0]["content"] for r in task.make_examples(2000, seed=0, split="train")}
    test = {r["prompt"][0]["content"] for r in task.make_examples(300, seed=1, split="test")}
    assert train and test and not train & test


def test_task_reward_and_sft_examples():
    reward = get_reward_fn("jaxflow/addition")
    assert reward("357", "357") == 1.0
    assert reward(" 357\n", "357") == 1.0
    assert reward("357<eos>junk", "357") == 1.0  # only what comes before EOS counts
    assert reward("3570", "357") == 0.0 and reward("35", "357") == 0.0 and reward("", "357") == 0.0
    assert tasks.task_reward("350", "357", partial_credit=True) == pytest.approx(2 / 3)
    assert tasks.task_reward("3570", "357", partial_credit=True) == pytest.approx(3 / 4)
    sft = tasks.get_task("reverse").make_sft_examples(5, seed=0)
    assert all(r["response"] == r["reward_model"]["ground_truth"] for r in sft)
    mixed = tasks.make_mixed_examples(["addition", "sort", "reverse"], 90, seed=0)
    assert [r["extra_info"]["index"] for r in mixed] == list(range(90))
    assert {r["data_source"] for r in mixed} == {"jaxflow/addition", "jaxflow/sort", "jaxflow/reverse"}
    with pytest.raises(KeyError, match="addition"):
        tasks.get_task("multiply")


# --------------------------------------------------------------------------- tokenizers


def test_char_tokenizer_ids_and_round_trip():
    tok = CharTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 100
    text = "".join(chr(c) for c in range(32, 127)) + "\n"
    ids = tok.encode(text)
    assert ids == list(range(4, 100)) and tok.decode(ids) == text
    assert tok.encode("aé") == [tok.encode("a")[0], tok.unk_token_id]
    assert tok.decode([tok.bos_token_id, 21, 22, tok.eos_token_id, 0]) == "12"
    assert tok.decode([1, 21, 2], skip_special_tokens=False) == "<bos>1<eos>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "12+7="}])
    assert prompt == "<bos>12+7="
    assert tok.apply_chat_template([{"role": "user", "content": "12+7="}], tokenize=True) == [1] + tok.encode("12+7=")


def test_char_tokenizer_save_load_and_transformers_parity(tmp_path):
    from transformers import AutoTokenizer

    tok = CharTokenizer()
    tok.save_pretrained(tmp_path)
    ours = tokenizer_lib.load_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "rev:abc="}]
    for text in ["12+345=", "sort:3140=", "a . b , c\nd", "<bos>x<eos>"]:
        assert ours.encode(text) == tok.encode(text) == hf.encode(text)
        assert ours.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert (ours.pad_token_id, ours.eos_token_id, ours.vocab_size) == (hf.pad_token_id, hf.eos_token_id, len(hf))


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role') }}{% endif %}"
    "[{{ message['role'] | upper }}] {{ message['content'] | trim }}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)


def _hf_bpe_tokenizer(chat_template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["The quick brown fox jumps over the lazy dog.", "What is 12+34? It is 46.", "hello world, how are you?"]
    backend.train_from_iterator(corpus * 20, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    hf.chat_template = chat_template
    return hf


@pytest.mark.parametrize("template", [CHATML, LLAMA_LIKE], ids=["chatml", "llama_like"])
def test_load_tokenizer_matches_transformers(tmp_path, template):
    hf = _hf_bpe_tokenizer(template)
    hf.save_pretrained(tmp_path)
    ours = tokenizer_lib.load_tokenizer(tmp_path)
    texts = ["The quick brown fox", "What is 12+34?  It is 46.", "héllo wörld ✓", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
        ids = hf.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    conversations = [
        [{"role": "user", "content": "What is 12+34?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 12+34?"},
            {"role": "assistant", "content": "46"},
            {"role": "user", "content": " and 1+1? "},
        ],
    ]
    for messages in conversations:
        for gen in (True, False):
            rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == rendered
            assert ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True) == hf.encode(
                rendered, add_special_tokens=False
            )
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert ours.vocab_size == len(hf)


def test_load_tokenizer_config_variants_and_no_jinja_fallback(tmp_path, monkeypatch, caplog):
    tok = CharTokenizer()
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<bos>"},
        "eos_token": "<eos>",
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": CHATML}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = tokenizer_lib.load_tokenizer(tmp_path)
    assert loaded.bos_token_id == 1 and loaded.eos_token_id == 2
    assert loaded.pad_token_id == 2  # no pad token: eos pads, as in verl
    assert loaded.chat_template == CHATML
    (tmp_path / "chat_template.jinja").write_text(tokenizer_lib.DEFAULT_CHAT_TEMPLATE)
    assert tokenizer_lib.load_tokenizer(tmp_path).chat_template == tokenizer_lib.DEFAULT_CHAT_TEMPLATE
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        tokenizer_lib.load_tokenizer(tmp_path / "nowhere")
    # Without jinja2 the default template still renders exactly; others fall back, with a warning.
    messages = [{"role": "user", "content": "12+7="}]
    monkeypatch.setattr(tokenizer_lib, "_jinja_available", lambda: False)
    monkeypatch.setattr(tokenizer_lib, "_warned_no_jinja", False)
    assert tok.apply_chat_template(messages) == "<bos>12+7="
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert loaded.apply_chat_template(messages) == "<bos>12+7="
    assert "jinja2 is not installed" in caplog.text


# --------------------------------------------------------------------------- datasets


@pytest.fixture()
def char_tok():
    return CharTokenizer()


def _rows(n=40, seed=0):
    return tasks.make_mixed_examples(["addition", "sort", "reverse"], n, seed=seed)


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_round_trip_and_left_padded_batches(tmp_path, char_tok, ext):
    rows = _rows()
    path = ds.write_rows(rows, tmp_path / f"train.{ext}")
    assert ds.read_rows(path) == rows
    data = ds.PromptDataset(path, char_tok, max_prompt_length=16)
    assert len(data) == 40 and data.stats == {"num_rows": 40, "num_truncated": 0, "num_filtered": 0, "num_kept": 40}
    batch = data.batch([3, 0, 7])
    assert batch.prompt_ids.shape == (3, 16) and batch.prompt_ids.dtype == np.int32
    assert batch.prompt_mask.dtype == np.int32
    for b, i in enumerate([3, 0, 7]):
        question = rows[i]["prompt"][0]["content"]
        expected = [char_tok.bos_token_id] + char_tok.encode(question)
        n = len(expected)
        assert batch.prompt_ids[b, 16 - n :].tolist() == expected
        assert (batch.prompt_ids[b, : 16 - n] == char_tok.pad_token_id).all()
        assert batch.prompt_mask[b].tolist() == [0] * (16 - n) + [1] * n
        assert batch.data_source[b] == rows[i]["data_source"]
        assert batch.ground_truth[b] == rows[i]["reward_model"]["ground_truth"]
        assert batch.extra_info[b] == rows[i]["extra_info"]
        assert batch.raw_prompt[b] == rows[i]["prompt"] and batch.prompt_text[b] == "<bos>" + question
    assert batch.index.tolist() == [3, 0, 7]


def test_parquet_and_jsonl_give_identical_batches(tmp_path, char_tok):
    written = ds.write_builtin_datasets(tmp_path / "pq", tasks=["addition", "reverse"], n_train=24, n_test=8)
    written_j = ds.write_builtin_datasets(
        tmp_path / "js", tasks=["addition", "reverse"], n_train=24, n_test=8, fmt="jsonl"
    )
    for split in ("train", "test"):
        a = next(ds.PromptDataLoader(ds.PromptDataset(written[split], char_tok, max_prompt_length=12), 8, seed=5))
        b = next(ds.PromptDataLoader(ds.PromptDataset(written_j[split], char_tok, max_prompt_length=12), 8, seed=5))
        np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
        assert a.ground_truth == b.ground_truth and a.extra_info == b.extra_info


@pytest.mark.parametrize("name", ["calculator", "code"])
def test_the_agentic_tasks_come_as_verl_parquet_files(tmp_path, char_tok, name):
    """The tool and code tasks' rows written to parquet (verl's schema, one row with
    ``extra_info.tools_kwargs``) give the batches of the in-memory built-in split, the tool's
    per-sample arguments included (rows without them read back as none), and their
    demonstrations score 1 by the data source's reward (the code one in the sandbox)."""
    from jaxflow.agents import sample_tool_kwargs
    from jaxflow.rewards import default_compute_score

    task = tasks.get_task(name)
    rows = task.make_sft_examples(4, seed=1)
    rows[0]["extra_info"]["tools_kwargs"] = {"calculator": {"create_kwargs": {"ground_truth": "12"}}}
    path = ds.write_rows(rows, tmp_path / "train.parquet")
    from_file = ds.PromptDataset(path, char_tok, max_prompt_length=20).batch(range(4))
    in_memory = ds.PromptDataset("rows", char_tok, rows=rows, max_prompt_length=20).batch(range(4))
    np.testing.assert_array_equal(from_file.prompt_ids, in_memory.prompt_ids)
    assert from_file.ground_truth == in_memory.ground_truth == [r["reward_model"]["ground_truth"] for r in rows]
    kwargs = [sample_tool_kwargs({"extra_info": info}, "calculator") for info in from_file.extra_info]
    assert kwargs == [{"ground_truth": "12"}, {}, {}, {}]
    for row, source, truth in zip(rows, from_file.data_source, from_file.ground_truth):
        score = default_compute_score(source, row["response"], truth)
        assert (score["score"] if isinstance(score, dict) else score) == 1.0


def test_plain_text_prompts_and_prompt_key(tmp_path, char_tok):
    rows = [{"question": "1+2=", "data_source": "jaxflow/addition", "reward_model": {"ground_truth": "3"}}]
    path = ds.write_rows(rows, tmp_path / "plain.jsonl")
    templated = ds.PromptDataset(path, char_tok, prompt_key="question", max_prompt_length=8)
    assert templated.prompt_ids(0).tolist() == [1] + char_tok.encode("1+2=")
    assert templated[0]["extra_info"] == {}
    raw = ds.PromptDataset(path, char_tok, prompt_key="question", max_prompt_length=8, use_chat_template=False)
    assert raw.prompt_ids(0).tolist() == char_tok.encode("1+2=")
    with pytest.raises(ds.DatasetError, match="column 'prompt' not found|no key 'prompt'"):
        ds.PromptDataset(path, char_tok)


def test_truncation_modes(tmp_path, char_tok):
    contents = ["1+2=", "x" * 20, "12+34=", "y" * 30]
    rows = [
        {"prompt": [{"role": "user", "content": c}], "data_source": "d", "reward_model": {"ground_truth": "g"}}
        for c in contents
    ]
    path = ds.write_rows(rows, tmp_path / "long.parquet")
    full = [[1] + char_tok.encode(c) for c in contents]
    with pytest.raises(ds.DatasetError, match=r"row 1 has 21 tokens, more than max_prompt_length=10"):
        ds.PromptDataset(path, char_tok, max_prompt_length=10)
    left = ds.PromptDataset(path, char_tok, max_prompt_length=10, truncation="left")
    assert [left.prompt_ids(i).tolist() for i in range(4)] == [f[-10:] for f in full]
    right = ds.PromptDataset(path, char_tok, max_prompt_length=10, truncation="right")
    assert [right.prompt_ids(i).tolist() for i in range(4)] == [f[:10] for f in full]
    assert left.stats["num_truncated"] == right.stats["num_truncated"] == 2
    kept = ds.PromptDataset(path, char_tok, max_prompt_length=10, truncation="filter")
    assert kept.stats == {"num_rows": 4, "num_truncated": 0, "num_filtered": 2, "num_kept": 2}
    assert [kept[i]["raw_prompt"][0]["content"] for i in range(2)] == ["1+2=", "12+34="]
    with pytest.raises(ds.DatasetError, match="empty after filtering: all 4 prompts"):
        ds.PromptDataset(path, char_tok, max_prompt_length=3, truncation="filter")
    with pytest.raises(ValueError, match="truncation must be one of"):
        ds.PromptDataset(path, char_tok, truncation="middle")


def test_shuffling_epochs_and_resume(tmp_path, char_tok):
    path = ds.write_rows(_rows(n=20), tmp_path / "d.parquet")
    data = ds.PromptDataset(path, char_tok, max_prompt_length=12)

    def take(loader, k):
        return [next(loader).index.tolist() for _ in range(k)]

    a = take(ds.PromptDataLoader(data, 6, seed=11), 9)
    assert a == take(ds.PromptDataLoader(data, 6, seed=11), 9)
    assert a != take(ds.PromptDataLoader(data, 6, seed=12), 9)
    # 20 rows, batches of 6, drop_last: 3 batches (18 distinct rows) per epoch; epochs differ.
    epochs = [sum(a[3 * e : 3 * e + 3], []) for e in range(3)]
    assert all(len(set(e)) == 18 for e in epochs) and epochs[0] != epochs[1]
    assert epochs[0] == ds.PromptDataLoader(data, 6, seed=11).epoch_order(0)[:18].tolist()
    # Resume from every position, across epoch boundaries, gives the same continuation.
    for k in range(0, 8):
        loader = ds.PromptDataLoader(data, 6, seed=11)
        take(loader, k)
        state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint would store it
        resumed = ds.PromptDataLoader(data, 6, seed=11)
        resumed.load_state_dict(state)
        assert take(resumed, 9 - k) == a[k:]
    with pytest.raises(ValueError, match="seed"):
        ds.PromptDataLoader(data, 6, seed=12).load_state_dict(state)
    # Finite epochs, no shuffle, keep the last partial batch.
    finite = ds.PromptDataLoader(data, 6, shuffle=False, drop_last=False, num_epochs=2)
    sizes = [len(b) for b in finite]
    assert sizes == [6, 6, 6, 2] * 2 and len(finite) == 8
    with pytest.raises(ds.DatasetError, match="fewer than batch_size"):
        ds.PromptDataLoader(data, 64)


def _write_bytes(path, lines):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


GOOD = json.dumps({"prompt": "1+1=", "data_source": "d", "reward_model": {"ground_truth": "2"}}).encode()


@pytest.mark.parametrize(
    "lines, pattern",
    [
        ([GOOD, b'{"prompt": "caf\xe9", "data_source": "d"}'], r"line 2 is not valid UTF-8"),
        ([GOOD, GOOD, b'{"prompt": "1+1=", '], r"line 3 is not valid JSON"),
        ([GOOD, b"[1, 2]"], r"line 2 is a JSON list, expected an object"),
        (
            [GOOD, b'{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}'],
            r"line 2 has no key 'data_source'; present keys: \['prompt', 'reward_model'\]",
        ),
        (
            [b'{"prompt": 5, "data_source": "d", "reward_model": {"ground_truth": "2"}}'],
            r"line 1: column 'prompt' must be a string or",
        ),
        (
            [b'{"prompt": [{"role": "user"}], "data_source": "d", "reward_model": {"ground_truth": "2"}}'],
            r"line 1: column 'prompt' must be",
        ),
        (
            [b'{"prompt": "1+1=", "data_source": "d", "reward_model": {"answer": "2"}}'],
            r"line 1: reward_model must be a dict with a 'ground_truth' key",
        ),
        ([b"", b"  "], r"dataset is empty: no rows in"),
    ],
    ids=["utf8", "json", "not_object", "missing_key", "prompt_type", "message_keys", "ground_truth", "empty"],
)
def test_malformed_jsonl_errors_name_the_problem(tmp_path, char_tok, lines, pattern):
    path = _write_bytes(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ds.DatasetError, match=pattern) as info:
        ds.PromptDataset(path, char_tok, max_prompt_length=16)
    assert "bad.jsonl" in str(info.value)


def test_file_level_errors(tmp_path, char_tok):
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        ds.PromptDataset(tmp_path / "missing.parquet", char_tok)
    (tmp_path / "data.csv").write_text("prompt\n1+1=\n")
    with pytest.raises(ds.DatasetError, match=r"unsupported file extension '\.csv'; supported: \.parquet, \.jsonl"):
        ds.PromptDataset(tmp_path / "data.csv", char_tok)
    path = ds.write_rows(
        [{"text": "1+1=", "data_source": "d", "reward_model": {"ground_truth": "2"}}], tmp_path / "x.parquet"
    )
    with pytest.raises(
        ds.DatasetError, match=r"column 'prompt' not found; present columns: \['data_source', 'reward_model', 'text'\]"
    ):
        ds.PromptDataset(path, char_tok)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ds.DatasetError, match="junk.parquet: cannot read parquet"):
        ds.PromptDataset(tmp_path / "junk.parquet", char_tok)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(ds.DatasetError, match="dataset is empty"):
        ds.PromptDataset(tmp_path / "empty.parquet", char_tok)


def test_tokenize_sft_examples(char_tok):
    rows = tasks.get_task("addition").make_sft_examples(4, seed=0)
    arrays = ds.tokenize_sft_examples(rows, char_tok, max_prompt_length=8, max_response_length=5)
    for i, row in enumerate(rows):
        prompt = [1] + char_tok.encode(row["prompt"][0]["content"])
        response = char_tok.encode(row["response"]) + [char_tok.eos_token_id]
        assert arrays["prompt_ids"][i, 8 - len(prompt) :].tolist() == prompt
        assert arrays["prompt_mask"][i].sum() == len(prompt)
        assert arrays["responses"][i, : len(response)].tolist() == response
        assert arrays["response_mask"][i].tolist() == [1] * len(response) + [0] * (5 - len(response))
    with pytest.raises(ds.DatasetError, match="exceed"):
        ds.tokenize_sft_examples(rows, char_tok, max_prompt_length=3, max_response_length=5)


def test_the_default_run_validates_on_200_distinct_held_out_problems():
    """The default config's validation set: at least 200 distinct problems, none of them in
    its training set (the splits the run itself builds)."""
    from jaxflow import configs
    from jaxflow.configs.prepare import dataset_sources
    from jaxflow.configs.run_spec import data_spec

    cfg = configs.get_config(configs.DEFAULT_CONFIG)
    train_source, val_source = dataset_sources(data_spec(cfg))
    train = {row["extra_info"]["question"] for row in train_source.rows()}
    val = [row["extra_info"]["question"] for row in val_source.rows()]
    assert len(set(val)) >= 200 and len(set(val)) == len(val)
    assert not set(val) & train
    assert len(train) >= 600  # the rest of the 1000 strings, all seen in training
