from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from wsinfer.engine.detokenizer import (
    ByteDetokenizer,
    Detokenizer,
    Detokenizers,
    IncrementalDetokenizer,
    StopStrings,
    TokenPieces,
)
from wsinfer.engine.logprobs import TokenBytes

Make = Callable[..., Detokenizer]


@pytest.fixture(params=["window", "bytes"])
def make(request: pytest.FixtureRequest, tokenizer: Any) -> Make:
    """Each test runs through both decoders: the tokenizer's window and the byte table."""
    if request.param == "window":
        return lambda context_ids=None, stop=(): IncrementalDetokenizer(
            tokenizer, context_ids, stop
        )
    pieces = TokenPieces(tokenizer)
    return lambda context_ids=None, stop=(): ByteDetokenizer(pieces, stop)


def feed(detok: Detokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids]


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_multibyte_characters_split_across_tokens(tokenizer: Any, make: Make) -> None:
    text = "naïve café 日本語 and 😀🎉 emoji"
    ids = ids_of(tokenizer, text)
    # The byte-level vocabulary really does split these characters across tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = make()
    pieces = feed(detok, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + detok.flush() == text


def test_emoji_is_emitted_whole(tokenizer: Any, make: Make) -> None:
    ids = ids_of(tokenizer, "Hi 😀")
    detok = make()
    pieces = [p for p in feed(detok, ids) if p]
    assert pieces[-1].endswith("😀")
    assert "".join(pieces) == "Hi 😀"


def test_leading_spaces_survive(tokenizer: Any, make: Make) -> None:
    prompt = ids_of(tokenizer, "Say:")
    ids = ids_of(tokenizer, " Hello world,  spaced   out")
    detok = make(context_ids=prompt)
    assert "".join(feed(detok, ids)) == " Hello world,  spaced   out"


def test_stop_string_spanning_tokens(tokenizer: Any, make: Make) -> None:
    ids = ids_of(tokenizer, "The answer is forty-two, said the computer.")
    detok = make(stop=("forty-two",))
    out = "".join(feed(detok, ids))
    assert detok.stopped
    assert out == "The answer is "
    assert detok.add(ids[0]) == ""
    assert detok.flush() == ""


def test_earliest_of_several_stop_strings_wins(tokenizer: Any, make: Make) -> None:
    ids = ids_of(tokenizer, "alpha beta gamma delta")
    detok = make(stop=("delta", "beta g"))
    assert "".join(feed(detok, ids)) == "alpha "


def test_possible_stop_prefix_is_held_back(tokenizer: Any, make: Make) -> None:
    detok = make(stop=("STOP",))
    first = "".join(feed(detok, ids_of(tokenizer, "Hello ST")))
    assert first == "Hello "  # "ST" could begin "STOP"
    rest = "".join(feed(detok, ids_of(tokenizer, "ART now")))
    assert first + rest + detok.flush() == "Hello START now"
    assert not detok.stopped


def test_held_back_text_is_flushed_at_the_end(tokenizer: Any, make: Make) -> None:
    detok = make(stop=("</answer>",))
    out = "".join(feed(detok, ids_of(tokenizer, "x </ans")))
    assert out == "x "
    assert detok.flush() == "</ans"


def test_held_back_longest_prefix() -> None:
    assert StopStrings(("STOP",)).held_back("abc STO") == 3
    assert StopStrings(("STOP",)).held_back("abc") == 0
    assert StopStrings(("STOP",)).held_back("") == 0
    assert StopStrings(("ab", "a b")).held_back("xx a") == 1
    assert StopStrings(("ab", "a b")).held_back("xx a ") == 2
    assert StopStrings(("xyz", "yzw")).held_back("..xyz") == 2  # "yz" begins "yzw"


def test_replay_rebuilds_identical_state(tokenizer: Any, make: Make) -> None:
    ids = ids_of(tokenizer, "Résumé: 😀 naïve END tail, more words here")
    stop = ("END t",)
    whole = make(context_ids=[1, 2], stop=stop)
    pieces = feed(whole, ids)
    for k in range(len(ids)):
        rebuilt = make(context_ids=[1, 2], stop=stop)
        replayed = "".join(feed(rebuilt, ids[:k]))
        assert replayed == "".join(pieces[:k])
        assert feed(rebuilt, ids[k:]) == pieces[k:]


TEXTS = [
    "naïve café 日本語 and 😀🎉 emoji",
    "def f(x):\n    return x ** 2  # squared\n\n",
    "  leading spaces,\ttabs\tand trailing   ",
    "Ünïcödé ẞ ﬁ Ω ≈ √ ∞ — “quotes” ‘single’ … 한국어 عربى",
    "<|im_start|>user\nhi<|im_end|>",
]


def test_byte_decoder_emits_what_the_window_emits(tokenizer: Any) -> None:
    """Token for token, the byte table hands out the same text as the tokenizer's
    own decode of a window: over real texts, and stop strings cut where they begin."""
    pieces = TokenPieces(tokenizer)
    for text in TEXTS:
        ids = ids_of(tokenizer, text)
        for stop in [(), ("é 日",), ("\n",), (text[len(text) // 2 : len(text) // 2 + 2],)]:
            window = IncrementalDetokenizer(tokenizer, ids[:3], stop)
            byte = ByteDetokenizer(pieces, stop)
            assert feed(byte, ids) == feed(window, ids), (text, stop)
            assert byte.flush() == window.flush()
            assert (byte.text, byte.emitted, byte.stopped) == (
                window.text,
                window.emitted,
                window.stopped,
            )


def test_byte_decoder_matches_the_window_on_any_ids(tokenizer: Any) -> None:
    """Any vocabulary ids in any order, half of them tokens holding non-ASCII bytes
    (split characters, invalid sequences): the same deltas as the window decoder,
    and the whole text the tokenizer's lossy decode of them all."""
    pieces = TokenPieces(tokenizer)
    rng = random.Random(1)
    wide = [i for i in range(len(tokenizer)) if any(b >= 0x80 for b in pieces(i))]
    assert len(wide) > 100
    for _ in range(300):
        ids = [rng.choice(wide) if rng.random() < 0.5 else rng.randrange(len(tokenizer))]
        ids += [rng.choice(wide) if rng.random() < 0.5 else rng.randrange(len(tokenizer))
                for _ in range(59)]  # fmt: skip
        window = IncrementalDetokenizer(tokenizer, [1, 2, 3], ("ab",))
        byte = ByteDetokenizer(pieces, ("ab",))
        assert feed(byte, ids) + [byte.flush()] == feed(window, ids) + [window.flush()]
        whole = ByteDetokenizer(pieces)
        text = "".join(feed(whole, ids)) + whole.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_add_no_text(tokenizer: Any) -> None:
    detok = ByteDetokenizer(TokenPieces(tokenizer))
    assert feed(detok, list(tokenizer.all_special_ids)) == [""] * len(tokenizer.all_special_ids)


def test_the_byte_decoder_is_chosen_only_where_it_agrees(tokenizer: Any) -> None:
    assert Detokenizers(tokenizer).byte_level
    assert isinstance(Detokenizers(tokenizer).new([1, 2], ()), ByteDetokenizer)

    class CleaningUp:
        """A byte-level vocabulary whose decode moves spaces before punctuation."""

        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer, name)

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            return str(tokenizer.decode(ids, **kwargs)).replace(" ,", ",")

    chosen = Detokenizers(CleaningUp())
    assert not chosen.byte_level
    assert isinstance(chosen.new([1, 2], ()), IncrementalDetokenizer)


def test_the_byte_table_reads_the_cores_token_bytes(tokenizer: Any) -> None:
    """One memo of a token's bytes serves logprobs and detokenizing alike."""
    token_bytes = TokenBytes(tokenizer)
    chosen = Detokenizers(tokenizer, token_bytes)
    assert chosen.pieces is not None and chosen.pieces.token_bytes is token_bytes
