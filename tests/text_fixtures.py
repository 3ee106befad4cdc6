"""Real text for tests: BPE tokenizers trained here (ByteLevel, Llama-style byte-fallback
Metaspace, plain Metaspace) on text with multi-byte characters, saved inside random Llama
checkpoints written by transformers' save_pretrained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CORPUS = [
    "naïve café 日本語 🙂 the thinker writes text and the talker speaks it",
    "Grüße, señor! Ελληνικά, привет мир, 中文字符 and emoji 🎉🚀 in one line",
    "tokens arrive one by one; a stream must join into the same text",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "Ünïcödé everywhere: ß, ø, å, æ, ç, ñ, 한국어, ภาษาไทย",
] * 4
MULTIBYTE_TEXTS = [
    "naïve café 日本語",
    "Grüße 🙂 привет 中文 🎉",
    "the talker speaks 한국어 and ภาษาไทย ø å",
]
CKPT_VOCAB = 512  # conftest's random checkpoints
KINDS = ("bytelevel", "llama", "metaspace")
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(kind: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(CORPUS, trainer)
        return tok
    if kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS))
        return tok
    # Llama-style: normalizer writes the spaces as "▁", unknown characters fall back to
    # <0xXX> byte tokens, and the decoder fuses bytes back into characters.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.train_from_iterator(CORPUS[:2], trainers.BpeTrainer(vocab_size=150, special_tokens=SPECIALS))
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(data))


def write_text_checkpoint(base: Path, folder: Path, kind: str, *, chat: str | None = "config") -> Path:
    """Copy a random Llama checkpoint and add a trained tokenizer; ``chat`` puts the chat
    template in tokenizer_config.json ("config"), chat_template.jinja ("jinja") or nowhere."""
    shutil.copytree(base, folder)
    tok = train_tokenizer(kind)
    assert tok.get_vocab_size() <= CKPT_VOCAB
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat == "config":
        config["chat_template"] = CHAT_TEMPLATE
    elif chat == "jinja":
        (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def hf_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
