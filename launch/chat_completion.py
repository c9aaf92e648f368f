"""Answer dialogs (a few examples, or --prompts_file) with a Llama chat checkpoint split across the torchrun processes.

    torchrun --nproc_per_node N launch/chat_completion.py --ckpt_dir DIR --tokenizer_path FILE
    torchrun --nproc_per_node 1 launch/chat_completion.py   # the built-in demo model (1 or 3 processes)
"""

from typing import Optional

from llama_tp import Dialog, Llama
from llama_tp.model.memory import KV_CACHE_FRACTION
from llama_tp.parallel import print0
from llama_tp.tools import demo
from llama_tp.tools.cli import run
from llama_tp.tools.job_output import check_output, run_job
from llama_tp.tools.prompts import batch_rows, beam_search, load_prompts, prompt_record, write_json

EXAMPLE_DIALOGS: list[Dialog] = [
    [{"role": "user", "content": "what is the recipe of mayonnaise?"}],
    [
        {"role": "user", "content": "I am going to Paris, what should I see?"},
        {
            "role": "assistant",
            "content": "Paris, the capital of France, is known for its stunning architecture, art "
            "museums, historical landmarks, and romantic atmosphere. The Eiffel Tower, the Louvre "
            "and Notre-Dame are three of the most famous sights.",
        },
        {"role": "user", "content": "What is so great about #1?"},
    ],
    [
        {"role": "system", "content": "Always answer with Haiku"},
        {"role": "user", "content": "I am going to Paris, what should I see?"},
    ],
    [
        {"role": "system", "content": "Always answer with emojis"},
        {"role": "user", "content": "How to go from Beijing to NY?"},
    ],
]


def main(
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    max_seq_len: int = 512,
    kv_cache_memory: Optional[float] = None,
    kv_cache_fraction: float = KV_CACHE_FRACTION,
    max_batch_size: int = 4,
    max_gen_len: Optional[int] = None,
    prompts_file: Optional[str] = None,
    output_json: Optional[str] = None,
    output_jsonl: Optional[str] = None,
    resume: bool = False,
    overwrite: bool = False,
    top_k: Optional[int] = None,
    repetition_penalty: Optional[float] = None,
    stop: Optional[list[str]] = None,
    min_gen_len: int = 0,
    seed: Optional[int] = None,
    stream: bool = False,
    dtype: Optional[str] = None,
    quantize: Optional[str] = None,
    compile: Optional[bool] = None,
    speculate: Optional[str] = None,
    speculate_k: Optional[int] = None,
    draft_ckpt_dir: Optional[str] = None,
    draft_quantize: Optional[str] = None,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: str = "false",
    bad_words: Optional[list[str]] = None,
    reasoning_parser: Optional[str] = None,
):
    """Print each dialog and the model's reply.

    Args:
        ckpt_dir: folder with params.json and consolidated.XX.pth shards; leave out both paths
            to run the built-in demo model (SmolLM2-135M-Instruct, fetched and converted once).
        tokenizer_path: the tokenizer file that came with the checkpoint.
        temperature: sampling temperature; 0 is greedy. Sampling settings left out are the
            model's recommended ones (a converted model's llama_tp.json), else Meta's (0.6).
        top_p: nucleus sampling threshold in (0, 1] (default: the model's, else 0.9).
        max_seq_len: longest dialog plus reply, in tokens.
        max_batch_size: most dialogs decoded together (one with --stream).
        kv_cache_memory: GiB of KV cache a process holds, shared out by the block as dialogs grow
            (default: the dialogs decoded together x max_seq_len positions' worth; on a GPU,
            --kv_cache_fraction of the memory free after loading).
        kv_cache_fraction: on a GPU without --kv_cache_memory, the share of the memory free after
            loading the weights that the KV cache takes.
        max_gen_len: most tokens per reply; by default up to the end of the context.
        prompts_file: a JSON list of dialogs, each a list of {"role", "content"} messages, or
            one dialog a line (JSON Lines); without it, a few built-in examples. Dialogs beyond
            --max_batch_size wait for a row to free up: a row whose answer ends takes the next
            dialog at the next step.
        output_jsonl: rank 0 appends a JSON line here as each dialog finishes, {index, prompt,
            generation, token_ids}, whole and flushed: a killed job keeps what it finished.
        resume: skip the dialogs that --output_jsonl holds already, and go on appending.
        overwrite: start --output_jsonl afresh, discarding the results it holds (without --resume
            or --overwrite, a file that holds results is refused).
        output_json: rank 0 writes a JSON list here at the end, per dialog {prompt, generation, token_ids}.
        top_k: sample only among the k most likely tokens (default: the model's, else no limit).
        repetition_penalty: >1 discourages tokens already in the dialog (default: the model's, else 1: off).
        stop: strings that end a reply, e.g. '["User:"]'; the reply is cut before them.
        min_gen_len: the end-of-turn token is impossible before this many tokens.
        seed: seed for this run's sampling (default: the seed Llama.build sets).
        stream: print each reply as it is generated (dialogs then run one at a time).
        dtype: fp32, bf16 or fp16 (default: fp32 on CPU, bf16 or fp16 on GPU).
        quantize: int8 or int4 (weight-only; int4 on CPU) or int8_dynamic (CPU) linear layers,
            made at load time; a quantized checkpoint loads as it is stored.
        compile: compile the decoding step (by default on GPUs, not on CPUs) once the first
            reply has waited for the compiler (3-6 s on a CPU): 1.1-1.9x faster steps on CPU
            (by CPU) with --max_batch_size 1, little gain with more; worth it for long jobs.
        speculate: draft or lookup: guess tokens, then verify several in one pass, with the same
            greedy answers (docs/speculative.md); a draft needs --draft_quantize or --draft_ckpt_dir.
        speculate_k: guesses a round, 1 to 15 (default: tuned for each mode).
        draft_ckpt_dir: the draft model's checkpoint, sharing the tokenizer (default: this model).
        draft_quantize: the draft's quantization: int4 or int8 alone makes such a copy of this model.
        num_beams: beam search with this many beams a dialog, its best answer printed (transformers'
            num_beams; temperature, top_p and top_k play no part); each beam takes a row of its own,
            --max_batch_size dialogs then take max_batch_size x num_beams rows.
        length_penalty: beam search: an answer scores its log probability over its length to this
            power (1: the default; above 0 favours longer answers, below 0 shorter ones).
        early_stopping: beam search: true (end once num_beams answers are finished), false (also
            once no beam is likely to do better: the default) or never (only once none can).
        bad_words: words no answer may hold, e.g. '["darn", "heck"]' (each in every way it is
            tokenized, with and without a leading space).
        reasoning_parser: qwen3 or deepseek_r1: a thinking model's <think>...</think> goes apart
            from its chat answers (reasoning_content); none: left in them (default: the one the
            chat template calls for, where it is clear).
    """
    if stream and (output_jsonl or resume or overwrite):
        raise ValueError("--output_jsonl, --resume and --overwrite are for batch jobs; run them without --stream")
    check_output(output_jsonl, resume, overwrite)
    search = beam_search(num_beams, length_penalty, early_stopping, stream)
    ckpt_dir, tokenizer_path = demo.model_paths(ckpt_dir, tokenizer_path)
    dialogs = load_prompts(prompts_file, "chat") if prompts_file else EXAMPLE_DIALOGS
    generator = Llama.build(ckpt_dir, tokenizer_path, max_seq_len,
                            batch_rows(max_batch_size, len(dialogs), stream, num_beams),
                            dtype=dtype, quantize=quantize, compile=compile,
                            speculate=speculate, speculate_k=speculate_k, draft_ckpt_dir=draft_ckpt_dir,
                            draft_quantize=draft_quantize, reasoning_parser=reasoning_parser,
                            kv_cache_memory=kv_cache_memory, kv_cache_fraction=kv_cache_fraction)
    options = dict(temperature=temperature, top_p=top_p, max_gen_len=max_gen_len, top_k=top_k,
                   repetition_penalty=repetition_penalty, stop=stop, min_gen_len=min_gen_len, seed=seed,
                   bad_words=bad_words)
    results = [] if stream else run_job(
        dialogs, lambda batch, batch_seed, on_result: generator.chat_completion(
            batch, token_ids=True, on_result=on_result, **(options | search | {"seed": batch_seed})),
        lambda result: result["generation"]["content"], output_jsonl, resume, seed,
        lambda result: result["generation"].get("reasoning_content"), overwrite=overwrite)
    records = []
    for index, dialog in enumerate(dialogs):
        for message in dialog:
            print0(f"{message['role'].capitalize()}: {message['content']}\n")
        print0("> Assistant: ", end="")
        if stream:
            pieces = generator.stream_chat_completion(dialog, **options)
            for piece in pieces:
                print0(piece, end="")
            print0()
            records.append(streamed_record(generator, dialog, pieces))
        else:
            records.append(results[index])
            if "reasoning_content" in results[index]:  # a reasoning model's thinking, before its answer
                print0(f"(thinking) {results[index]['reasoning_content'].strip()}\n")
            print0(results[index]["generation"])
        print0("\n==================================\n")
    if output_json:
        write_json(output_json, records)


def streamed_record(generator: Llama, dialog: Dialog, pieces) -> dict:
    """A streamed reply's record: a reasoning model's thinking apart, as chat_completion keeps it."""
    if generator.reasoning is None:
        return prompt_record(dialog, pieces.text, pieces.tokens)
    split = generator.reasoning.thinking(generator.formatter.encode_dialog_prompt(dialog)).split(pieces.text)
    return prompt_record(dialog, split.content, pieces.tokens, split.reasoning)


if __name__ == "__main__":
    run(main)
