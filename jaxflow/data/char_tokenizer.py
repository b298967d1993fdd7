"""A character-level tokenizer, so the built-in tasks run with no download.

Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then one id per character of
``chars`` (by default printable ASCII and newline: 100 ids in all). It is an ordinary
:class:`~jaxflow.data.tokenizer.Tokenizer` over a ``tokenizers`` BPE model with no merges (one
token per character, unknown characters map to ``<unk>``) and a ``Fuse`` decoder, so
``save_pretrained`` writes a ``tokenizer.json`` that :func:`~jaxflow.data.tokenizer.load_tokenizer`
and ``transformers.AutoTokenizer`` both load to the same ids.

Its chat template is :data:`~jaxflow.data.tokenizer.DEFAULT_CHAT_TEMPLATE`: ``<bos>`` then
the messages' contents, e.g. ``[{"role": "user", "content": "12+7="}]`` -> ``<bos>12+7=``.
As with any HF tokenizer, special-token strings inside text (``"<eos>"``) encode to their ids.
"""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models

from jaxflow.data.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
DEFAULT_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"


class CharTokenizer(Tokenizer):
    """One token per character (see the module docstring).

    Args:
      chars: the characters with their own id, in id order after the four special tokens.
    """

    def __init__(self, chars: str = DEFAULT_CHARS):
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer chars must not repeat")
        if not chars:
            raise ValueError("CharTokenizer needs at least one character")
        vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(chars))}
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
        self.chars = chars
        super().__init__(
            backend,
            bos_token=BOS,
            eos_token=EOS,
            pad_token=PAD,
            unk_token=UNK,
            chat_template=DEFAULT_CHAT_TEMPLATE,
            clean_up_tokenization_spaces=False,
            name_or_path="char",
        )
