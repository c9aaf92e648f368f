"""Complete text prompts (a few examples, or --prompts_file) with a Llama checkpoint split across the torchrun processes.

    torchrun --nproc_per_node N launch/text_completion.py --ckpt_dir DIR --tokenizer_path FILE
    torchrun --nproc_per_node 1 launch/text_completion.py   # the built-in demo model (1 or 3 processes)
"""

from typing import Optional

from llama_tp import Llama
from llama_tp.model.memory import KV_CACHE_FRACTION
from llama_tp.parallel import print0
from llama_tp.tools import demo
from llama_tp.tools.cli import run
from llama_tp.tools.job_output import check_output, run_job
from llama_tp.tools.prompts import batch_rows, beam_search, load_prompts, prompt_record, write_json

EXAMPLE_PROMPTS = [
    # For these prompts, the expected answer is the natural continuation of the prompt
    "I believe the meaning of life is",
    "Simply put, the theory of relativity states that ",
    """A brief message congratulating the team on the launch:

        Hi everyone,

        I just """,
    # Few shot prompt (providing a few examples before asking model to complete more);
    """Translate English to French:

        sea otter => loutre de mer
        peppermint => menthe poivrée
        plush girafe => girafe peluche
        cheese =>""",
]


def main(
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    max_seq_len: int = 128,
    kv_cache_memory: Optional[float] = None,
    kv_cache_fraction: float = KV_CACHE_FRACTION,
    max_gen_len: int = 64,
    max_batch_size: int = 4,
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
    show_top: int = 0,
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
):
    """Print a completion of each prompt.

    Args:
        ckpt_dir: folder with params.json and consolidated.XX.pth shards; leave out both paths
            to run the built-in demo model (SmolLM2-135M-Instruct, fetched and converted once).
        tokenizer_path: the tokenizer file that came with the checkpoint.
        temperature: sampling temperature; 0 is greedy. Sampling settings left out are the
            model's recommended ones (a converted model's llama_tp.json), else Meta's (0.6).
        top_p: nucleus sampling threshold in (0, 1] (default: the model's, else 0.9).
        max_seq_len: longest prompt plus generation, in tokens.
        max_gen_len: most tokens generated per prompt.
        max_batch_size: most prompts decoded together (one with --stream).
        kv_cache_memory: GiB of KV cache a process holds, shared out by the block as prompts grow
            (default: the prompts decoded together x max_seq_len positions' worth; on a GPU,
            --kv_cache_fraction of the memory free after loading).
        kv_cache_fraction: on a GPU without --kv_cache_memory, the share of the memory free after
            loading the weights that the KV cache takes.
        prompts_file: a JSON list of prompt strings, or one a line (JSON Lines); without it, a
            few built-in examples. Prompts beyond --max_batch_size wait for a row to free up:
            a row whose answer ends takes the next prompt at the next step.
        output_jsonl: rank 0 appends a JSON line here as each prompt finishes, {index, prompt,
            generation, token_ids}, whole and flushed: a killed job keeps what it finished.
        resume: skip the prompts that --output_jsonl holds already, and go on appending.
        overwrite: start --output_jsonl afresh, discarding the results it holds (without --resume
            or --overwrite, a file that holds results is refused).
        output_json: rank 0 writes a JSON list here at the end, per prompt {prompt, generation, token_ids}.
        top_k: sample only among the k most likely tokens (default: the model's, else no limit).
        repetition_penalty: >1 discourages tokens already in the text (default: the model's, else 1: off).
        stop: strings that end a completion, e.g. '["\\n\\n"]'; the text is cut before them.
        min_gen_len: the end-of-text token is impossible before this many tokens.
        seed: seed for this run's sampling (default: the seed Llama.build sets).
        stream: print each completion as it is generated (prompts then run one at a time).
        show_top: for each token of the first completion, print the N most likely candidates.
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
        num_beams: beam search with this many beams a prompt, its best answer printed (transformers'
            num_beams; temperature, top_p and top_k play no part); each beam takes a row of its own,
            --max_batch_size prompts then take max_batch_size x num_beams rows.
        length_penalty: beam search: an answer scores its log probability over its length to this
            power (1: the default; above 0 favours longer answers, below 0 shorter ones).
        early_stopping: beam search: true (end once num_beams answers are finished), false (also
            once no beam is likely to do better: the default) or never (only once none can).
        bad_words: words no answer may hold, e.g. '["darn", "heck"]' (each in every way it is
            tokenized, with and without a leading space).
    """
    if stream and show_top:
        raise ValueError("--show_top lists candidates after generation; run it without --stream")
    if stream and (output_jsonl or resume or overwrite):
        raise ValueError("--output_jsonl, --resume and --overwrite are for batch jobs; run them without --stream")
    check_output(output_jsonl, resume, overwrite)
    search = beam_search(num_beams, length_penalty, early_stopping, stream)
    ckpt_dir, tokenizer_path = demo.model_paths(ckpt_dir, tokenizer_path)
    prompts = load_prompts(prompts_file, "text") if prompts_file else EXAMPLE_PROMPTS
    generator = Llama.build(ckpt_dir, tokenizer_path, max_seq_len,
                            batch_rows(max_batch_size, len(prompts), stream, num_beams),
                            dtype=dtype, quantize=quantize, compile=compile,
                            speculate=speculate, speculate_k=speculate_k, draft_ckpt_dir=draft_ckpt_dir,
                            draft_quantize=draft_quantize, kv_cache_memory=kv_cache_memory,
                            kv_cache_fraction=kv_cache_fraction)
    options = dict(temperature=temperature, top_p=top_p, max_gen_len=max_gen_len, top_k=top_k,
                   repetition_penalty=repetition_penalty, stop=stop, min_gen_len=min_gen_len, seed=seed,
                   bad_words=bad_words)
    records = []
    if stream:
        for prompt in prompts:
            print0(prompt)
            print0("> ", end="")
            pieces = generator.stream_text_completion(prompt, **options)
            for piece in pieces:
                print0(piece, end="")
            print0("\n\n==================================\n")
            records.append(prompt_record(prompt, pieces.text, pieces.tokens))
    else:
        first_top = []

        def answer(batch: list[str], batch_seed, on_result) -> None:
            results = generator.text_completion(batch, show_top=show_top, token_ids=True, on_result=on_result,
                                                **(options | search | {"seed": batch_seed}))
            first_top.append(results[0].get("top"))

        records = run_job(prompts, answer, lambda result: result["generation"], output_jsonl, resume, seed,
                          overwrite=overwrite)
        for record in records:
            print0(record["prompt"])
            print0(f"> {record['generation']}")
            print0("\n==================================\n")
        if show_top and first_top:
            print_top(first_top[0])
    if output_json:
        write_json(output_json, records)


def print_top(steps: list[list[tuple[str, float]]]) -> None:
    """One line per generated token of the first prompt: the candidates, most likely first."""
    print0("Most likely candidates at each step of the first completion:")
    for index, candidates in enumerate(steps):
        print0(f"{index:4d}  " + "  ".join(f"{token!r} {prob:.3f}" for token, prob in candidates))


if __name__ == "__main__":
    run(main)
