"""The engine thread: all model work happens here, one turn at a time, off the event loop.

The data path of a turn, top to bottom: render the prompt, look up the session's cache, prefill
only the tokens the cache does not cover, stream the reply token by token, write the cache back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from cache_store import CacheEntry, CacheLookup, CacheManager
from chatd.model_loader import LoadedModel
from chatd.prompt import PromptRenderer
from chatd.sampling import TokenSampler
from chatd.text_stream import TextStream
from chatd.turn import FinishReason, TokenText, Turn, TurnFailed, TurnResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _DropSession:
    session_id: str


_STOP = object()


class Engine:
    """Owns the model and the session caches. Talk to it only through `submit`,
    `drop_session` and `Turn.cancel`; all three are safe from any thread."""

    def __init__(self, load: Callable[[], LoadedModel], session_cache: bool = True):
        self._load = load
        self.cache = CacheManager(enabled=session_cache)
        self._commands: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="chatd-engine", daemon=True)
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.loaded: LoadedModel | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(_STOP)
        self._thread.join()

    def submit(self, turn: Turn) -> None:
        self._commands.put(turn)

    def drop_session(self, session_id: str) -> None:
        """Free a session's cache once the turns queued before this call have finished."""
        self._commands.put(_DropSession(session_id))

    def _run(self) -> None:
        try:
            self.loaded = self._load()
            self._renderer = PromptRenderer(self.loaded.tokenizer)
        except BaseException as error:  # reported to whoever waits for `ready`
            log.exception("loading the model failed")
            self.load_error = error
            self.ready.set()
            return
        self.ready.set()
        while (command := self._commands.get()) is not _STOP:
            if isinstance(command, _DropSession):
                self.cache.drop(command.session_id)
            elif isinstance(command, Turn):
                self._serve(command)

    def _serve(self, turn: Turn) -> None:
        try:
            with torch.inference_mode():
                self.run_turn(turn)
        except Exception as error:
            # The turn owned its cache entry since the lookup; dropping it here leaves no half-written cache.
            log.exception("turn %s of session %s failed", turn.turn_id, turn.session_id)
            turn.emit(TurnFailed("internal", f"the turn failed: {type(error).__name__}"))

    def run_turn(self, turn: Turn) -> None:
        started = time.perf_counter()
        loaded = self.loaded
        if turn.cancelled.is_set():
            turn.emit(TurnResult.cancelled_before_start(queue_ms=(started - turn.received_at) * 1000.0))
            return
        prompt_ids = self._renderer.render(turn.messages)
        if len(prompt_ids) >= loaded.max_context:
            turn.emit(TurnFailed("too_long", f"the conversation is {len(prompt_ids)} tokens; "
                                             f"the model's context is {loaded.max_context}"))
            return
        lookup = self.cache.lookup(turn.session_id, prompt_ids)
        entry = lookup.entry or CacheEntry(DynamicCache(config=loaded.model.config))
        sampler = TokenSampler(turn.params)
        stream = TextStream(loaded.tokenizer, turn.params.stop)
        max_new_tokens = min(turn.params.max_new_tokens, loaded.max_context - len(prompt_ids))
        generated: list[int] = []
        finish: FinishReason = "length"

        token = sampler.next_token(self._forward(entry, prompt_ids[lookup.cached_tokens:]))
        first_token_at = time.perf_counter()
        while True:
            if token in loaded.stop_token_ids:
                finish = "stop"
                break
            generated.append(token)
            if text := stream.push(token):
                turn.emit(TokenText(text))
            if stream.stopped:
                finish = "stop"
                break
            if len(generated) >= max_new_tokens:
                break
            if turn.cancelled.is_set():
                finish = "cancelled"
                break
            token = sampler.next_token(self._forward(entry, [token]))
        if text := stream.finish():
            turn.emit(TokenText(text))
        finished_at = time.perf_counter()

        if finish == "cancelled":
            entry.crop(lookup.cached_tokens)  # the turn is not recorded: roll its tokens back
        self.cache.store(turn.session_id, entry)
        turn.emit(self._result(turn, lookup, finish, stream.text, prompt_ids, generated,
                               started, first_token_at, finished_at))

    def _forward(self, entry: CacheEntry, token_ids: list[int]) -> torch.Tensor:
        """Append `token_ids` to the session's cache; return the logits after the last of them."""
        loaded = self.loaded
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=loaded.device)
        output = loaded.model(input_ids=input_ids, cache=entry.cache, use_cache=True, logits_to_keep=1)
        entry.extend(token_ids)
        return output.logits[0, -1]

    @staticmethod
    def _result(turn: Turn, lookup: CacheLookup, finish: FinishReason, content: str,
                prompt_ids: list[int], generated: list[int], started: float,
                first_token_at: float, finished_at: float) -> TurnResult:
        decode_s = finished_at - first_token_at
        ms = 1000.0
        return TurnResult(
            finish_reason=finish,
            content=content,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(generated),
            cached_tokens=lookup.cached_tokens,
            cache_source=lookup.source,
            miss_reason=lookup.miss_reason,
            token_ids=generated,
            timings={
                "queue_ms": (started - turn.received_at) * ms,
                "ttft_ms": (first_token_at - turn.received_at) * ms,
                "prefill_ms": (first_token_at - started) * ms,
                "decode_ms": decode_s * ms,
                "total_ms": (finished_at - turn.received_at) * ms,
                "tokens_per_s": (len(generated) - 1) / decode_s if len(generated) > 1 and decode_s > 0 else 0.0,
            },
        )
