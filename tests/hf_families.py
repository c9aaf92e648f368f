"""Tiny random models of the Llama family's cousins (mixtures of experts and Llama 4's text model
too), built by transformers' own config classes and saved with save_pretrained (no download), and
the same weights as llama.cpp's converter lays them out in a GGUF file."""

import json
import re
from pathlib import Path

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, Llama4TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config,
                          Qwen3Config, Qwen3MoeConfig)

from llama_tp.tools.convert.gguf_vocab import LLAMA3_SPLIT, QWEN2_SPLIT

VOCAB = 320  # the models' vocabulary: the tokenizer's tokens, padded as Qwen pads its embedding
SEQUENCE = 40  # the tests' longest sequence, longer than WINDOW and several CHUNKs
WINDOW = 12
CHUNK = 8  # Llama 4's attention chunk
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]", "[/INST]",
            "<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}"
           "{% endif %}{% endfor %}")
# Llama 4's, as its Hugging Face template writes a text-only dialog.
LLAMA4 = ("{{ bos_token }}{% for message in messages %}{{ '<|header_start|>' + message['role'] + '<|header_end|>\n\n' "
          "+ message['content'] + '<|eot|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|header_start|>assistant<|header_end|>\n\n' }}{% endif %}")
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, rms_norm_eps=1e-6, max_position_embeddings=128)
# Each family as the issue names it: (config class, its twists, chat template).
FAMILIES = {
    # Llama 3.2: tied embeddings, Llama 3.1's rope scaling with factor 32
    "llama": (LlamaConfig, dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
        "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}), CHATML),
    "mistral": (MistralConfig, dict(sliding_window=None, head_dim=16), MISTRAL),
    "mistral_window": (MistralConfig, dict(sliding_window=WINDOW, head_dim=16), MISTRAL),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=True), CHATML),  # biases on q, k and v
    "qwen3": (Qwen3Config, dict(head_dim=32), CHATML),  # q/k norms; heads wider than hidden_size / heads
    # Mixtures of experts: top-2 of 4 (each expert of intermediate_size), top-3 of 8 renormalised.
    "mixtral": (MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16), MISTRAL),
    "qwen3_moe": (Qwen3MoeConfig, dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64, head_dim=32,
                                       norm_topk_prob=True), CHATML),
    # Llama 4 (text): top-1 of 4 experts and a shared one every second layer (dense layers of
    # intermediate_size_mlp between), the fourth layer NoPE with temperature-tuned queries from
    # position 3 (floor_scale 4), the others chunked, Llama 4 Scout's rope scaling (equal factors).
    "llama4": (Llama4TextConfig, dict(head_dim=16, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4,
                                      num_local_experts=4, interleave_moe_layer_step=2, attention_chunk_size=CHUNK,
                                      floor_scale=4, rope_parameters={
                                          "rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                          "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                                          "original_max_position_embeddings": 64}), LLAMA4),
}
# llama.cpp's architecture names, for the families that convert through GGUF (Mixtral is its `llama`).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "llama", "qwen3_moe": "qwen3moe"}


def tokenizer_files(folder: Path, template: str, split: str = "") -> int:
    """A trained byte-level BPE tokenizer.json with ChatML's and Mistral's control tokens, words
    split by the regex `split` as Llama 3's and Qwen's are (else GPT-2's); its size."""
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not split)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]) if split else byte_level
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + ["Paris is in France"], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    bos, eos = {MISTRAL: ("<s>", "</s>"), LLAMA4: ("<|begin_of_text|>", "<|eot|>")}.get(template, ("<|im_start|>", "<|im_end|>"))
    config = {"bos_token": bos, "eos_token": eos, "add_bos_token": template == MISTRAL, "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab_size()


def hf_model(folder: Path, family: str, **more_twists) -> torch.nn.Module:
    """A random model of `family` (with more_twists to its config) saved in folder with its
    tokenizer; the model, in fp32."""
    config_class, twists, template = FAMILIES[family]
    twists = twists | more_twists
    folder.mkdir(parents=True)
    split = {"llama": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, "qwen3": QWEN2_SPLIT, "qwen3_moe": QWEN2_SPLIT}.get(family, "")
    assert tokenizer_files(folder, template, split) <= VOCAB
    eos = {MISTRAL: "</s>", LLAMA4: "<|eot|>"}.get(template, "<|im_end|>")
    config = config_class(**COMMON | twists, eos_token_id=SPECIALS.index(eos))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            # Random norms and biases too, so that a misplaced one could not go unnoticed.
            parameter.copy_(1 + 0.1 * torch.randn_like(parameter) if "norm" in name else 0.1 * torch.randn_like(parameter))
    model.save_pretrained(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(generation | {"temperature": 0.7, "top_p": 0.8, "top_k": 20}))
    return model


def transformers_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens for prompt, with no stop token."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, len(prompt):].tolist()


def up_to_stop(tokens: list[int], stop_tokens: set[int]) -> list[int]:
    """tokens before the first stop token, as generate returns them."""
    return next((tokens[:i] for i, token in enumerate(tokens) if token in stop_tokens), tokens)


def llama_cpp_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: Hugging Face's rotate-half rows to interleaved pairs."""
    return weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path: Path, model: torch.nn.Module, family: str, tokenizer_json: Path, experts_as=None) -> None:
    """model's weights as llama.cpp's convert_hf_to_gguf.py writes them for `family` (f32; the
    experts' tensors quantized by gguf's own code to the GGMLQuantizationType experts_as, if given)."""
    from gguf import GGUFWriter, quants

    arch, config = GGUF_ARCHITECTURES[family], model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    if hasattr(config, "num_experts_per_tok"):  # as llama.cpp's converter writes Mixtral and Qwen3-MoE
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if head_dim * config.num_attention_heads != config.hidden_size:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    tokenizer = json.loads(tokenizer_json.read_text())
    vocab = [token for token, _ in sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])]
    vocab += [f"[PAD{i}]" for i in range(VOCAB - len(vocab))]  # as llama.cpp pads Qwen's vocabulary
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
    writer.add_token_list(vocab)
    writer.add_token_types([3 if token in SPECIALS else 5 if token.startswith("[PAD") else 1 for token in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(SPECIALS.index("<|im_start|>"))
    writer.add_eos_token_id(SPECIALS.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    state = model.state_dict()
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":  # llama.cpp stores the rescaling as a tensor of divisors
        from llama_tp.model.rotary import _llama31_scaled
        freqs = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
        scaled = _llama31_scaled(freqs, rope["factor"], rope["high_freq_factor"], rope["low_freq_factor"],
                                 rope["original_max_position_embeddings"])
        writer.add_tensor("rope_freqs.weight", (freqs / scaled).numpy().astype(np.float32))
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    for name, tensor in state.items():
        experts = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj", name)
        if experts:  # every expert's in one tensor of [experts, out, in]: gate and up apart
            layer, kind = experts.groups()
            parts = {"ffn_down_exps": tensor} if kind == "down" else dict(zip(("ffn_gate_exps", "ffn_up_exps"), tensor.chunk(2, dim=1)))
            for gguf_name, part in parts.items():
                values = part.contiguous().numpy()
                if experts_as is None:
                    writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", values)
                else:
                    writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", quants.quantize(values, experts_as),
                                      raw_dtype=experts_as)
            continue
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        if match is None:
            continue
        layer, module, kind = match.groups()
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
            tensor = llama_cpp_permute(tensor, heads)  # only for `llama`: qwen2/3 rotate NEOX style
        writer.add_tensor(f"blk.{layer}.{names[module]}.{kind}", tensor.numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    if not config.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
