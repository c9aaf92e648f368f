"""A tiny Qwen3 that thinks, built by transformers' Qwen3Config and converted as any Qwen3 is: its
tokenizer holds Qwen3's <think> and </think> (added tokens, not special ones, as in Qwen3's own
tokenizer.json), its chat template is Qwen3's (enable_thinking included), and its weights make
its greedy answer known:

    after the generation prompt: <think>REASONING</think>\\n\\nCONTENT<|im_end|>
    after enable_thinking false's empty thinking (the prompt ends with its "\\n\\n"): CONTENT<|im_end|>

so that what a client receives can be checked against what the model generated.
"""

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, Qwen3Config

from llama_tp.tools.convert.__main__ import main as convert
from llama_tp.tools.convert.gguf_vocab import QWEN2_SPLIT

TEMPLATE = (Path(__file__).resolve().parent / "qwen3_chat_template.jinja").read_text()
REASONING = "Let me think"
CONTENT = "Paris is in France"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TAGS = ["<think>", "</think>"]
VOCAB = 384  # the embedding's rows: the tokenizer's tokens, padded as Qwen pads them
CORPUS = [f"{REASONING}\n\n{CONTENT}\n\n"] * 50 + ["the weather in Paris is sunny, answer yes\n"] * 10


def tokenizer_files(folder: Path) -> Tokenizer:
    """A byte-level BPE with Qwen's split, ChatML's control tokens and the think tags."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in THINK_TAGS])
    assert tokenizer.get_vocab_size() <= VOCAB
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
              "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer


def chain(tokenizer: Tokenizer) -> list[int]:
    """The answer the model writes after the generation prompt's last token, "\\n", as token ids."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return [ids("\n")[0], *ids(f"<think>{REASONING}</think>\n\n{CONTENT}<|im_end|>")]


def thinking_qwen3(root: Path) -> Path:
    """The converted checkpoint (its tokenizer.json beside it), built under root."""
    source = root / "hf"
    source.mkdir(parents=True)
    tokenizer = tokenizer_files(source)
    tokens = chain(tokenizer)
    assert len(set(tokens)) == len(tokens), "the answer's tokens must not repeat: each has one successor"
    assert tokenizer.encode("\n\n").ids == [tokens[tokens.index(tokenizer.token_to_id("</think>")) + 1]]
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6,
                         max_position_embeddings=2048, tie_word_embeddings=False,
                         eos_token_id=tokenizer.token_to_id("<|im_end|>"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    successor = dict(zip(tokens[:-1], tokens[1:]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                parameter.zero_()  # each position's state is its own token's embedding
            elif "norm" in name:
                parameter.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                parameter.normal_()
        embeddings, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for token, following in successor.items():  # the row of each successor points along its token
            head[following] = 4.0 * embeddings[token] / embeddings[token].norm()
    model.save_pretrained(source)
    convert("hf", str(source), str(root / "qwen3-thinking"))
    return root / "qwen3-thinking"
