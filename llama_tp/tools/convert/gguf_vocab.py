"""A GGUF file's embedded vocabulary, written out as a Hugging Face tokenizer.json: byte-level BPE
(tokenizer.ggml.model "gpt2": Llama 3's, Qwen's, SmolLM2's) or SentencePiece's BPE ("llama": Llama
2's, Mistral's and Mixtral's)."""

import json
from typing import Optional

from ...optional import require

# llama.cpp's token types (tokenizer.ggml.token_type).
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
# SentencePiece's space.
SPACE = "\u2581"

# How text is split into words before BPE, by the GGUF's tokenizer.ggml.pre: the regexes are
# llama.cpp's (llama-vocab.cpp), which reproduce each model's original Hugging Face tokenizer.
GPT2_FAMILY = ("default", "gpt2", "mpt", "olmo", "jais")
# GPT-2's split after cutting out each digit on its own (StarCoder's tokenizer, which SmolLM2 uses).
DIGITS_FAMILY = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
LLAMA3_FAMILY = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (and Qwen3's, DeepSeek-R1's Qwen distillations'): Llama 3's split with digits one by one.
QWEN2_FAMILY = ("qwen2", "deepseek-r1-qwen")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def pre_tokenizer_for(pre: str):
    """The `tokenizers` pre-tokenizer matching llama.cpp's split for tokenizer.ggml.pre."""
    pre_tokenizers = require("tokenizers.pre_tokenizers", "a GGUF file's vocabulary")
    splits = {**dict.fromkeys(LLAMA3_FAMILY, LLAMA3_SPLIT), **dict.fromkeys(QWEN2_FAMILY, QWEN2_SPLIT)}
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in splits)
    if pre in GPT2_FAMILY:
        return byte_level
    if pre in DIGITS_FAMILY:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in splits:
        split = pre_tokenizers.Split(require("tokenizers", "a GGUF file's vocabulary").Regex(splits[pre]),
                                     behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    known = ", ".join(GPT2_FAMILY + DIGITS_FAMILY + LLAMA3_FAMILY + QWEN2_FAMILY)
    raise ValueError(f"the GGUF's pre-tokenizer {pre!r} is not supported (known: {known}); "
                     "convert the model's Hugging Face folder with `convert hf` instead")


def tokenizer_json(tokens: list[str], merges: list[str], token_types: list[int], pre: str) -> bytes:
    """tokenizer.json for a byte-level BPE vocabulary (tokenizer.ggml.model "gpt2")."""
    tokenizers = require("tokenizers", "a GGUF file's vocabulary")
    bpe = tokenizers.models.BPE(
        vocab={token: index for index, token in enumerate(tokens)},
        merges=[tuple(merge.split(" ", 1)) for merge in merges],
        # Llama 3 keeps a word whole when the vocabulary has it, whatever the merges say.
        ignore_merges=pre in LLAMA3_FAMILY,
    )
    tokenizer = tokenizers.Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizer_for(pre)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return _with_added_tokens(tokenizer, tokens, token_types)


def sentencepiece_tokenizer_json(tokens: list[str], scores: list[float], token_types: list[int],
                                 add_space_prefix: bool) -> bytes:
    """tokenizer.json for a SentencePiece BPE vocabulary (tokenizer.ggml.model "llama"), as
    transformers' LlamaConverter writes Llama 2's: spaces are "\u2581" (and one begins the text,
    with add_space_prefix), pieces merge in the order of their scores, and a character the
    vocabulary lacks is its bytes' <0xXX> tokens."""
    tokenizers = require("tokenizers", "a GGUF file's vocabulary")
    vocab = {token: index for index, token in enumerate(tokens)}
    unknown = next((token for token, kind in zip(tokens, token_types) if kind == UNKNOWN), None)
    bpe = tokenizers.models.BPE(vocab=vocab, merges=sentencepiece_merges(tokens, scores, vocab), unk_token=unknown,
                                fuse_unk=True, byte_fallback=True)
    tokenizer = tokenizers.Tokenizer(bpe)
    normalizers, decoders = tokenizers.normalizers, tokenizers.decoders
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE)] * add_space_prefix + [normalizers.Replace(" ", SPACE)])
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                          + [decoders.Strip(" ", 1, 0)] * add_space_prefix)
    return _with_added_tokens(tokenizer, tokens, token_types)


def sentencepiece_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's: every split of a piece into two pieces of the
    vocabulary, the pieces with the best scores merged first (transformers' SentencePieceExtractor)."""
    merges = []
    for piece, score in zip(tokens, scores):
        splits = [(piece[:cut], piece[cut:], score) for cut in range(1, len(piece))
                  if piece[:cut] in vocab and piece[cut:] in vocab]
        merges += sorted(splits, key=lambda merge: (vocab[merge[0]], vocab[merge[1]]))
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _with_added_tokens(tokenizer, tokens: list[str], token_types: list[int]) -> bytes:
    """tokenizer with the vocabulary's control and user-defined tokens as added tokens, as JSON."""
    tokenizers = require("tokenizers", "a GGUF file's vocabulary")
    # Control tokens (<|im_start|>, <s>) must stay whole instead of being cut into byte pieces.
    added = [
        tokenizers.AddedToken(token, special=kind == CONTROL, normalized=False)
        for token, kind in zip(tokens, token_types) if kind in (CONTROL, USER_DEFINED)
    ]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(f"the GGUF's vocabulary has {len(tokens)} tokens but the tokenizer built "
                         f"from it has {tokenizer.get_vocab_size(with_added_tokens=True)}; duplicate tokens?")
    return tokenizer.to_str(pretty=False).encode()


def tokenizer_config_json(tokens: list[str], special_ids: dict[str, Optional[int]], add_bos: bool,
                          chat_template: Optional[str]) -> bytes:
    """tokenizer_config.json naming the special tokens, as Hugging Face and llama_tp read it."""
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos}
    for key, token_id in special_ids.items():
        config[key] = tokens[token_id] if token_id is not None else None
    if chat_template is not None:
        config["chat_template"] = chat_template
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()
