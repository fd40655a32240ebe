from __future__ import annotations

from typing import Any

from wsinfer.engine.detokenizer import IncrementalDetokenizer, held_back


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids]


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_multibyte_characters_split_across_tokens(tokenizer: Any) -> None:
    text = "naïve café 日本語 and 😀🎉 emoji"
    ids = ids_of(tokenizer, text)
    # The byte-level vocabulary really does split these characters across tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = feed(detok, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + detok.flush() == text


def test_emoji_is_emitted_whole(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "Hi 😀")
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [p for p in feed(detok, ids) if p]
    assert pieces[-1].endswith("😀")
    assert "".join(pieces) == "Hi 😀"


def test_leading_spaces_survive(tokenizer: Any) -> None:
    prompt = ids_of(tokenizer, "Say:")
    ids = ids_of(tokenizer, " Hello world,  spaced   out")
    detok = IncrementalDetokenizer(tokenizer, context_ids=prompt)
    assert "".join(feed(detok, ids)) == " Hello world,  spaced   out"


def test_stop_string_spanning_tokens(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "The answer is forty-two, said the computer.")
    detok = IncrementalDetokenizer(tokenizer, stop=("forty-two",))
    out = "".join(feed(detok, ids))
    assert detok.stopped
    assert out == "The answer is "
    assert detok.add(ids[0]) == ""
    assert detok.flush() == ""


def test_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "alpha beta gamma delta")
    detok = IncrementalDetokenizer(tokenizer, stop=("delta", "beta g"))
    assert "".join(feed(detok, ids)) == "alpha "


def test_possible_stop_prefix_is_held_back(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    first = "".join(feed(detok, ids_of(tokenizer, "Hello ST")))
    assert first == "Hello "  # "ST" could begin "STOP"
    rest = "".join(feed(detok, ids_of(tokenizer, "ART now")))
    assert first + rest + detok.flush() == "Hello START now"
    assert not detok.stopped


def test_held_back_text_is_flushed_at_the_end(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=("</answer>",))
    out = "".join(feed(detok, ids_of(tokenizer, "x </ans")))
    assert out == "x "
    assert detok.flush() == "</ans"


def test_held_back_longest_prefix() -> None:
    assert held_back("abc STO", ("STOP",)) == 3
    assert held_back("abc", ("STOP",)) == 0
    assert held_back("xx a", ("ab", "a b")) == 1


def test_replay_rebuilds_identical_state(tokenizer: Any) -> None:
    ids = ids_of(tokenizer, "Résumé: 😀 naïve END tail, more words here")
    stop = ("END t",)
    whole = IncrementalDetokenizer(tokenizer, context_ids=[1, 2], stop=stop)
    pieces = feed(whole, ids)
    for k in range(len(ids)):
        rebuilt = IncrementalDetokenizer(tokenizer, context_ids=[1, 2], stop=stop)
        replayed = "".join(feed(rebuilt, ids[:k]))
        assert replayed == "".join(pieces[:k])
        assert feed(rebuilt, ids[k:]) == pieces[k:]
