"""Tokenizers behind one small interface, loaded from a Hugging Face tokenizer directory.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` (the Rust library that HF "fast"
tokenizers are built on) plus what ``tokenizer_config.json`` adds: the special tokens and the
chat template. :func:`load_tokenizer` reads a directory the way
``transformers.AutoTokenizer`` does for fast tokenizers, without depending on transformers:

- ``tokenizer.json``: the vocabulary, model, pre/post-processing and added tokens;
- ``tokenizer_config.json`` (then ``special_tokens_map.json``): ``bos_token``, ``eos_token``,
  ``pad_token``, ``unk_token`` (strings or ``{"content": ...}`` dicts), ``chat_template`` (a
  string or a list of named templates; ``"default"`` is used) and
  ``clean_up_tokenization_spaces``;
- ``chat_template.jinja``: the chat template, preferred over the config's (newer
  transformers save it there).

Chat templates are Jinja; they are rendered as transformers renders them (a sandboxed
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a
JSON ``tojson``) when ``jinja2`` is installed. jinja2 is not a dependency of jaxflow: without
it only :data:`DEFAULT_CHAT_TEMPLATE` (jaxflow's character tokenizer's) is rendered exactly;
any other template is replaced by it, with a warning logged once.

When a tokenizer has no pad token, the eos token is used for padding (as verl does).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import tokenizers

logger = logging.getLogger(__name__)

DEFAULT_CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""``bos_token`` followed by every message's content, nothing added for generation."""

_CLEANUP_PAIRS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)
_warned_no_jinja = False


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with special tokens and a chat template.

    Args:
      backend: the Rust tokenizer.
      bos_token, eos_token, pad_token, unk_token: special token strings (or None); each must
        be in the vocabulary. ``pad_token=None`` pads with ``eos_token``.
      chat_template: Jinja chat template (None: :data:`DEFAULT_CHAT_TEMPLATE`).
      clean_up_tokenization_spaces: apply transformers' ``" ." -> "."`` cleanup on decode.
      name_or_path: where it came from, for messages.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        clean_up_tokenization_spaces: bool = False,
        name_or_path: str = "",
    ):
        self.backend = backend
        self.name_or_path = name_or_path
        self.chat_template = chat_template if chat_template is not None else DEFAULT_CHAT_TEMPLATE
        self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)
        self.bos_token, self.eos_token, self.unk_token = bos_token, eos_token, unk_token
        self._configured_pad_token = pad_token
        if pad_token is None and eos_token is not None:
            pad_token = eos_token
        self.pad_token = pad_token
        self.bos_token_id = self._special_id("bos_token", bos_token)
        self.eos_token_id = self._special_id("eos_token", eos_token)
        self.pad_token_id = self._special_id("pad_token", pad_token)
        self.unk_token_id = self._special_id("unk_token", unk_token)

    def _special_id(self, role: str, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{role} {token!r} of tokenizer {self.name_or_path or '?'} is not in its vocabulary")
        return token_id

    # ---------------------------------------------------------------- vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (``len(hf_tokenizer)``)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The configured special tokens (what transformers hands to chat templates); a pad
        token borrowed from eos is not listed."""
        tokens = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self._configured_pad_token,
        }
        return {name: token for name, token in tokens.items() if token is not None}

    @property
    def all_special_ids(self) -> list[int]:
        added = self.backend.get_added_tokens_decoder()
        return sorted(i for i, token in added.items() if token.special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    # ---------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (e.g. BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """:meth:`encode` for many texts at once (parallel in Rust)."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (a list, tuple or 1-D array)."""
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for before, after in _CLEANUP_PAIRS:
                text = text.replace(before, after)
        return text

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    # ---------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Renders ``messages`` with the chat template (as transformers does).

        Note the default ``add_generation_prompt=True`` (prompts for rollout), where
        transformers defaults to False. ``tokenize=True`` returns the ids of the rendered text
        encoded without extra special tokens. Extra keyword arguments reach the template.
        """
        text = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # ---------------------------------------------------------------- files

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (loadable by
        :func:`load_tokenizer` and by ``transformers.AutoTokenizer``)."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        self.backend.save(os.path.join(directory, "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
            "chat_template": self.chat_template,
            **self.special_tokens_map,
        }
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token!r}, eos={self.eos_token!r}, pad={self.pad_token!r})"
        )


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved in directory ``path`` (or a ``tokenizer.json`` file path). jaxflow's
    built-in character tokenizer is :class:`~jaxflow.data.char_tokenizer.CharTokenizer` (the
    run's ``jaxflow.data.tokenizer=char``), a subclass of this module's `Tokenizer`.

    Raises:
      FileNotFoundError: no ``tokenizer.json`` there (slow, sentencepiece-only tokenizers must
        first be converted, e.g. by saving them with transformers' fast tokenizer).
      ValueError: a configured special token is not in the vocabulary, or a config file is not
        valid JSON.
    """
    path = os.fspath(path)
    if os.path.isfile(path) and os.path.basename(path) == "tokenizer.json":
        directory, tokenizer_file = os.path.dirname(path), path
    else:
        directory, tokenizer_file = path, os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise FileNotFoundError(
            f"no tokenizer.json in {path!r}: jaxflow loads fast (tokenizers-library) tokenizers; "
            "convert a slow tokenizer by saving it with transformers' AutoTokenizer(use_fast=True)"
        )
    backend = tokenizers.Tokenizer.from_file(tokenizer_file)
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(directory, "special_tokens_map.json"))
    specials = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        specials[name] = _token_content(config.get(name, special_map.get(name)))
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    return Tokenizer(
        backend,
        chat_template=template,
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        name_or_path=path,
        **specials,
    )


def render_chat_template(
    template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
) -> str:
    """Renders a chat template over ``messages`` (see the module docstring for jinja2-less use)."""
    messages = [dict(m) for m in messages]
    for m in messages:
        if "role" not in m or "content" not in m:
            raise ValueError(f"chat messages need 'role' and 'content' keys, got {sorted(m)}")
    if not _jinja_available():
        global _warned_no_jinja
        if template != DEFAULT_CHAT_TEMPLATE and not _warned_no_jinja:
            _warned_no_jinja = True
            logger.warning(
                "jinja2 is not installed: the tokenizer's chat template is ignored and jaxflow's "
                "default (bos_token + every message's content) is used. `pip install jinja2` to "
                "render the model's own template."
            )
        bos = kwargs.get("bos_token") or ""
        return bos + "".join(str(m["content"]) for m in messages)
    compiled = _compile_template(template)
    kwargs.setdefault("tools", None)
    kwargs.setdefault("documents", None)
    return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)


@functools.lru_cache(maxsize=1)
def _jinja_available() -> bool:
    try:
        import jinja2  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=16)
def _compile_template(template: str) -> Any:
    import jinja2  # noqa: PLC0415 - optional dependency
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (HF's assistant-mask tag)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _token_content(token: Any) -> str | None:
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) and token else None
