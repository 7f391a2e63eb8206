from chatd.engine.text_stream import TextStream


def stream_all(tokenizer, text: str, stop=()) -> tuple[list[str], TextStream]:
    stream = TextStream(tokenizer, stop)
    pieces = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        pieces.append(stream.push(token_id))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return [p for p in pieces if p], stream


def test_streamed_pieces_add_up_to_the_decoded_text(tiny):
    text = "Héllo wörld — ünïcode 日本語 and emoji 🎉 done."
    pieces, stream = stream_all(tiny.tokenizer, text)
    assert "".join(pieces) == stream.text == text
    assert len(pieces) > 5
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_ends_the_text_before_it(tiny):
    pieces, stream = stream_all(tiny.tokenizer, "Your ticket is 42. END of message and more", stop=["END"])
    assert stream.stopped
    assert "".join(pieces) == stream.text == "Your ticket is 42. "


def test_text_that_only_looks_like_a_stop_string_is_released(tiny):
    pieces, stream = stream_all(tiny.tokenizer, "The ENDPOINT is down", stop=["ENDX"])
    assert not stream.stopped
    assert "".join(pieces) == "The ENDPOINT is down"
