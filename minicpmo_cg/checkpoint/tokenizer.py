"""The checkpoint's tokenizer: byte-level, built with ``tokenizers``, no download."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from minicpmo_cg.checkpoint import layout

#: ChatML as Qwen3 writes it; content is a string (vLLM inserts ``(<image>./</image>)`` placeholders).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _byte_symbols() -> list[str]:
    """The 256 printable symbols byte-level BPE uses for bytes 0..255, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def build_tokenizer(out: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``out``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    symbols = _byte_symbols()
    filler = ("".join(p) for n in itertools.count(2) for p in itertools.product(symbols, repeat=n))
    plain = itertools.islice(itertools.chain(symbols, filler), layout.FIRST_SPECIAL_ID)
    vocab = {s: i for i, s in enumerate(plain)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = layout.special_tokens()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    tokenizer.save(str(out / "tokenizer.json"))
    named = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
    }
    (out / "special_tokens_map.json").write_text(json.dumps(named, indent=2) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **named,
        "bos_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 40960,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
