"""Text <-> token ids for the HTTP front end (no torch, no model).

- ``HFText`` wraps a model's Hugging Face tokenizer: completions encode the prompt as the
  tokenizer does by default, chat requests go through the model's chat template.
- ``ByteText`` serves the tiny test models, which have no tokenizer (vocabulary 256): one
  token per UTF-8 byte, and a fixed plain chat template (``BYTE_CHAT_TEMPLATE``).
- ``TextStream`` turns output token ids into text deltas, decoding incrementally (vLLM's
  ``detokenize_incrementally``: linear, not quadratic, in the output). It holds back an
  incomplete UTF-8 character and the last ``len(longest stop) - 1`` characters, matches stop
  strings across tokens and ends the text before one (OpenAI), or after it with vLLM's
  ``include_stop_str_in_output``. Special tokens are left out unless
  ``skip_special_tokens=False``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

BYTE_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"  # per message; then "<|assistant|>\n"


class Text(Protocol):
    """A model's text: ``ByteText``, ``HFText``, ``server.emulated_text.EmulatedText``."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteText:
    """One token per UTF-8 byte (token id = byte value); for models without a tokenizer."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        text = "".join(BYTE_CHAT_TEMPLATE.format(role=m["role"], content=m["content"])
                       for m in messages)
        return self.encode(text + "<|assistant|>\n")

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The bytes as UTF-8 (invalid bytes as U+FFFD); there are no special tokens."""
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFText:
    """A Hugging Face tokenizer: prompts, chat template, decoding (special tokens skipped)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.name = getattr(tokenizer, "name_or_path", "hf")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template([dict(m) for m in messages],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        if isinstance(ids, Mapping):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``; special tokens left out unless ``skip_special_tokens``."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)


class TextStream:
    """Output token ids in, text deltas out, with stop strings matched across tokens.

    ``include_stop_str``: vLLM's ``include_stop_str_in_output``. ``add(token_id)`` returns
    ``(delta, stopped)``: the text that can be shown now, and whether a stop string appeared (the
    caller then aborts the request). ``finish()`` returns the held-back rest. ``num_tokens``
    counts tokens up to the one that completed the stop string (``usage``'s completion tokens)."""

    def __init__(self, text: Text, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, include_stop_str: bool = False) -> None:
        self.text = text
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str = include_stop_str
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._ids: list[int] = []
        # Incremental decoding: the text of ids[:_read] is _stable; ids[_prefix:_read] are
        # decoded again with each new token so a tokenizer that renders a token by its
        # neighbours (SentencePiece's leading space) renders it as in the whole output.
        self._prefix = self._read = 0
        self._stable = ""
        self._emitted = 0  # characters of the decoded output already returned
        self.stopped = False
        self.full_text = ""

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def add(self, token_id: int) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self._ids.append(token_id)
        decoded = self._decode_new()
        if self.stop:
            # a stop string can only be new if it ends in the text not yet matched against
            start = max(0, self._emitted - self._hold)
            hits = [(i, len(s)) for i, s in ((decoded.find(s, start), s) for s in self.stop)
                    if i >= 0]
            if hits:
                self.stopped = True
                at, length = min(hits)  # the earliest; of two there, the shorter
                self.full_text = decoded[:at + length if self.include_stop_str else at]
                return self._take(len(self.full_text)), True
        self.full_text = decoded
        end = len(decoded) - self._hold
        if decoded.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its rest
            end = min(end, len(decoded) - 1)
        return self._take(end), False

    def _decode_new(self) -> str:
        """The decoded output so far (``text.decode(all ids)``), decoding only ``ids[_prefix:]``."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        window_text = self._decode(self._ids[self._prefix:])
        tail = window_text[len(prefix_text):]
        if len(window_text) > len(prefix_text) and not window_text.endswith("\ufffd"):
            self._stable += tail
            self._prefix, self._read = self._read, len(self._ids)
            return self._stable
        return self._stable + tail

    def _decode(self, ids: list[int]) -> str:
        if self.skip_special_tokens:  # the default: any text with decode(ids) will do
            return self.text.decode(ids)
        return self.text.decode(ids, skip_special_tokens=False)

    def finish(self) -> str:
        """The text still held back (call once, when the request has ended)."""
        return self._take(len(self.full_text))

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self.full_text[self._emitted:end]
        self._emitted = end
        return delta
