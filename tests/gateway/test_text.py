from gateway.text import ChoiceState, StopMatcher
from gateway.tokenizer import ByteTokenizer
from workers.protocol import StepOutput, TokenLogprob


def feed(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.push(p) for p in pieces[:-1])
    return out + matcher.push(pieces[-1], final=True)


def test_stop_string_split_across_pieces_is_found_and_cut() -> None:
    m = StopMatcher(["END"])
    assert feed(m, ["abc E", "N", "Dxyz"]) == "abc "
    assert m.matched == "END"


def test_text_without_stop_passes_through_whole() -> None:
    m = StopMatcher(["STOP", "##"])
    assert feed(m, ["a#b", "cS", "TO", "x"]) == "a#bcSTOx"
    assert m.matched is None


def test_earliest_of_several_stops_wins() -> None:
    m = StopMatcher(["bb", "a"])
    assert feed(m, ["xxbba"]) == "xx"
    assert m.matched == "bb"


def test_of_overlapping_stops_the_first_to_end_wins_however_the_text_is_split() -> None:
    """A stream sees the text a token at a time, a whole response's decode may gather several tokens in one
    output: the match must not depend on it. "bc" ends before "abcd" does (it used to lose to it when both
    came in one piece, as the earlier start); of two ending together the longer wins."""
    for stops, text, want, matched in [(["bc", "abcd"], "xabcdy", "xa", "bc"), (["cd", "abcd"], "xabcdy", "x", "abcd"),
                                       (["abcd", "cd"], "xabcdy", "x", "abcd"), (["b", "zz"], "zzb", "", "zz")]:
        for cuts in range(1 << (len(text) - 1)):  # every split of the text into pieces
            pieces, start = [], 0
            for i in range(1, len(text)):
                if cuts >> (i - 1) & 1:
                    pieces.append(text[start:i])
                    start = i
            pieces.append(text[start:])
            m = StopMatcher(stops)
            assert (feed(m, pieces), m.matched) == (want, matched), (stops, pieces)


def test_min_tokens_ending_inside_a_character_protects_the_same_text_however_grouped() -> None:
    """The text of the first ``min_tokens`` tokens is decoded a token at a time, as the worker's watch does:
    SmolLM2's decoder, given ids that end inside a character (a byte-level emoji split over tokens), holds
    back the whole text before it, which then was searched for stop strings as if it came after them (a
    whole answer, its tokens gathered, stopped earlier than the stream and the worker did)."""
    import random

    from gateway.hf_tokenizer import HFTokenizer
    from workers.engines.llama.gguf_convert import default_model_dir
    from workers.stop_strings import StopWatch

    tok = HFTokenizer.from_dir(default_model_dir())
    ids = tok.encode("Hello \U0001f355\U0001f355 world. The end.")
    for min_tokens in range(1, 8):
        watch = StopWatch(tok, ["e"], exempt=min_tokens)
        at = next((i + 1 for i, t in enumerate(ids) if watch.push(t)), len(ids))
        whole = tok.decode(ids[:at])
        want = whole[:whole.rfind("e")] if at < len(ids) or whole.endswith("e") else whole
        for seed in range(20):
            rng, state, i = random.Random(seed), ChoiceState(0, tok, ["e"], False, min_tokens=min_tokens), 0
            while state.finish_reason is None:
                end = min(i + rng.randint(1, 4), at)
                state.accept(StepOutput(1, ids[i:end], finish_reason="length" if end == len(ids) else None))
                i = end
            assert state.text == want, (min_tokens, seed, state.text, want)


def test_choice_state_streams_utf8_safely_and_finishes_on_stop() -> None:
    tok = ByteTokenizer()
    state = ChoiceState(0, tok, ["!"], want_logprobs=True)
    euro = list("€".encode())  # three bytes, split over two steps
    text1, _ = state.accept(StepOutput(1, [euro[0], euro[1]], logprobs=[-0.1, -0.2]))
    assert text1 == ""
    text2, entries = state.accept(StepOutput(1, [euro[2], ord("a")], logprobs=[-0.3, -0.4],
                                             top_logprobs=[[TokenLogprob(euro[2], -0.3)], [TokenLogprob(97, -0.4)]]))
    assert text2 == "€a" and entries[1]["token"] == "a" and entries[1]["top_logprobs"][0]["logprob"] == -0.4
    text3, _ = state.accept(StepOutput(1, [ord("!"), ord("z")]))
    assert text3 == "" and state.finish_reason == "stop" and state.text == "€a"


def test_length_finish_flushes_the_decoder() -> None:
    state = ChoiceState(0, ByteTokenizer(), [], want_logprobs=False)
    text, _ = state.accept(StepOutput(1, [ord("o"), ord("k")], finish_reason="length"))
    assert text == "ok" and state.finish_reason == "length"


def test_byte_decoder_over_any_split_equals_decoding_the_whole() -> None:
    """Incremental detokenization: whatever the split of the ids, the text is the whole decode's,
    invalid bytes and a character cut off at the end included (replaced, as the whole decode does)."""
    import random

    tok = ByteTokenizer()
    ids = [*"a€b𝄞ö".encode(), 0xFF, ord("x"), 0xE2, 0x82, ord("y"), tok.EOS, *"é".encode()[:1]]
    rng = random.Random(7)
    for _ in range(300):
        decoder, text, i = tok.decoder(), "", 0
        while i < len(ids):
            step = rng.randint(1, 4)
            text += decoder.push(ids[i:i + step])
            i += step
        assert text + decoder.flush() == tok.decode(ids)


def test_a_stop_string_may_start_within_min_tokens_and_end_after_them() -> None:
    """vLLM searches each step's new text with the end of the text before it: a stop string that starts in
    the first ``min_tokens`` tokens' text and ends after them stops the request (cut where it starts), one
    wholly inside that text does not. The gateway's choice (however the outputs are grouped) and the
    worker's watch agree."""
    import random

    from workers.stop_strings import StopWatch

    tok = ByteTokenizer()
    ids = list(b"a. b. c")
    for stops, min_tokens, want_text, want_at in [([". b"], 2, "a", 4),  # starts in "a.", ends in "b"
                                                  (["a."], 2, "a. b. c", None),  # wholly within "a.": never
                                                  (["a.", ". c"], 2, "a. b", 7),
                                                  ([". b", "."], 3, "a", 4)]:  # (the first to end wins)
        watch = StopWatch(tok, stops, exempt=min_tokens)
        at = next((i + 1 for i, t in enumerate(ids) if watch.push(t)), None)
        assert at == want_at, (stops, min_tokens, at)
        for seed in range(20):
            state, i, rng = ChoiceState(0, tok, stops, False, min_tokens=min_tokens), 0, random.Random(seed)
            sent = ""
            while state.finish_reason is None:
                end = min(i + rng.randint(1, 3), len(ids) if want_at is None else want_at)
                text, _ = state.accept(StepOutput(1, ids[i:end], finish_reason="length" if end == len(ids) else None))
                sent, i = sent + text, end
            assert sent == state.text == want_text, (stops, min_tokens, seed, sent)
            assert state.finish_reason == ("length" if want_at is None else "stop")


def test_stop_strings_count_only_after_min_tokens_on_both_sides() -> None:
    """As vLLM: no stop string ends in the text of the first ``min_tokens`` tokens (a stop string there ended
    the request at once, ``min_tokens`` or not); the gateway's choice and the worker's watch agree token for
    token, however the outputs are grouped, a migrated request's history included."""
    import random

    from workers.stop_strings import StopWatch

    tok = ByteTokenizer()
    ids = list(b"a. b. c.. done.")
    for min_tokens, want_text, want_at in [(0, "a", 2), (2, "a. b", 5), (5, "a. b. c", 8),
                                           (14, "a. b. c.. done", 15), (20, "a. b. c.. done.", None)]:
        watch = StopWatch(tok, ["."], exempt=min_tokens)
        at = next((i + 1 for i, t in enumerate(ids) if watch.push(t)), None)
        assert at == want_at, (min_tokens, at)
        for _ in range(20):  # the gateway, the same outputs in random groups
            state, i, rng = ChoiceState(0, tok, ["."], False, min_tokens=min_tokens), 0, random.Random(min_tokens)
            while state.finish_reason is None:
                step = rng.randint(1, 3)
                end = min(i + step, len(ids) if want_at is None else want_at)
                state.accept(StepOutput(1, ids[i:end], finish_reason="length" if end == len(ids) else None))
                i = end
            assert state.text == want_text and state.finish_reason == ("length" if want_at is None else "stop")
        # a migrated request: 4 outputs streamed before, the last 3 of them its history (the scheduler's
        # exempt: min_tokens - (output_offset - len(history))); a stop within those 4 would have ended it there
        watch = StopWatch(tok, ["."], ids[1:4], ids[:1], exempt=min_tokens - 1)
        at = next((i + 5 for i, t in enumerate(ids[4:]) if watch.push(t)), None)
        assert at == (want_at if want_at is None or want_at > 4 else 5), (min_tokens, at)


def test_the_stop_token_that_ends_a_choice_is_not_in_its_text() -> None:
    """vLLM and SGLang leave the text of the token that stopped a choice (a ``stop_token_ids`` one, EOS) out
    of the answer, unless asked to keep it (``include_stop_str_in_output``, ``no_stop_trim``); the token
    itself stays in the ids (usage counts it)."""
    tok = ByteTokenizer()
    stop_tokens = ([ord(".")], tok.eos_token_ids)
    for keep, want in ((False, "ok"), (True, "ok.")):
        state = ChoiceState(0, tok, [], False, keep_stop=keep, stop_tokens=stop_tokens)
        state.accept(StepOutput(1, [ord("o")]))
        state.accept(StepOutput(1, [ord("k"), ord(".")], finish_reason="stop"))
        assert state.text == want and state.token_ids == [ord("o"), ord("k"), ord(".")], keep
    # Only a final "stop" output's last token: one that ends by length, or a stop id met earlier, is text.
    state = ChoiceState(0, tok, [], False, stop_tokens=stop_tokens)
    state.accept(StepOutput(1, [ord("."), ord("a")]))
    state.accept(StepOutput(1, [ord("b"), ord(".")], finish_reason="length"))
    assert state.text == ".ab."
    # A stop token that ends a multi-byte character's bytes: the bytes before it are still flushed.
    state = ChoiceState(0, tok, [], False, stop_tokens=stop_tokens)
    state.accept(StepOutput(1, [*"é".encode()[:1]]))
    state.accept(StepOutput(1, [ord(".")], finish_reason="stop"))
    assert state.text == "\ufffd" and state.finish_reason == "stop"
