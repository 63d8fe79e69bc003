"""Text for an emulated model (``--devices emu:0-7``), which ships no tokenizer: ``EmulatedText``.

- Output: id ``t`` is ``WORDS[t % len(WORDS)]``, a common word with a leading space, one token
  of SmolLM2's tokenizer and a pre-token of its own in GPT-2-style byte-level BPEs, so a client
  recounting the text with SmolLM2 counts one token per output token. Meaningless text.
- Prompts: text through SmolLM2's tokenizer (``engine.model.smollm2_tokenizer``, no download),
  chats through its chat template: a client sizing prompts with it (vLLM's random dataset,
  ``--tokenizer`` SmolLM2's directory) gets the length it asked for. Token ids pass unchanged."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from server.text import HFText

WORDS = tuple(" " + word for word in """
the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there had one all we can their has been if more when will would
who so no time out up about into than them only other new some could these two may first then
do any like my now over such our man me even most made after also did many before must through
back years where much your way well down should because each just those people how too little
state good very make world still own see men work long get here between both life being under
never day same another know while last might us great old year off come since against go came
right used take three states himself few house use during without again place around however
home small found thought went say part once general high upon school every does got united
left number course war until always away something fact though water less public put think
almost hand enough far took head yet government system better set told nothing night end why
called find going look asked later knew point next program city business give group
""".split())


class EmulatedText:
    """Prompts by ``prompt_text``, output as ``WORDS``. Raises ValueError when ``prompt_text``
    has ids beyond ``vocab_size`` (the emulated model's vocabulary)."""

    def __init__(self, prompt_text: HFText, vocab_size: int) -> None:
        prompt_vocab = len(prompt_text.tokenizer)
        if prompt_vocab > vocab_size:
            raise ValueError(f"the emulated model's vocabulary ({vocab_size} tokens) is smaller "
                             f"than that of {prompt_text.name} ({prompt_vocab}), which "
                             "tokenizes its text prompts")
        self.prompt_text = prompt_text
        self.vocab_size = vocab_size
        self.name = f"emulated: {len(WORDS)} words out, prompts by {prompt_text.name}"

    def encode(self, text: str) -> list[int]:
        return self.prompt_text.encode(text)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        return self.prompt_text.encode_chat(messages)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """One word per id, none special: ``decode(a + b) == decode(a) + decode(b)``."""
        return "".join(WORDS[t % len(WORDS)] for t in token_ids)

