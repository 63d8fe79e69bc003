"""TextStream: incremental detokenization with stop strings matched across token boundaries,
incomplete UTF-8 held back, and the exact token count of a stopped completion."""

from __future__ import annotations

from server.text import ByteText, TextStream


class WordText:
    """A tokenizer of whole pieces (several characters per token), to split stop strings."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)


def run(stream: TextStream, ids: list[int]) -> tuple[list[str], bool]:
    deltas, stopped = [], False
    for t in ids:
        delta, stopped = stream.add(t)
        deltas.append(delta)
        if stopped:
            break
    deltas.append(stream.finish())
    return deltas, stopped


def test_stop_string_spanning_two_tokens_ends_the_text_before_it():
    text = WordText(["Hel", "lo wo", "rld", "!"])
    stream = TextStream(text, stop=["o w"])
    deltas, stopped = run(stream, [0, 1, 2, 3])
    assert stopped and "".join(deltas) == "Hell"
    assert stream.num_tokens == 2  # the token that completed the stop string counts


def test_text_that_may_start_a_stop_string_is_held_back_then_released():
    text = WordText(["ab", "c", "d"])
    stream = TextStream(text, stop=["cx"])
    deltas, stopped = run(stream, [0, 1, 2])
    assert not stopped
    assert deltas == ["a", "b", "c", "d"]  # one character held back per step, all out at the end


def test_the_earliest_of_several_stop_strings_wins():
    stream = TextStream(WordText(["xyz", "abc"]), stop=["bc", "yz"])
    deltas, stopped = run(stream, [0, 1])
    assert stopped and "".join(deltas) == "x" and stream.num_tokens == 1


def test_a_utf8_character_split_over_byte_tokens_comes_out_whole():
    stream = TextStream(ByteText())
    data = "é€".encode()  # C3 A9, E2 82 AC
    deltas, _ = run(stream, list(data))
    assert deltas == ["", "é", "", "", "€", ""]


def test_without_stop_strings_the_deltas_join_to_the_decoded_output():
    ids = [104, 0xFF, 105, 0xC3]  # an invalid byte and a truncated character at the end
    deltas, stopped = run(TextStream(ByteText()), ids)
    assert not stopped and "".join(deltas) == ByteText().decode(ids) == "h\ufffdi\ufffd"


def test_byte_text_chat_template_is_the_documented_one():
    ids = ByteText().encode_chat([{"role": "user", "content": "hi"}])
    assert bytes(ids).decode() == "<|user|>\nhi\n<|assistant|>\n"


class LeadingSpaceText:
    """SentencePiece-like: a piece starting with "▁" renders as a space, except at the start
    of what is decoded (so decoding a window differs from decoding the whole output)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces, self.calls = pieces, []

    def decode(self, ids) -> str:
        self.calls.append(len(ids))
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_incremental_decoding_equals_the_whole_decode_and_reads_a_short_window():
    text = LeadingSpaceText(["▁the", "▁cat", "s", "▁sat", "!"])
    ids = [0, 1, 2, 3, 4] * 200  # 1,000 tokens
    deltas, _ = run(TextStream(text), ids)
    assert "".join(deltas) == text.decode(ids)
    assert max(text.calls[:-1]) <= 2  # each add decodes a window of <= 2 tokens, not all


def test_incremental_decoding_of_bytes_with_split_and_invalid_characters():
    data = list("aé€b".encode()) + [0xFF, 0xC3] + list("ok€".encode())
    deltas, _ = run(TextStream(ByteText()), data)
    assert "".join(deltas) == ByteText().decode(data)


def test_include_stop_str_ends_the_text_right_after_the_stop_string():
    stream = TextStream(WordText(["Hel", "lo wo", "rld", "!"]), stop=["o w"], include_stop_str=True)
    deltas, stopped = run(stream, [0, 1, 2, 3])
    assert stopped and "".join(deltas) == "Hello w" and stream.num_tokens == 2


def test_special_tokens_are_skipped_unless_asked_for():
    """SmolLM2's tokenizer (cached, no download): EOS ``<|im_end|>`` (id 2) is left out of
    the text by default and kept with ``skip_special_tokens=False`` (vLLM's option)."""
    from engine.config import ModelConfig
    from engine.model import load_tokenizer
    from server.text import HFText

    text = HFText(load_tokenizer(ModelConfig("smollm2-135m")))
    ids = text.encode("hello world") + [2]
    for skip, want in ((True, "hello world"), (False, "hello world<|im_end|>")):
        deltas, _ = run(TextStream(text, skip_special_tokens=skip), ids)
        assert "".join(deltas) == want
