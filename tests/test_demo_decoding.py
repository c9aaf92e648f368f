"""Beam search and bad_words on the demo model (SmolLM2-135M-Instruct, fp32 on CPU): its beams are
transformers' generate(num_beams=4, ...) beams token for token, with the model's own repetition
penalty; a word it says in most answers is in none of 1000 sampled ones once banned, and words
it cannot say change no answer. Needs the demo model (downloaded once per machine, see
test_demo_network.py)."""

import re

import pytest
import torch

from distributed import run_world
from llama_tp import Llama
from llama_tp.model.args import ModelArgs
from llama_tp.model.kv_cache import BLOCK_POSITIONS
from llama_tp.structured.bad_words import word_sequences
from llama_tp.tools import demo
from llama_tp.tools.bench.hf import build_hf_model

pytestmark = pytest.mark.slow  # the demo model, in processes of its own

MAX_GEN_LEN = 16
# (length_penalty, early_stopping): transformers' default, and a search that runs to its end
SETTINGS = [(1.0, False), (0.5, "never")]
DIALOG = [{"role": "user", "content": "Tell me about the sky."}]
HELLO = [{"role": "user", "content": "Say hello."}]
BANNED = ["Hello", "hello"]


def build(max_batch_size: int) -> Llama:
    checkpoint = demo.demo_checkpoint(1)
    return Llama.build(str(checkpoint), str(checkpoint / "tokenizer.json"), max_seq_len=256,
                       max_batch_size=max_batch_size, dtype="fp32")


def _beams() -> tuple[list[int], set[int], dict]:
    llama = build(4)
    prompt = llama.formatter.encode_dialog_prompt(DIALOG)
    found = {(setting, returned): llama.generate([prompt], MAX_GEN_LEN, num_beams=4, length_penalty=setting[0],
                                                 early_stopping=setting[1], num_return_sequences=returned)[0]
             for setting in SETTINGS for returned in (1, 4)}
    return prompt, set(llama.formatter.stop_tokens), found


def transformers_beams(prompt: list[int], stop_tokens: set[int], length_penalty: float, early_stopping) -> list:
    """transformers' 4 best beams (its repetition penalty the demo model's recommended 1.1, as ours)."""
    checkpoint = demo.demo_checkpoint(1)
    weights = torch.load(checkpoint / "consolidated.00.pth", mmap=True, weights_only=True)
    args = ModelArgs.load(checkpoint / "params.json").with_vocab_size(len(weights["output.weight"]))
    model = build_hf_model({name: tensor.float() for name, tensor in weights.items() if name != "rope.freqs"}, args,
                           256, torch.float32)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=MAX_GEN_LEN, num_beams=4, length_penalty=length_penalty,
                             early_stopping=early_stopping, num_return_sequences=4, do_sample=False,
                             repetition_penalty=demo.SAMPLING["repetition_penalty"],
                             eos_token_id=sorted(stop_tokens), pad_token_id=0)
    answers = [row[len(prompt):].tolist() for row in out]
    return [answer[: next((i for i, t in enumerate(answer) if t in stop_tokens), len(answer))] for answer in answers]


def test_the_demo_models_beams_are_transformers_beams():
    prompt, stop_tokens, found = run_world(1, _beams)[0]
    for length_penalty, early_stopping in SETTINGS:
        expected = transformers_beams(prompt, stop_tokens, length_penalty, early_stopping)
        assert found[(length_penalty, early_stopping), 4] == expected
        assert found[(length_penalty, early_stopping), 1] == expected[:1]


def _hello() -> dict:
    """Sampled answers to "Say hello.", without and with the ban;
    greedy ones with words the model cannot say banned."""
    llama = build(32)
    # A system prompt that brings the prompt to a token past its full blocks: the 1000 answers
    # share those blocks (the prefix cache) and prefill one token each.
    system = "You are a helpful assistant."
    prompt = llama.formatter.encode_dialog_prompt([{"role": "system", "content": system}, *HELLO])
    while len(prompt) % BLOCK_POSITIONS != 1:
        system += " Be kind."
        prompt = llama.formatter.encode_dialog_prompt([{"role": "system", "content": system}, *HELLO])
    # warmer than the model's recommended 0.2, at which it answers much alike: more ways to say it
    free, _ = llama.generate([prompt] * 100, 3, seed=1, temperature=0.8)
    banned, _ = llama.generate([prompt] * 1000, 3, seed=2, temperature=0.8, bad_words=BANNED)
    dialogs = [HELLO, DIALOG, [{"role": "user", "content": "Write a haiku."}]]
    greedy = llama.chat_completion(dialogs, temperature=0, max_gen_len=24)
    greedy_banned = llama.chat_completion(dialogs, temperature=0, max_gen_len=24, bad_words=["zebra", "xylophone"])
    sequences = [list(tokens) for tokens in word_sequences(llama.tokenizer, BANNED)]
    return {"free": [llama.tokenizer.decode(answer) for answer in free],
            "banned": [llama.tokenizer.decode(answer) for answer in banned], "banned tokens": banned,
            "sequences": sequences, "greedy": greedy, "greedy banned": greedy_banned}


def test_a_banned_word_is_in_none_of_1000_sampled_answers():
    answers = run_world(1, _hello)[0]
    said = [text for text in answers["free"] if re.search(r"\b[Hh]ello\b", text)]
    assert len(said) > 10  # what the model says unbanned, often (a sixth of its answers, some after a quote)
    assert not [text for text in answers["banned"] if re.search(r"\b[Hh]ello\b", text)]
    assert not [tokens for tokens in answers["banned tokens"] for sequence in answers["sequences"]
                for index in range(len(tokens)) if tokens[index:index + len(sequence)] == sequence]
    assert len(set(answers["banned"])) > 10  # sampled, still
    assert answers["greedy banned"] == answers["greedy"]
