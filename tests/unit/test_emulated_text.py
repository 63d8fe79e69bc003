"""``server.emulated_text.EmulatedText``: an emulated model's output ids as one common word
each, prompts through SmolLM2's tokenizer (read from the installed GGUF or pdlab's cache, no
download), and ``pdlab serve``'s choice of text from its configuration."""

from __future__ import annotations

import random

import pytest

from engine.config import ModelConfig
from engine.model import load_geometry, smollm2_tokenizer
from experiments.commands.serve import serving_text
from server.emulated_text import WORDS, EmulatedText
from server.text import ByteText, HFText, TextStream

LLAMA = "engine/configs/llama-3.1-8b"  # vocabulary 128256
LLAMA_VOCAB = 128256


@pytest.fixture(scope="module")
def smollm2() -> HFText:
    return HFText(smollm2_tokenizer())


@pytest.fixture(scope="module")
def text(smollm2) -> EmulatedText:
    return EmulatedText(smollm2, LLAMA_VOCAB)


def test_every_word_is_one_smollm2_token_with_its_leading_space(smollm2):
    assert len(set(WORDS)) == len(WORDS) >= 200
    assert all(w.startswith(" ") and w[1:].isalpha() and w[1:].islower() for w in WORDS)
    assert [len(smollm2.encode(w)) for w in WORDS] == [1] * len(WORDS)


def test_every_id_decodes_to_its_word_the_same_each_time(text):
    n = len(WORDS)
    assert text.decode([0, 1, n, n + 1, LLAMA_VOCAB - 1]) == (
        " the of the of" + WORDS[(LLAMA_VOCAB - 1) % n])
    assert text.decode([7]) == WORDS[7] and text.decode([7], skip_special_tokens=False) == WORDS[7]
    ids = random.Random(0).choices(range(LLAMA_VOCAB), k=300)
    assert text.decode(ids) == text.decode(ids[:123]) + text.decode(ids[123:])
    assert all(text.decode([t]).strip() for t in ids)


def test_a_client_recounts_one_token_per_output_token(text, smollm2):
    """The round trip a benchmark client makes: decode the output, count it with SmolLM2."""
    for seed, length in ((1, 1), (2, 17), (3, 512)):
        ids = random.Random(seed).choices(range(LLAMA_VOCAB), k=length)
        assert len(smollm2.encode(text.decode(ids))) == length


def test_prompts_and_chats_go_through_smollm2(text, smollm2):
    prompt = "The capital of France is"
    assert text.encode(prompt) == smollm2.encode(prompt) == [504, 3575, 282, 4649, 314]
    messages = [{"role": "user", "content": "hi"}]
    assert text.encode_chat(messages) == smollm2.encode_chat(messages)
    assert smollm2.tokenizer.decode(text.encode_chat(messages)).endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_stop_strings_match_across_words(text):
    ids = [WORDS.index(" of"), WORDS.index(" and"), WORDS.index(" to"), WORDS.index(" in")]
    stream = TextStream(text, stop=["d to"])
    deltas = [stream.add(t)[0] for t in ids]
    assert stream.stopped and "".join(deltas) == " of an" and stream.num_tokens == 3


def test_a_vocabulary_smaller_than_the_prompt_tokenizers_is_refused(smollm2):
    with pytest.raises(ValueError, match=r"vocabulary \(1000 tokens\) is smaller than .*49152"):
        EmulatedText(smollm2, 1000)


def test_serve_picks_the_text_from_its_configuration():
    emulated = serving_text(ModelConfig(LLAMA, "bfloat16"), ("emu:0", "emu:1"))
    assert isinstance(emulated, EmulatedText)
    assert emulated.vocab_size == load_geometry(ModelConfig(LLAMA)).vocab_size == LLAMA_VOCAB
    assert isinstance(serving_text(ModelConfig("tiny-random-llama"), ("cpu:0",)), ByteText)
    real = serving_text(ModelConfig("smollm2-135m"), ("emu:0",))  # a real model keeps its own
    assert isinstance(real, HFText) and not isinstance(real, EmulatedText)


def test_without_pdlab_s_cache_the_tokenizer_is_read_from_the_gguf(monkeypatch, tmp_path, smollm2):
    monkeypatch.setenv("PDLAB_CACHE_DIR", str(tmp_path))
    from_gguf = HFText(smollm2_tokenizer())
    sample = "Emulated devices answer in words: the of and."
    assert from_gguf.encode(sample) == smollm2.encode(sample) and len(from_gguf.tokenizer) == 49152
    assert list(tmp_path.iterdir()) == []  # nothing converted or written
