"""chat.resume is atomic: the stream switches to the new connection first and then replays from its
cursor, so a turn that publishes while the replay is in progress loses and repeats nothing."""

import asyncio

from chatd.api.websocket.protocol import ChatDelta, ChatDone, Delta, Timings, Usage
from chatd.api.websocket.turn_log import TurnLog
from chatd.engine.sampling import SamplingParams
from chatd.engine.turn import Turn


class Sink:
    """A connection whose sends can be held at one message, the way a slow socket holds them."""

    def __init__(self, hold_at: int | None = None):
        self.received: list = []
        self.hold_at = hold_at
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    async def send(self, message) -> None:
        if self.hold_at is not None and len(self.received) == self.hold_at and not self.release.is_set():
            self.holding.set()
            await self.release.wait()
        self.received.append(message)


def delta(seq: int) -> ChatDelta:
    return ChatDelta(turn_id="t", seq=seq, delta=Delta(content=f"<{seq}>"))


DONE = ChatDone(turn_id="t", finish_reason="stop", content="", usage=Usage(prompt_tokens=1, completion_tokens=6,
                cached_tokens=0), timings=Timings(queue_ms=0, ttft_ms=0, prefill_ms=0, decode_ms=0, total_ms=0,
                                                  tokens_per_s=0), cache={"source": "miss"})


def turn_log(first: Sink) -> TurnLog:
    turn = Turn(turn_id="t", session_id="s", messages=[], params=SamplingParams(), emit=lambda event: None)
    return TurnLog(turn, None, first)


def seqs(messages: list) -> list:
    return [getattr(m, "seq", "done") for m in messages]


async def test_messages_published_during_a_replay_reach_the_new_connection_once_and_in_order():
    dropped, resumed = Sink(), Sink(hold_at=1)  # the replay is held after its first message
    log = turn_log(dropped)
    for seq in range(3):
        await log.publish(delta(seq))
    replay = asyncio.create_task(log.subscribe(resumed, last_seq=0))  # the client saw delta 0
    await resumed.holding.wait()
    for seq in (3, 4):  # the turn goes on while the replay waits on the socket
        await log.publish(delta(seq))
    await log.publish(DONE)
    resumed.release.set()
    await replay
    assert seqs(resumed.received) == [1, 2, 3, 4, "done"]
    assert seqs(dropped.received) == [0, 1, 2], "nothing after the switch goes to the dead socket"


async def test_a_second_resume_during_a_replay_takes_the_stream_from_its_own_cursor():
    first, second, third = Sink(), Sink(hold_at=0), Sink()
    log = turn_log(first)
    for seq in range(4):
        await log.publish(delta(seq))
    held = asyncio.create_task(log.subscribe(second, last_seq=1))
    await second.holding.wait()
    await log.subscribe(third, last_seq=2)  # the client reconnected again, having seen up to 2
    second.release.set()
    await held
    await log.publish(DONE)
    assert seqs(third.received) == [3, "done"]
    assert seqs(second.received) == [2], "only the message already on its way when the stream moved"


async def test_a_resume_of_a_finished_turn_replays_its_end():
    log = turn_log(Sink())
    await log.publish(delta(0))
    await log.publish(DONE)
    late = Sink()
    await log.subscribe(late, last_seq=-1)
    assert seqs(late.received) == [0, "done"]
    again = Sink()
    await log.subscribe(again, last_seq=99)  # a cursor past the end replays nothing
    assert again.received == []
