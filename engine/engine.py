"""The engine API: submit prompts, stream their tokens, cancel them; one scheduler thread behind it.

``Engine.start(config)`` launches the ranks (blocking) and starts the scheduler thread. Callers on
any thread use ``submit`` / ``cancel`` / ``stats``; those only touch the inbox and published
snapshots, never the scheduler, which lives on its own thread.

Every request ends with exactly one final event. When a step fails (the executor is poisoned, or
rank 0's results do not match the step) the engine is poisoned: every open request gets one
``ErrorEvent``, the ranks are shut down, and ``submit`` raises from then on. A request a rank
rejects (one of its own values it cannot serve) ends alone, with an ``ErrorEvent`` marked
``rejected``; the engine serves on.
"""

from __future__ import annotations

import atexit
import dataclasses
import numbers
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

from phalanx.config.replica import ReplicaConfig, SchedulingConfig, Timeouts
from phalanx.engine.prompt_only import prompt_only
from phalanx.engine.stream import RequestStream
from phalanx.executor.errors import ExecutorPoisoned
from phalanx.protocol.messages import Ping
from phalanx.scheduler.events import ErrorEvent, Event, FinishEvent, PromptLogprobsEvent, TokenEvent
from phalanx.scheduler.prefix_cache import PrefixCacheStats
from phalanx.scheduler.requests import GenerationParams, Request, RequestIds
from phalanx.scheduler.scheduler import Scheduler, SchedulerStats
from phalanx.scheduler.step_contract import StepExecutor

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineModelInfo",
    "EngineStats",
    "ErrorEvent",
    "Event",
    "FinishEvent",
    "GenerationParams",
    "PrefixCacheStats",
    "PromptLogprobsEvent",
    "RequestStream",
    "TokenEvent",
]

log = structlog.get_logger("phalanx.engine")

EngineStats = SchedulerStats


# The engine launches one replica: its config is the replica's tree, every default written there.
EngineConfig = ReplicaConfig


@dataclass(frozen=True)
class EngineModelInfo:
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context: int  # max_position_embeddings (or --max-model-len), bounded by what the KV pool holds
    max_position_embeddings: int
    model_name: str
    model_dir: str


class EngineExecutor(StepExecutor, Protocol):
    """What the engine needs beyond the scheduler's part of the executor."""

    model_info: Any
    poison_reason: str | None
    rejected_frames: int

    def interrupt(self, reason: str) -> None: ...

    def shutdown(self) -> bool: ...


def launch(config: EngineConfig) -> EngineExecutor:
    from phalanx.executor.launcher import launch_executor

    return launch_executor(config)


_STOP = object()


class Engine:
    def __init__(
        self,
        executor: EngineExecutor,
        model_dir: str | Path = "",
        idle_ping_interval: float = Timeouts.idle_ping_interval,
        *,
        pipeline: bool = False,
        max_model_len: int = 0,
        prefix_snapshot_interval: int = SchedulingConfig.prefix_snapshot_interval,
    ) -> None:
        self._executor = executor
        self._idle_ping_interval = idle_ping_interval
        info = executor.model_info
        capacity = executor.capacity
        self.model_info = EngineModelInfo(
            vocab_size=info.vocab_size,
            eos_token_ids=tuple(info.eos_token_ids),
            max_context=min(
                max_model_len or info.max_position_embeddings,
                info.max_position_embeddings,
                capacity.kv_pages * capacity.page_size,
            ),
            max_position_embeddings=info.max_position_embeddings,
            model_name=Path(model_dir).name or "model",
            model_dir=str(model_dir),
        )
        self._scheduler = Scheduler(
            executor,
            self.model_info.eos_token_ids,
            pipeline=pipeline,
            prefix_snapshot_interval=prefix_snapshot_interval,
        )
        self._ids = RequestIds()
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._open: dict[int, RequestStream] = {}
        self._closed_reason: str | None = None  # set once: poisoned or shut down
        self.poison_reason: str | None = None
        self._stats = self._scheduler.stats()
        self._thread = threading.Thread(target=self._run, name="phalanx-scheduler", daemon=True)
        # A signal between here and the caller's ``with`` (or any exit that skips shutdown) would
        # leave the ranks to multiprocessing's exit, which waits out their SIGTERM grace.
        atexit.register(self.shutdown)
        self._thread.start()

    @classmethod
    def start(
        cls, config: EngineConfig, launcher: Callable[[EngineConfig], EngineExecutor] = launch
    ) -> Engine:
        """Launch the ranks (blocking until they serve) and start the scheduler thread."""
        executor = launcher(config)
        try:
            return cls(
                executor,
                config.model.model_dir,
                config.timeouts.idle_ping_interval,
                pipeline=config.scheduling.pipeline,
                max_model_len=config.model.max_model_len,
                prefix_snapshot_interval=config.scheduling.prefix_snapshot_interval,
            )
        except BaseException:
            executor.shutdown()
            raise

    # -- caller API -------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: GenerationParams | None = None) -> RequestStream:
        """Queue a request; ``max_tokens`` 0 scores the prompt alone (``engine.prompt_only``)."""
        params = params or GenerationParams()
        prompt = self._validate(prompt_ids, params)
        with self._lock:
            if self._closed_reason is not None:
                raise RuntimeError(self._closed_reason)
            request_id = self._ids.next()
            stream = RequestStream(request_id, self.cancel, self._forget)
            self._open[request_id] = stream
            run, emit = prompt_only(params, stream.push) if params.max_tokens == 0 else (params, stream.push)
            self._inbox.put(Request(request_id, prompt, run, emit, self.model_info.eos_token_ids))
        return stream

    def cancel(self, request_id: int) -> None:
        """Cancel an open request (idempotent); its stream ends with FinishEvent("cancelled")."""
        self._inbox.put(("cancel", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def rejected_frames(self) -> int:
        """Frames from the ranks' side that the coordinator dropped (forged, undecodable, ...)."""
        return self._executor.rejected_frames

    @property
    def closed_reason(self) -> str | None:
        """Why ``submit`` refuses: the engine is stopping, shut down or poisoned; None while open."""
        return self._closed_reason

    def stop_admission(self, reason: str) -> None:
        """Refuse new requests and end every open one now with an ErrorEvent(``reason``), cancelling
        it on the ranks; callable from any thread (a server that is stopping calls it first)."""
        with self._lock:
            open_ids = list(self._open)
        self._close(reason)
        for request_id in open_ids:
            self.cancel(request_id)

    def shutdown(self, grace_s: float | None = None) -> bool:
        """Stop the scheduler thread, end open requests with an error, shut the ranks down
        (idempotent). A step still waiting for the ranks after ``grace_s`` (None: no limit) fails
        at once, which poisons and kills them. True when the shutdown was clean: never poisoned,
        and every rank acknowledged Shutdown."""
        atexit.unregister(self.shutdown)
        self._inbox.put(_STOP)
        self._thread.join(grace_s)
        if self._thread.is_alive():
            self._executor.interrupt(f"the shutdown grace of {grace_s:g} s ran out")
            self._thread.join()
        acknowledged = self._executor.shutdown()
        return acknowledged and self.poison_reason is None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- validation -------------------------------------------------------------------------

    def _validate(self, prompt_ids: list[int], params: GenerationParams) -> list[int]:
        """The prompt as a new list of plain ints, once it and ``params`` are found valid."""
        if not prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.model_info.vocab_size
        prompt = _checked_prompt_ids(prompt_ids, vocab)
        params.validate(vocab, least_max_tokens=0)
        context = self.model_info.max_context
        if len(prompt_ids) >= context:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens is too long: the context holds {context} tokens "
                "including at least one generated token"
            )
        if len(prompt_ids) + params.max_tokens > context:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens plus max_tokens {params.max_tokens} exceeds the "
                f"context of {context} tokens"
            )
        return prompt

    # -- scheduler thread -------------------------------------------------------------------

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._open.pop(request_id, None)

    def _drain(self, block: bool) -> bool:
        """Move inbox items into the scheduler; returns False when asked to stop.

        While idle it pings the ranks now and then, so a rank that died between requests poisons
        the engine (and shows in its health) before the next request is accepted.
        """
        item = None
        if block:
            try:
                item = self._inbox.get(timeout=self._idle_ping_interval)
            except queue.Empty:
                self._executor.collect(self._executor.send(Ping()))
                return True
        while True:
            if item is _STOP:
                return False
            if isinstance(item, Request):
                self._add(item)
            elif item is not None:
                self._scheduler.cancel(item[1])
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request: Request) -> None:
        try:
            self._scheduler.add(request)
        except ValueError as exc:  # refused by the pool: this request ends, nothing else is affected
            request.emit(ErrorEvent(str(exc)))

    def _run(self) -> None:
        try:
            while self._drain(block=not self._scheduler.has_work()):
                self._stats = self._scheduler.stats()
                if self._scheduler.has_work():
                    self._scheduler.step()
                    self._stats = self._scheduler.stats()
        except Exception as exc:  # any failure mid-step leaves rank state unknown: fail-stop
            reason = exc.reason if isinstance(exc, ExecutorPoisoned) else f"{type(exc).__name__}: {exc}"
            self._poison(reason)
            return
        self._close("engine is shut down")

    def _poison(self, reason: str) -> None:
        log.error("engine poisoned", reason=reason)
        self.poison_reason = reason
        self._close(f"engine is poisoned: {reason}")
        # Occupancy drops to nothing; the totals and counters keep their last values.
        self._stats = dataclasses.replace(
            self._stats, running=0, waiting=0, kv_pages_used=0, slots_used=0, last_step_seconds=0.0
        )
        self._executor.shutdown()

    def _close(self, message: str) -> None:
        """Refuse new requests and give every open one its single final error."""
        with self._lock:
            if self._closed_reason is None:
                self._closed_reason = message
            streams = list(self._open.values())
        for stream in streams:
            stream.push(ErrorEvent(message))


def _plain_ints(values: list[int]) -> bool:
    """Whether every value is exactly an ``int`` (what JSON and the tokenizer give; not a bool)."""
    return set(map(type, values)) <= {int}  # a third faster than a generator over 4k ids


def _checked_prompt_ids(prompt_ids: list[int], vocab: int) -> list[int]:
    """A copy of the ids as plain ints, each checked to lie in ``[0, vocab)``. Plain ints are
    checked by their range alone: the per-token check below costs milliseconds on a prompt of
    thousands of tokens, in every request's time to first token."""
    if _plain_ints(prompt_ids) and min(prompt_ids) >= 0 and max(prompt_ids) < vocab:
        return list(prompt_ids)
    for index, token in enumerate(prompt_ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < vocab:
            raise ValueError(
                f"prompt token {token!r} at index {index} is outside the vocabulary [0, {vocab})"
            )
    return [int(token) for token in prompt_ids]
