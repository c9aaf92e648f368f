"""The quantization check answers every question with both models and compares them token for token."""

import json

import pytest

from llama_tp import Llama
from llama_tp.tools.bench.answer_agreement import QUESTIONS, first_difference, main


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one answer stopped early
    assert first_difference([], []) is None


@pytest.mark.slow
def test_answers_of_both_models_compared(checkpoints, tokenizer_path, tmp_path, capsys):
    out = tmp_path / "answers.json"
    folder = str(checkpoints["llama2", 1])
    main(ckpt_dir=folder, tokenizer_path=tokenizer_path, quantize="int8", max_gen_len=4, max_seq_len=64,
         json_path=str(out))
    records = json.loads(out.read_text(encoding="utf-8"))
    assert [record["question"] for record in records] == list(QUESTIONS)
    for record in records:
        full, int8 = record["full"]["token_ids"], record["int8"]["token_ids"]
        assert record["same"] == (full == int8)
        assert record["first_difference"] == first_difference(full, int8)
    # The full-precision answers are what the model itself says, the int8 ones what its int8 copy
    # says: each question alone, through the API's plain generate() rather than the tool's own batch.
    for name, quantize in (("full", None), ("int8", "int8")):
        llama = Llama.build(folder, tokenizer_path, max_seq_len=64, max_batch_size=1, quantize=quantize)
        for question, record in zip(QUESTIONS, records):
            prompt = llama.formatter.encode_dialog_prompt([{"role": "user", "content": question}])
            tokens, _ = llama.generate([prompt], max_gen_len=4, temperature=0)
            assert record[name]["token_ids"] == tokens[0], (name, question)
    same = sum(record["same"] for record in records)
    assert f"{same} of 10 greedy answers unchanged by int8 (4 tokens each)" in capsys.readouterr().out


def test_a_quantization_is_required(checkpoints, tokenizer_path):
    with pytest.raises(ValueError, match="--quantize is needed"):
        main(ckpt_dir=str(checkpoints["llama2", 1]), tokenizer_path=tokenizer_path, quantize=None)
