"""Llama 4's text model: Meta's layout (eight shards of fused tensors and extra states, its
params.json, its tiktoken tokenizer and chat format) at world sizes 1, 2 and 4, Hugging Face's
multimodal folders (the text model converted, the vision tower left out), and decoding steps
through block masks that see only their chunk; against transformers' Llama 4."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Llama4Config, Llama4ForConditionalGeneration, Llama4TextConfig

from hf_families import CHUNK, COMMON, FAMILIES, LLAMA4, hf_model, tokenizer_files, transformers_greedy, up_to_stop
from meta_llama4 import HF_CONFIG, PARAMS, VOCAB, tokenizer_file, write_meta_llama4
from llama_tp import Llama
from llama_tp.model.args import ModelArgs
from llama_tp.model.meta_llama4 import llama4_params
from llama_tp.text.chat_format import Llama4ChatFormat
from llama_tp.text.tokenizer import Llama4Tokenizer, load_tokenizer
from llama_tp.tools.convert.__main__ import main as convert
from llama_tp.tools.convert.hf import model_params
from llama_tp.tools.reshard import reshard

TESTS = Path(__file__).resolve().parent
STEPS = 24
DIALOG = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": " Paris is in France?\n"}]


def random_weights(model: torch.nn.Module) -> torch.nn.Module:
    """model with random weights that bf16 holds exactly (Meta's shards are bf16), in fp32."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            values = 1 + 0.1 * torch.randn_like(parameter) if "norm" in name else 0.1 * torch.randn_like(parameter)
            parameter.copy_(values.bfloat16().float())
    return model.eval()


def batch(high: int) -> torch.Tensor:
    """Two rows of 20 tokens: past two chunks of CHUNK."""
    return torch.randint(0, high, (2, 20), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def meta(tmp_path_factory) -> tuple:
    """transformers' Llama 4 and the same weights in Meta's layout."""
    model = random_weights(AutoModelForCausalLM.from_config(Llama4TextConfig(**HF_CONFIG)))
    return model, write_meta_llama4(tmp_path_factory.mktemp("meta") / "llama4", model)


def build(folder: Path, tokenizer: str, **options) -> Llama:
    return Llama.build(str(folder), str(folder / tokenizer), max_seq_len=64, max_batch_size=2, dtype="fp32", **options)


def test_metas_params_json_describes_the_model_transformers_builds(tmp_path):
    """Nested under "model" or not: experts of Meta's MoE size, dense layers between, Llama 4
    Scout's rope scaling, the routing, NoPE layers and chunks."""
    loaded = []
    for params in (PARAMS, PARAMS["model"]):
        (tmp_path / "params.json").write_text(json.dumps(params))
        loaded.append(ModelArgs.load(tmp_path / "params.json"))
    args = loaded[0]
    assert loaded[1] == args
    assert (args.expert_hidden_dim, args.ffn_hidden_dim) == (HF_CONFIG["intermediate_size"], HF_CONFIG["intermediate_size_mlp"])
    assert [args.has_experts(layer) for layer in range(4)] == [False, True, False, True]
    assert [args.rotates(layer) for layer in range(4)] == [True, True, True, False]
    assert (args.rope_scaling_factor, args.rope_high_freq_factor, args.rope_low_freq_factor) == (16.0, 1.0, 1.0)
    assert (args.router_scoring, args.expert_weights_on_input, args.shared_expert, args.weightless_qk_norm) == (
        "sigmoid", True, True, True)


def test_metas_llama4_is_trained_for_ten_million_tokens_as_scout_and_one_million_as_maverick(tmp_path):
    """Meta's params.json says no context: Scout (its rotary scaled) 10M, Maverick 1M, as Meta
    publishes them (not Llama 3's, whose tokenizer class Llama 4's extends)."""
    from llama_tp.checkpoint.record import ModelRecord
    from llama_tp.context import trained_context

    tokenizer = load_tokenizer(str(tokenizer_file(tmp_path / "tokenizer.model")))
    scout = ModelArgs.from_dict(llama4_params(PARAMS, "params.json"))
    maverick = ModelArgs.from_dict(llama4_params({"model": PARAMS["model"] | {"use_scaled_rope": False}}, "params.json"))
    assert trained_context(scout, tokenizer, ModelRecord()).tokens == 10485760
    assert trained_context(maverick, tokenizer, ModelRecord()).tokens == 1048576


def test_metas_quantized_and_lora_params_are_refused(tmp_path):
    for key in ("quantization_args", "lora_args"):
        (tmp_path / "params.json").write_text(json.dumps({"model": PARAMS["model"] | {key: {"scheme": "x"}}}))
        with pytest.raises(ValueError, match=f"{key} is set; llama_tp loads Meta's bf16 Llama 4 checkpoints"):
            ModelArgs.load(tmp_path / "params.json")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> tuple:
    """Our tokenizer of a 200,000-rank file, and transformers' tokenizer.json made from the same file
    by its TikTokenConverter with o200k's pattern and Llama 4's special tokens (an independent BPE)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = tokenizer_file(tmp_path_factory.mktemp("tokenizer") / "tokenizer.model")
    ours = load_tokenizer(str(path))
    names = sorted(ours.special_tokens, key=ours.special_tokens.get)
    converter = TikTokenConverter(str(path), pattern=Llama4Tokenizer.pat_str, extra_special_tokens=names)
    return ours, PreTrainedTokenizerFast(tokenizer_object=converter.converted(), bos_token="<|begin_of_text|>")


def test_the_llama4_tokenizer_is_told_by_its_ranks_and_encodes_as_transformers_converter(tokenizers):
    """200,000 ranks make a Llama 4 tokenizer: its special tokens at Meta's ids, o200k's split,
    the same tokens as transformers' tokenizer of the same file."""
    ours, reference = tokenizers
    assert isinstance(ours, Llama4Tokenizer) and ours.n_words == VOCAB
    special = ours.special_tokens
    assert (special["<|begin_of_text|>"], special["<|header_start|>"], special["<|eot|>"], special["<|image_start|>"],
            special["<|patch|>"], special["<|reasoning_thinking_end|>"], special["<|reserved_special_token_903|>"]) == (
                200000, 200005, 200008, 200080, 200092, 201143, 202047)
    assert ours.stop_tokens == {200001, 200007, 200008}  # end of text, <|eom|>, <|eot|>
    for text in ("HelloWorld's CamelCase isn't", "price: 12345.678 dollars/month\r\n\n", "  naïve café 東京 😀!!",
                 "a<|eot|>b", "def f(x):\n\treturn x  # ok"):
        assert ours.encode(text, bos=False, eos=False) == reference.encode(text, add_special_tokens=False,
                                                                          split_special_tokens=True), text
    llama3 = load_tokenizer(str(Path(__file__).resolve().parents[2] / "shared" / "data" / "llama3-tokenizer.model"))
    assert type(llama3).__name__ == "Llama3Tokenizer" and llama3.n_words == 128256


def test_the_llama4_chat_prompt_is_what_its_template_renders(tokenizers):
    """Meta's format, each message as written: transformers' apply_chat_template of Llama 4's
    template through a tokenizer of the same ranks."""
    tokenizer, reference = tokenizers
    ours = Llama4ChatFormat(tokenizer)
    expected = reference.apply_chat_template(DIALOG, chat_template=LLAMA4, add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert ours.encode_dialog_prompt(DIALOG) == list(expected)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple:
    """A transformers Llama 4 (text) converted from its Hugging Face folder."""
    root = tmp_path_factory.mktemp("llama4")
    model = hf_model(root / "hf", "llama4")
    convert("hf", str(root / "hf"), str(root / "ckpt"))
    return model, root / "hf", root / "ckpt"


def test_a_converted_llama4_chats_in_its_format(converted):
    from transformers import AutoTokenizer

    _, folder, ckpt = converted
    llama = build(ckpt, "tokenizer.json")
    assert json.loads((ckpt / "llama_tp.json").read_text())["chat_format"] == "llama4"
    assert isinstance(llama.formatter.known, Llama4ChatFormat)
    reference = AutoTokenizer.from_pretrained(folder)
    dialog = [{"role": "user", "content": "the quick fox"}, {"role": "assistant", "content": "jumps over"},
              {"role": "user", "content": "the lazy dog"}]
    expected = list(reference.apply_chat_template(dialog, tokenize=True, return_dict=False, add_generation_prompt=True))
    assert llama.formatter.encode_dialog_prompt(dialog) == llama.formatter.known.encode_dialog_prompt(dialog) == expected
    assert reference.convert_tokens_to_ids("<|eot|>") in llama.tokenizer.stop_tokens


@pytest.mark.slow  # FlexAttention's reference computation, eagerly: 25 s
@pytest.mark.parametrize("width", [1, 4])
def test_steps_through_block_masks_see_only_their_chunk(converted, width):
    """The GPU's decoding step (decode_step at the ladder's sizes, each row through block masks),
    and its verifying step of 4 tokens a row: chunked layers read their own chunk only, as the
    eager step's masks say, rows in blocks that their tables scatter over the cache, at their own
    positions, before and after a chunk's and a block's end, a row's tokens in one chunk or two."""
    _, _, ckpt = converted
    models = [Llama.build(str(ckpt), str(ckpt / "tokenizer.json"), max_seq_len=128, max_batch_size=2,
                          dtype="fp32").model for _ in range(2)]
    eager, stepped = models
    stepped.compile_decoding(graphs=True, verify_width=4, backend="eager")
    assert stepped.whole_steps and stepped.chunk == CHUNK and sorted(stepped.graphs) == [1, 4]
    tokens = torch.randint(0, 300, (2, 80), generator=torch.Generator().manual_seed(5))
    for model in models:
        model.block_tables.give(0, [3, 0])  # two blocks a row, neither row's in order
        model.block_tables.give(1, [1, 2])
        model.forward(tokens[:1, :58], 0, slots=[0])
        model.forward(tokens[1:, :61], 0, slots=[1])
    for step in range(0, 12, width):
        starts = [58 + step, 61 + step]
        step_tokens = torch.stack([tokens[row, start : start + width] for row, start in enumerate(starts)])
        torch.testing.assert_close(stepped.forward(step_tokens, starts), eager.forward(step_tokens, starts),
                                   atol=1e-5, rtol=0)


@pytest.mark.slow  # FlexAttention's reference computation, eagerly
def test_a_whole_step_takes_in_prompt_chunks_seeing_only_their_chunk(converted):
    """The GPU's step that takes in prompt chunks beside decoding rows (mixed_step): a prompt's rows of
    64 tokens, the last one part padding, see only their own chunk's positions in the chunked layers,
    and the NoPE layers' queries scale by their own positions, as eager passes do."""
    _, _, ckpt = converted
    models = [Llama.build(str(ckpt), str(ckpt / "tokenizer.json"), max_seq_len=128, max_batch_size=2,
                          dtype="fp32").model for _ in range(2)]
    eager, stepped = models
    stepped.compile_decoding(graphs=True, mix_prompts=True, backend="eager")
    assert stepped.mixed_graphs is not None and stepped.chunk == CHUNK
    tokens = torch.randint(0, 300, (2, 128), generator=torch.Generator().manual_seed(6))
    for model in models:
        model.block_tables.give(0, [3, 0])  # two blocks a row, neither row's in order
        model.block_tables.give(1, [1, 2])
        model.forward(tokens[:1, :30], 0, slots=[0])
    passes = [[(tokens[1:, :70], [0], [1]), (tokens[:1, 30:31], [30], [0])],
              [(tokens[1:, 70:75], [70], [1]), (tokens[:1, 31:32], [31], [0])]]
    for batches in passes:
        torch.testing.assert_close(stepped.forward_segments(batches), eager.forward_segments(batches),
                                   atol=1e-5, rtol=0)


def test_a_multimodal_llama4_converts_its_text_model_and_leaves_the_vision_tower_out(tmp_path):
    from transformers import Llama4VisionConfig

    _, twists, _ = FAMILIES["llama4"]
    text = Llama4TextConfig(**COMMON | twists)
    vision = Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                                projector_output_dim=64)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict()))
    random_weights(model)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    tokenizer_files(folder, LLAMA4)
    convert("hf", str(folder), str(tmp_path / "ckpt"))
    tokens = batch(300)
    with torch.no_grad():  # its text model alone (transformers 5.24's whole model fails on text without images)
        expected = model.language_model(tokens).logits
    torch.testing.assert_close(build(tmp_path / "ckpt", "tokenizer.json").model.forward(tokens, 0), expected,
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("change, message", [
    ({"moe_layers": [0, 1, 3]}, r"moe_layers is \[0, 1, 3\]; llama_tp runs Llama 4's regular pattern, \[1, 3\]"),
    ({"no_rope_layers": [1, 0, 1, 1]}, r"no_rope_layers is \[1, 0, 1, 1\]"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types is"),
])
def test_irregular_llama4_layers_are_refused_naming_the_key(tmp_path, change, message):
    _, twists, _ = FAMILIES["llama4"]
    config = Llama4TextConfig(**COMMON | twists).to_dict() | change
    with pytest.raises(ValueError, match=message):
        model_params(config, tmp_path)


def test_qwen3_moe_with_dense_exceptions_is_refused_naming_the_key(tmp_path):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(**COMMON, num_experts=4, mlp_only_layers=[1]).to_dict()
    with pytest.raises(ValueError, match=r"mlp_only_layers is \[1\]; llama_tp's Qwen3-MoE has experts in every"):
        model_params(config, tmp_path)


def test_metas_eight_shards_load_at_one_process_with_transformers_logits_and_tokens(meta):
    """Fused wqkv, fc1 and experts taken apart, extra states and the vision tower dropped by name;
    a chat prompt through Meta's tokenizer and chat format, 24 greedy tokens past three chunks."""
    model, folder = meta
    llama = build(folder, "tokenizer.model")
    assert isinstance(llama.formatter, Llama4ChatFormat)
    tokens = batch(200000)
    with torch.no_grad():
        expected = model(tokens).logits
    torch.testing.assert_close(llama.model.forward(tokens, 0), expected, atol=1e-4, rtol=0)
    prompt = llama.formatter.encode_dialog_prompt(DIALOG)
    generated, _ = llama.generate([prompt], max_gen_len=STEPS, temperature=0)
    assert generated[0] == up_to_stop(transformers_greedy(model, prompt, STEPS), llama.tokenizer.stop_tokens)
    assert len(generated[0]) == STEPS and len(prompt) + STEPS > 3 * CHUNK


@pytest.mark.slow
def test_metas_eight_shards_load_at_two_and_four_processes_with_transformers_logits_and_tokens(meta, tmp_path):
    """As Meta wrote them, and resharded into four shards of our names by the reshard tool."""
    model, folder = meta
    tokens = batch(200000)
    prompt = Llama4ChatFormat(load_tokenizer(str(folder / "tokenizer.model"))).encode_dialog_prompt(DIALOG)
    reshard(folder, tmp_path / "mp4", 4)
    cases = [{"name": name, "ckpt": str(ckpt), "tokenizer": str(ckpt / "tokenizer.model"), "quantize": None,
              "world_sizes": [2, 4]} for name, ckpt in (("meta", folder), ("meta/mp4", tmp_path / "mp4"))]
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"cases": cases, "tokens": tokens.tolist(), "prompt": prompt, "steps": STEPS,
                                    "out": str(tmp_path)}))
    env = os.environ | {"PYTHONPATH": f"{TESTS.parent}{os.pathsep}{TESTS}", "OMP_NUM_THREADS": "1"}
    job = subprocess.run([sys.executable, str(TESTS / "families_worker.py"), str(manifest)], cwd=TESTS.parent,
                         env=env, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr[-3000:]
    with torch.no_grad():
        expected = model(tokens).logits
    stop_tokens = load_tokenizer(str(folder / "tokenizer.model")).stop_tokens
    expected_tokens = up_to_stop(transformers_greedy(model, prompt, STEPS), stop_tokens)
    for world_size in (2, 4):
        for case in ("meta", "meta/mp4"):
            got = torch.load(tmp_path / f"world{world_size}.pt", weights_only=True)[case]
            torch.testing.assert_close(got["logits"], expected, atol=1e-4, rtol=0, msg=f"{case} at world size {world_size}")
            assert got["tokens"] == expected_tokens, f"{case} at world size {world_size}"


def test_a_batch_job_answers_a_llama4_chat_as_chat_completion_does(meta, tmp_path):
    """run_batch through the engine (continuous batching, the experts, Meta's chat format)."""
    from llama_tp.tools.run_batch import Output, answer_all

    _, folder = meta
    llama = build(folder, "tokenizer.model")
    body = {"model": "llama4", "messages": DIALOG, "max_tokens": 8, "temperature": 0}
    lines = [json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions", "body": body})
             for i in range(3)]
    with Output(tmp_path / "out.jsonl") as output:
        answer_all(llama, "llama4", lines, output)
    expected = llama.chat_completion([DIALOG], max_gen_len=8, temperature=0)[0]["generation"]["content"]
    records = [json.loads(text) for text in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(record["response"]["status_code"] == 200 for record in records)
    assert {record["response"]["body"]["choices"][0]["message"]["content"] for record in records} == {expected}
