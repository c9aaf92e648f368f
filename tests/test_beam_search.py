"""Beam search (engine/beams.py) against transformers' generate(num_beams=4, ...), token for token,
on a tiny random Llama whose logits are sharp enough that beams end at its end token; its beams
share the prompt's blocks (held once, prefilled once, copied only where they differ), whatever
else runs beside them, preempted or not, at world sizes 1 and 2."""

import pytest
import torch

from distributed import run_world
from llama_tp import Llama
from llama_tp.engine import Admission, GenerationRequest, run_job
from llama_tp.engine.blocks import BlockPool
from llama_tp.engine.requests import BeamSearch
from llama_tp.engine.scheduler import Scheduler
from llama_tp.model.args import ModelArgs
from llama_tp.model.kv_cache import BLOCK_POSITIONS, blocks_for
from llama_tp.model.prefix_cache import PrefixCache
from llama_tp.sampling import SamplingOptions
from llama_tp.tools.bench.hf import build_hf_model
from serve_client import client
from test_serve_real_engine import MODEL as REAL_MODEL
from test_serve_real_engine import real_server
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, END = 32000, 2  # the Llama 2 tokenizer's, and its end of text
MAX_GEN_LEN = 24
# (length_penalty, early_stopping): transformers' default, and each way either changes the search
SETTINGS = [(1.0, False), (0.5, True), (2.0, "never"), (-1.0, False), (1.0, "never")]


def sharp_weights() -> dict[str, torch.Tensor]:
    """TINY_LLAMA2's weights with logits 20 times as far apart (random ones are nearly flat: every
    beam within rounding of the others), and the end token likelier, so that some beams finish."""
    weights = full_weights(TINY_LLAMA2, VOCAB)
    output = weights["output.weight"].float() * 20
    output[END] *= 3
    weights["output.weight"] = output.to(torch.bfloat16)
    return weights


def prompts() -> list[list[int]]:
    """Prompts of 3 to 69 tokens: some cross a block of the cache as they grow, one fills a block and more."""
    generator = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in (2, 26, 57, 68, 5)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[int, str]:
    root, weights = tmp_path_factory.mktemp("beams"), sharp_weights()
    return {shards: str(write_checkpoint(root / f"mp{shards}", TINY_LLAMA2, weights, shards, "dim")) for shards in (1, 2)}


@pytest.fixture(scope="module")
def llama(folders) -> Llama:
    # 8 rows: two searches of 4 beams at once
    return Llama.build(folders[1], str(LLAMA2_TOKENIZER), max_seq_len=128, max_batch_size=8)


@pytest.fixture(scope="module")
def transformers_beams():
    args = ModelArgs.from_dict(TINY_LLAMA2).with_vocab_size(VOCAB)
    model = build_hf_model({name: tensor.float() for name, tensor in sharp_weights().items()}, args, 128,
                           torch.float32)

    def search(prompt: list[int], length_penalty: float, early_stopping, returned: int) -> list[list[int]]:
        """transformers' answers, best first, without their end token and padding."""
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=MAX_GEN_LEN, num_beams=4, length_penalty=length_penalty,
                                 early_stopping=early_stopping, num_return_sequences=returned, do_sample=False,
                                 eos_token_id=[END], pad_token_id=0)
        answers = [row[len(prompt):].tolist() for row in out]
        return [answer[: answer.index(END)] if END in answer else answer for answer in answers]

    return search


def expected(transformers_beams, returned: int) -> dict:
    return {(length_penalty, early_stopping): [answer for prompt in prompts()
                                               for answer in transformers_beams(prompt, length_penalty, early_stopping,
                                                                                returned)]
            for length_penalty, early_stopping in SETTINGS}


def ours(llama: Llama, returned: int) -> dict:
    """Every prompt's search in one call: two at a time, the later ones admitted as rows free up."""
    return {(length_penalty, early_stopping): llama.generate(prompts(), MAX_GEN_LEN, num_beams=4,
                                                             length_penalty=length_penalty,
                                                             early_stopping=early_stopping,
                                                             num_return_sequences=returned)[0]
            for length_penalty, early_stopping in SETTINGS}


@pytest.mark.parametrize("returned", [1, 4])
def test_beams_are_transformers_beams(llama, transformers_beams, returned):
    found, wanted = ours(llama, returned), expected(transformers_beams, returned)
    assert found == wanted
    # the searches did end at the end token, and not only at the token limit
    assert any(len(answer) < MAX_GEN_LEN for answers in wanted.values() for answer in answers)
    assert llama.block_pool.held == 0  # every beam gave its blocks back


def test_log_probabilities_and_echo_are_the_best_beams(llama):
    prompt = prompts()[1]
    (tokens,), (logprobs,) = llama.generate([prompt], MAX_GEN_LEN, num_beams=4, logprobs=True)
    (echoed,), (echoed_logprobs,) = llama.generate([prompt], MAX_GEN_LEN, num_beams=4, logprobs=True, echo=True)
    (greedy_prompt,), (prompt_logprobs,) = llama.generate([prompt], 1, temperature=0, logprobs=True, echo=True)
    # within fp32 rounding: one of the two may start from keys and values an earlier request left
    assert echoed == prompt + tokens and echoed_logprobs[len(prompt):] == pytest.approx(logprobs, abs=1e-5)
    assert echoed_logprobs[: len(prompt)] == pytest.approx(prompt_logprobs[: len(prompt)], abs=1e-5)
    # each token's log probability under the model after the beam's tokens before it
    _, (scored,) = llama.generate([prompt + tokens], 1, temperature=0, logprobs=True, echo=True)
    assert logprobs == pytest.approx(scored[len(prompt) : len(prompt) + len(tokens)], abs=1e-4)


def test_a_search_holds_its_prompt_once_and_prefills_it_once(folders):
    """4 beams over a 1000-token prompt: the prompt's full blocks held once, each beam's own tail
    besides (its copy of the prompt's last, partial block, then the blocks its tokens fill)."""
    llama = Llama.build(folders[1], str(LLAMA2_TOKENIZER), max_seq_len=1100, max_batch_size=4)
    engine = llama.engine()
    fed = []
    feed = engine.scheduler.fed
    engine.scheduler.fed = lambda chunk: fed.append(len(chunk.tokens)) or feed(chunk)
    prompt = [1] + torch.randint(3, VOCAB, (999,), generator=torch.Generator().manual_seed(1)).tolist()
    request = GenerationRequest("search", tuple(prompt), 40, SamplingOptions(), frozenset({END}),
                                beams=BeamSearch(4, early_stopping="never"))
    slots = engine.choose_slots(request, set())
    engine.admit(Admission(request, slots[0], 0, beam_slots=slots[1:]))
    shared = len(prompt) // BLOCK_POSITIONS  # the prompt's full blocks
    updates, steps = [], 0
    while not updates:
        updates = [update for update in engine.step() if update.delta.finished]
        beams = [sequence for sequence in engine.running if sequence.request is request]
        generated = max((beam.generated for beam in beams), default=0)
        if beams and generated:
            steps += 1
            assert len(beams) == 4
            own = blocks_for(len(prompt) % BLOCK_POSITIONS + generated)  # a beam's tail, in blocks
            assert engine.cache_use().used <= shared + 4 * own < 4 * blocks_for(len(prompt))
            assert all(beam.blocks[:shared] == beams[0].blocks[:shared] for beam in beams)
    assert sum(fed) == len(prompt) + 4 * steps  # the prompt once; then a token a beam a step (the last one ends it)
    assert len(updates[0].delta.beams) == 1 and engine.cache_use().used == 0


def test_searches_preempted_and_resumed_give_the_same_beams(folders, llama):
    """A cache of 10 blocks for two searches of 4 beams that each grow to 8 (a prompt of 58 tokens
    and 24 more: every beam's own two blocks): they preempt each other (the whole search gives its
    blocks back, resumes by prefilling each beam but its last token, then steps again) and still
    find the beams they find with room to spare."""
    tight = Llama.build(folders[1], str(LLAMA2_TOKENIZER), max_seq_len=128, max_batch_size=8,
                        kv_cache_memory=10 * BLOCK_POSITIONS * 1024 / 2**30)  # 1 KiB a position: 2 layers' k and v
    assert tight.model.cache_blocks == 10
    prompt = prompts()[2]
    assert len(prompt) % BLOCK_POSITIONS + MAX_GEN_LEN > BLOCK_POSITIONS
    roomy, _ = llama.generate([prompt] * 3, MAX_GEN_LEN, num_beams=4, num_return_sequences=2, early_stopping="never")
    engines = []
    engine = tight.engine
    tight.engine = lambda *args, **kwargs: engines.append(engine(*args, **kwargs)) or engines[-1]
    found, _ = tight.generate([prompt] * 3, MAX_GEN_LEN, num_beams=4, num_return_sequences=2, early_stopping="never")
    assert found == roomy
    assert engines[0].scheduler.preemptions > 0 and tight.block_pool.held == 0
    # 8 beams could each hold two blocks of their own: more than the cache has, so they would preempt each other for good
    with pytest.raises(ValueError, match="prompt 0: a search of 8 beams over its 58 tokens and 70 more may hold 16 "
                                         "blocks of the KV cache, which has 10"):
        tight.generate([prompt], 70, num_beams=8)


def test_what_beam_search_cannot_be_is_refused_in_a_line(llama):
    prompt = prompts()[0]
    refusals = {
        "num_return_sequences 2 needs beam search": dict(num_return_sequences=2),
        "num_beams must be an integer of 2 or more": dict(num_beams=0),
        "num_return_sequences must be an integer from 1 to num_beams \\(4\\)": dict(num_beams=4, num_return_sequences=5),
        'early_stopping must be True, False or "never"': dict(num_beams=4, early_stopping="soon"),
        "length_penalty must be a number": dict(num_beams=4, length_penalty="long"),
        "num_beams 9 needs a cache row a beam, but max_batch_size is 8": dict(num_beams=9),
        "stop cannot be combined with beam search": dict(num_beams=4, stop=["."]),
    }
    for message, arguments in refusals.items():
        with pytest.raises(ValueError, match=message):
            llama.generate([prompt], 4, **arguments)
    with pytest.raises(ValueError, match="show_top cannot be combined with beam search"):
        llama.text_completion(["Hi"], max_gen_len=4, num_beams=2, show_top=2)
    with pytest.raises(ValueError, match="response_format cannot be combined with beam search"):
        llama.text_completion(["Hi"], max_gen_len=4, num_beams=2, response_format={"type": "json_object"})


def test_text_and_chat_completion_return_each_prompts_beams_in_turn(llama):
    texts = ["Once upon a time", "The meaning of life is"]
    results = llama.text_completion(texts, max_gen_len=8, num_beams=3, num_return_sequences=2, token_ids=True)
    tokens, _ = llama.generate([llama.tokenizer.encode(text, bos=True, eos=False) for text in texts], 8,
                               num_beams=3, num_return_sequences=2)
    assert [result["token_ids"] for result in results] == tokens
    assert [result["generation"] for result in results] == [llama.tokenizer.decode(answer) for answer in tokens]
    dialogs = [[{"role": "user", "content": text}] for text in texts]
    seen = []
    chats = llama.chat_completion(dialogs, max_gen_len=8, num_beams=3, num_return_sequences=3, token_ids=True,
                                  on_result=lambda row, result: seen.append(row))
    assert len(chats) == 6 and sorted(seen) == list(range(6))
    prompt_tokens = [llama.formatter.encode_dialog_prompt(dialog) for dialog in dialogs]
    searched, _ = llama.generate(prompt_tokens, 8, num_beams=3, num_return_sequences=3)
    assert [chat["token_ids"] for chat in chats] == searched


def _on_two_ranks(folder: str, returned: int) -> dict:
    llama = Llama.build(folder, str(LLAMA2_TOKENIZER), max_seq_len=128, max_batch_size=8)
    return ours(llama, returned)


@pytest.mark.slow  # two spawned processes
@pytest.mark.parametrize("returned", [1, 4])
def test_two_ranks_find_transformers_beams(folders, transformers_beams, returned):
    found = run_world(2, _on_two_ranks, folders[2], returned)
    assert found[0] == found[1] == expected(transformers_beams, returned)


def test_the_servers_use_beam_search_answers_as_generate(llama):
    """vLLM's extension through the openai client's extra_body: n beams (or best_of's, or
    beam_width's), the n best as the choices, the API's own beams."""
    prompt = "Once upon a time"
    tokens = llama.tokenizer.encode(prompt, bos=True, eos=False)
    dialog = [{"role": "user", "content": "Tell me a story."}]
    with real_server(llama) as server:
        openai_client = client(server.url)
        completion = openai_client.completions.create(
            model=REAL_MODEL, prompt=prompt, max_tokens=MAX_GEN_LEN, n=4,
            extra_body={"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True})
        best_of = openai_client.completions.create(model=REAL_MODEL, prompt=prompt, max_tokens=MAX_GEN_LEN, n=2,
                                                   best_of=4, logprobs=0, extra_body={"use_beam_search": True})
        chat = openai_client.chat.completions.create(model=REAL_MODEL, messages=dialog, max_tokens=MAX_GEN_LEN, n=2,
                                                     logprobs=True, extra_body={"use_beam_search": True, "beam_width": 3})
    searched, _ = llama.generate([tokens], MAX_GEN_LEN, num_beams=4, num_return_sequences=4, length_penalty=0.5,
                                 early_stopping=True)
    assert [choice.text for choice in completion.choices] == [llama.tokenizer.decode(answer) for answer in searched]
    assert [choice.index for choice in completion.choices] == [0, 1, 2, 3]
    best, logprobs = llama.generate([tokens], MAX_GEN_LEN, num_beams=4, num_return_sequences=2, logprobs=True)
    assert [choice.text for choice in best_of.choices] == [llama.tokenizer.decode(answer) for answer in best]
    for choice, answer_logprobs in zip(best_of.choices, logprobs):
        assert choice.logprobs.token_logprobs == pytest.approx(answer_logprobs, abs=1e-5)
    assert best_of.usage.completion_tokens == sum(len(answer) + (choice.finish_reason == "stop")
                                                  for answer, choice in zip(best, best_of.choices))
    assert best_of.usage.prompt_tokens == len(tokens)
    replies = llama.chat_completion([dialog], max_gen_len=MAX_GEN_LEN, num_beams=3, num_return_sequences=2,
                                    logprobs=True)
    assert [choice.message.content for choice in chat.choices] == [reply["generation"]["content"] for reply in replies]
    for choice, reply in zip(chat.choices, replies):
        assert [entry.logprob for entry in choice.logprobs.content] == pytest.approx(reply["logprobs"], abs=1e-5)


@pytest.mark.parametrize("ours_options, theirs_options", [
    (dict(min_gen_len=20), dict(min_new_tokens=20)),  # no end token before 20 tokens
    (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),  # on the log probabilities, as transformers'
])
def test_min_gen_len_and_the_repetition_penalty_as_transformers_processors(llama, ours_options, theirs_options):
    args = ModelArgs.from_dict(TINY_LLAMA2).with_vocab_size(VOCAB)
    model = build_hf_model({name: tensor.float() for name, tensor in sharp_weights().items()}, args, 128,
                           torch.float32)
    prompt = prompts()[3]  # whose beams repeat a token without the penalty
    found, _ = llama.generate([prompt], MAX_GEN_LEN, num_beams=4, num_return_sequences=4, **ours_options)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=MAX_GEN_LEN, num_beams=4, num_return_sequences=4, do_sample=False,
                             eos_token_id=[END], pad_token_id=0, **theirs_options)
    expected = [row[len(prompt):].tolist() for row in out]
    assert found == [answer[: answer.index(END)] if END in answer else answer for answer in expected]
    plain, _ = llama.generate([prompt], MAX_GEN_LEN, num_beams=4, num_return_sequences=4)
    assert found != plain  # the option changed the search


def test_speculating_models_search_beams_a_token_a_step_as_others_do(folders, llama):
    speculating = Llama.build(folders[1], str(LLAMA2_TOKENIZER), max_seq_len=128, max_batch_size=8,
                              speculate="lookup")
    searched = speculating.generate(prompts()[:3], MAX_GEN_LEN, num_beams=4, num_return_sequences=2)[0]
    assert searched == llama.generate(prompts()[:3], MAX_GEN_LEN, num_beams=4, num_return_sequences=2)[0]


def test_forked_beams_share_their_parents_blocks_and_copy_the_one_they_write():
    """The scheduler's bookkeeping alone: beams take over their parents' blocks by reference; the
    block a beam writes, shared, is copied first (by all but the last to write it)."""
    scheduler = Scheduler(PrefixCache(4), max_prefill_tokens=512, pool=BlockPool(12))
    prompt = tuple(range(3, 3 + BLOCK_POSITIONS + 10))  # a full block and 10 tokens of the next
    request = GenerationRequest("s", prompt, 8, SamplingOptions(), frozenset({END}), beams=BeamSearch(4))
    slots = scheduler.choose_slots(prompt, 4, set())
    assert slots == (0, 1, 2, 3)
    leader = scheduler.admit(request, slots[0])
    scheduler.reserve(slots[1:])
    assert scheduler.free_slots() == [] and scheduler.choose_slot((1, 2), set()) is None
    scheduler.fed(scheduler.plan().prefill[0])
    prompt_blocks = list(leader.blocks)
    beams = scheduler.fork([leader], list(slots[1:]), [0, 0, 0, 0], [7, 8, 9, 10])
    assert [beam.slot.index for beam in beams] == [0, 1, 2, 3] and beams[0].tokens == list(prompt) + [7]
    assert all(beam.blocks == prompt_blocks for beam in beams) and scheduler.pool.held == 2  # held once
    plan = scheduler.plan()
    assert [chunk.tokens for chunk in plan.decode] == [[7], [8], [9], [10]]
    # the prompt's partial block: copied by three beams, written in place by the last
    assert [source for source, _ in plan.copies] == [beams[3].blocks[1]] * 3
    assert len({beam.blocks[1] for beam in beams}) == 4 and len({beam.blocks[0] for beam in beams}) == 1
    assert scheduler.pool.held == 5 and plan.tables == {beam.slot.index: beam.blocks for beam in beams}
    for chunk in plan.decode:
        scheduler.fed(chunk)
    # the next step: beam 0 goes on twice, beam 2 once, beam 3 once; beam 1 ends, its copy given back
    first = (list(beams[0].tokens), list(beams[0].blocks))
    again = scheduler.fork(beams, [], [0, 0, 2, 3], [11, 12, 13, 14])
    assert [beam.slot.index for beam in again] == [0, 1, 2, 3]  # beam 1's slot taken by beam 0's second child
    assert (again[1].tokens, again[1].blocks) == (first[0] + [12], first[1])
    assert scheduler.pool.held == 4 and scheduler.prefix_cache.rows[1] == scheduler.prefix_cache.rows[0]


def test_a_cancelled_search_answers_with_its_best_beams_and_gives_back_every_block(llama):
    engine = llama.engine()
    request = GenerationRequest("c", tuple(prompts()[2]), MAX_GEN_LEN, SamplingOptions(), frozenset({END}),
                                beams=BeamSearch(4, early_stopping="never", returned=3))
    slots = engine.choose_slots(request, set())
    engine.admit(Admission(request, slots[0], 0, beam_slots=slots[1:]))
    for _ in range(4):
        assert not engine.step()  # no answer before the search ends
    (update,) = engine.cancel("c")
    assert update.delta.finish_reason == "cancelled" and len(update.delta.beams) == 3
    # the best finished hypotheses so far, then the best running beams (4 tokens each after 4 steps)
    assert all(beam.finish_reason == "cancelled" and 1 <= len(beam.tokens) <= 4 for beam in update.delta.beams)
    assert update.delta.tokens == update.delta.beams[0].tokens
    assert engine.cache_use().used == 0 and engine.scheduler.free_slots() == list(range(8))


def test_a_search_beside_other_requests_changes_none_of_their_answers(llama):
    """One step holds a search's beams, greedy and sampled rows, a prompt's chunks: each answer is the one it gets alone."""
    search = GenerationRequest("beams", tuple(prompts()[3]), MAX_GEN_LEN, SamplingOptions(), frozenset({END}),
                               beams=BeamSearch(4, returned=2))
    greedy = GenerationRequest("greedy", tuple(prompts()[1]), MAX_GEN_LEN, SamplingOptions(temperature=0),
                               frozenset({END}))
    sampled = GenerationRequest("sampled", tuple(prompts()[2]), MAX_GEN_LEN, SamplingOptions(temperature=1.0),
                                frozenset({END}), bad_words=((20601,),))
    jobs = [(greedy, 1), (search, 2), (sampled, 3)]

    def answers(requests) -> dict:
        finals = {update.sequence.request.id: update.delta for step in run_job(llama.engine(), requests)
                  for update in step if update.delta.finished}
        return {name: [list(beam.tokens) for beam in delta.beams] or list(delta.tokens) for name, delta in finals.items()}

    together = answers(jobs)
    assert together == answers(jobs[:1]) | answers(jobs[1:2]) | answers(jobs[2:])
    assert len(together["beams"]) == 2 and 20601 not in together["sampled"]
