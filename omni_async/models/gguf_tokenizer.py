"""A tokenizer rebuilt from a GGUF file's ``tokenizer.*`` metadata.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, merges, token types, special
token ids and chat template under llama.cpp's key names. This module turns them into a
``tokenizers.Tokenizer`` shaped as transformers shapes the same file (byte-level BPE for
``gpt2`` vocabularies, byte-fallback BPE with a metaspace for ``llama`` ones), so that prompt
ids match the reference exactly.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..errors import ConfigError
from ..text.byte_level import byte_alphabet
from ..text.tokenizer import HFTokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# Pre-tokenizer split patterns named by ``tokenizer.ggml.pre``. A byte-level vocabulary whose
# pre type is not listed splits with the GPT-2 pattern built into ``ByteLevel``.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def build_gguf_tokenizer(meta: Mapping[str, Any], *, vocab_size: int, eos_token_ids: tuple[int, ...]) -> HFTokenizer | None:
    """The file's tokenizer, or ``None`` when it has no vocabulary."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    kind = meta.get("tokenizer.ggml.model")
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    if kind == "gpt2":
        tok = _byte_level(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre"))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tok = _sentencepiece_bpe(tokens, meta)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise ConfigError(f"unsupported GGUF tokenizer model {kind!r}: supported are 'gpt2' and 'llama'")
    _add_special(tok, tokens, types, byte_level=kind == "gpt2")

    def token_of(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos = token_of("bos_token_id")
    _set_post_processor(tok, bos if add_bos else None, meta.get("tokenizer.ggml.bos_token_id"))
    return HFTokenizer.from_object(
        tok,
        eos_token_ids=eos_token_ids,
        vocab_size=vocab_size,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=token_of("eos_token_id"),
    )


def _byte_level(tokens: Sequence[str], merges: Sequence[str], pre: str | None) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    vocab = {}
    for idx, token in enumerate(tokens):
        # Tokens are stored in the byte alphabet; a few files spell one in plain UTF-8.
        spelled = token if set(token) <= letters else "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, idx)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: Sequence[str], meta: Mapping[str, Any]) -> Any:
    """Byte-fallback BPE with ``▁`` for spaces. Merges come from the file or, when it has
    none, from the vocabulary ranked by the file's scores."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: idx for idx, token in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = _merges_from_scores(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    unk = tokens[int(unk_id)] if unk_id is not None and int(unk_id) < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # A space is prepended to the first piece whatever ``add_space_prefix`` says, as the
    # reference tokenizer for GGUF files does (the oracle prompt ids are its ids).
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    return tok


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary without any: every split of a token into two
    vocabulary tokens. Ranked as the reference ranks them: by the made token's score (high
    first), then the longer left piece, then the longer right piece, then file order (and,
    within one token, the pieces' ids)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score_of = dict(zip(tokens, (float(x) for x in scores)))
    found: list[tuple[str, str, float]] = []
    for token, score in score_of.items():
        local = [
            (token[:cut], token[cut:], score)
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _score in found]


def _add_special(tok: Any, tokens: Sequence[str], types: Sequence[int], *, byte_level: bool) -> None:
    """Control tokens become special added tokens and user-defined ones plain added tokens,
    so both are matched whole in text instead of being cut into pieces."""
    from tokenizers import AddedToken

    letters = set(byte_alphabet().values()) if byte_level else None
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types)
        if ty == CONTROL and (letters is None or set(t) <= letters)
    ]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)


def _set_post_processor(tok: Any, bos: str | None, bos_id: int | None) -> None:
    from tokenizers import processors

    if bos is None or bos_id is None:
        tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
        return
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))]
    )
