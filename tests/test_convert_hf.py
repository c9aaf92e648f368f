"""`convert hf`: tiny random Hugging Face Llama folders, written by transformers, give its logits."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from llama_tp import Llama
from llama_tp.text.chat_format import ChatMLFormat
from llama_tp.text.hf_tokenizer import HFTokenizer
from llama_tp.tools.convert.__main__ import main as convert
from tiny_checkpoint import LLAMA2_TOKENIZER, split_dim

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are tiny.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_tokenizer(folder: Path) -> int:
    """A small trained byte-level BPE tokenizer.json with ChatML tokens; returns its vocabulary size."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + ["Paris is in France"], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>", "add_bos_token": False,
              "chat_template": CHATML_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab_size()


def hf_folder(folder: Path, tied: bool) -> LlamaForCausalLM:
    """A random GQA Llama saved by transformers; tied uses tokenizer.json, untied Llama 2's tokenizer.model."""
    folder.mkdir()
    if tied:
        vocab = byte_level_tokenizer(folder)
    else:
        vocab = 32000
        (folder / "tokenizer.model").write_bytes(LLAMA2_TOKENIZER.read_bytes())
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=200 if tied else 176,  # 200 needs an ffn_dim_multiplier, 176 only multiple_of
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        max_position_embeddings=2048, tie_word_embeddings=tied, eos_token_id=0 if tied else 2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            # Random norms too, so swapping attention_norm and ffn_norm could not go unnoticed.
            parameter.copy_(1 + 0.1 * torch.randn_like(parameter) if "norm" in name else 0.1 * torch.randn_like(parameter))
    # Several safetensors files with an index, as large models are published.
    model.save_pretrained(folder, max_shard_size="200KB" if tied else "50MB")
    if tied:  # the makers' recommended sampling, which the converter records
        generation = json.loads((folder / "generation_config.json").read_text())
        generation |= {"do_sample": True, "temperature": 0.3, "top_p": 0.8, "repetition_penalty": 1.05}
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return model


@pytest.fixture(scope="module", params=["untied", "tied"])
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"hf-{request.param}")
    tied = request.param == "tied"
    reference = hf_folder(root / "hf", tied)
    convert("hf", str(root / "hf"), str(root / "mp1"), mp=1)
    tokenizer = root / "mp1" / ("tokenizer.json" if tied else "tokenizer.model")
    return reference, root, tokenizer, tied


def test_convert_says_what_to_run_next_and_the_folder_needs_no_tokenizer_path(tmp_path, capsys):
    hf_folder(tmp_path / "hf", tied=True)
    convert("hf", str(tmp_path / "hf"), str(tmp_path / "my model"), mp=1)
    assert capsys.readouterr().out == (
        f"converted into {tmp_path / 'my model'}; chat with it, or serve it:\n"
        f"  llama-tp --nproc_per_node 1 launch/chat.py --ckpt_dir '{tmp_path / 'my model'}'\n"
        f"  llama-tp --nproc_per_node 1 launch/serve.py --ckpt_dir '{tmp_path / 'my model'}'\n")
    llama = Llama.build(str(tmp_path / "my model"), max_seq_len=64, max_batch_size=1)  # its tokenizer.json
    assert isinstance(llama.tokenizer, HFTokenizer)


def test_build_without_paths_runs_the_demo_model(tmp_path, monkeypatch):
    """A model converted where the demo model lives stands in for it: nothing is downloaded."""
    hf_folder(tmp_path / "hf", tied=True)
    convert("hf", str(tmp_path / "hf"), str(tmp_path / "home" / "smollm2-135m-instruct-mp1"))
    monkeypatch.setenv("LLAMA_TP_HOME", str(tmp_path / "home"))
    llama = Llama.build()
    assert llama.model.args.dim == 64 and llama.sampling_defaults == {"temperature": 0.3, "top_p": 0.8,
                                                                        "repetition_penalty": 1.05}
    assert llama.model.max_seq_len == 512


def test_convert_hf_logits_equal_transformers(converted):
    reference, root, tokenizer, tied = converted
    assert tied == (len(list((root / "hf").glob("*.safetensors"))) > 1)
    llama = Llama.build(str(root / "mp1"), str(tokenizer), max_seq_len=64, max_batch_size=2)
    vocab = reference.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(tokens).logits
    torch.testing.assert_close(llama.model.forward(tokens, 0), expected, atol=1e-4, rtol=0)
    if tied:  # the template (ChatML, its default system prompt) and <|im_end|> reached the generator
        assert llama.formatter.template is not None and isinstance(llama.formatter.known, ChatMLFormat)
        assert llama.formatter.known.default_system_prompt == "You are tiny."
        assert llama.tokenizer.stop_tokens == {0, 2}  # <|endoftext|> (eos) and <|im_end|>
    recommended = {"temperature": 0.3, "top_p": 0.8, "repetition_penalty": 1.05} if tied else {}
    assert llama.sampling_defaults == recommended
    assert json.loads((root / "mp1" / "llama_tp.json").read_text())["context_length"] == 2048  # max_position_embeddings


def test_convert_hf_shards_concatenate_to_the_single_shard(converted, tmp_path):
    _, root, _, _ = converted
    convert("hf", str(root / "hf"), str(tmp_path / "mp2"), mp=2)
    whole = torch.load(root / "mp1" / "consolidated.00.pth", weights_only=True)
    shards = [torch.load(tmp_path / "mp2" / f"consolidated.0{r}.pth", weights_only=True) for r in range(2)]
    assert whole.keys() == shards[0].keys() == shards[1].keys()
    for name, tensor in whole.items():
        dim = split_dim(name, "dim")
        joined = shards[0][name] if dim is None else torch.cat([s[name] for s in shards], dim=dim)
        assert torch.equal(joined, tensor), name
    assert (tmp_path / "mp2" / "params.json").read_text() == (root / "mp1" / "params.json").read_text()


def test_convert_hf_refuses_what_it_cannot_run(converted, tmp_path):
    _, root, _, _ = converted
    with pytest.raises(ValueError, match="cannot be split over 3 processes.*world sizes that work: 1, 2, 4"):
        convert("hf", str(root / "hf"), str(tmp_path / "mp3"), mp=3)
    assert not (tmp_path / "mp3").exists()
    with pytest.raises(ValueError, match="already exists and is not an empty folder"):
        convert("hf", str(root / "hf"), str(root / "mp1"), mp=1)
    with pytest.raises(ValueError, match="unknown source kind 'safetensors'"):
        convert("safetensors", str(root / "hf"), str(tmp_path / "x"))
    config = json.loads((root / "hf" / "config.json").read_text())
    shutil.copytree(root / "hf", tmp_path / "wrong")
    (tmp_path / "wrong" / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    with pytest.raises(ValueError, match=r"wk.weight has shape \[32, 64\] in the source but .* implies \[64, 64\]"):
        convert("hf", str(tmp_path / "wrong"), str(tmp_path / "z"))
    assert not (tmp_path / "z").exists() and not list(tmp_path.glob(".z.partial*"))
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    with pytest.raises(ValueError, match="model_type 'gemma' does not convert; llama_tp runs llama, mistral"):
        convert("hf", str(tmp_path / "gemma"), str(tmp_path / "y"))
