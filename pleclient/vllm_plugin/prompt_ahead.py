"""Prompt-ahead: a prompt's rows, hinted to ple-server as soon as its tokens are known.

A prompt's n-gram ids depend on its tokens alone, so they are known when the
request reaches vLLM's engine, long before the chunks of a chunked prefill
run. vLLM's scheduler (``vllm.v1.core.sched.scheduler.Scheduler``) runs in the
engine-core process, which has no model; there the plugin computes every PLE
layer's ids with ``pleclient.ngram.NgramHasher`` (the checkpoint's own hash
buffers, tested equal bit for bit to vLLM's ``compute_ngram_ids``), or every
DeepSeek-V4.1 Engram layer's with ``pleclient.engram.EngramHasher`` (bit-equal
to vLLM's ``_hash_ids_kernel``; ``pleclient.families.hasher_for`` picks by
the config), and sends
them to the server as prefetch hints (``PleClient.hint``): the server reads
the rows it does not hold into its row cache, below every lookup, and the
workers' lookups of those rows are then cache hits.

Two stages (``VLLM_PLE_SHM_PROMPT_AHEAD``, both by default):

* ``arrival`` — ``Scheduler.add_request``: the request enters the waiting
  queue; the whole prompt is hinted. The earliest point the engine sees the
  tokens: the time the request waits in the queue is time to read its rows.
* ``scheduled`` — ``Scheduler.schedule``: a request's first chunk is scheduled
  (``scheduled_new_reqs``); the prompt after that chunk is hinted (chunks
  2..n). The workers are looking the first chunk up now; a hint of it would be
  late. This stage catches what the arrival's hints lost: rows dropped by a
  saturated server or evicted while the request waited.

The scheduler never waits for any of it. Both stages only queue the request's
id and its token list (the prompt's own list, not copied) for the
``PromptAhead`` thread; a full queue drops the prompt and counts it. The
thread hashes (numpy, the GIL released in its loops) and hints in prompt
order, ``CHUNK_TOKENS`` at a time over every PLE layer, so the rows needed
first are queued first on the server, and what a full server queue drops is
the far end of the prompt. Ids repeated within a piece are sent once.

The hint session is the engine core's own (``HINT_DEPTH`` slots of
``HINT_CAPACITY`` ids). It is opened at the first prompt, on the socket the
workers use (``VLLM_PLE_SHM_SOCKET``, or the server that serves this
checkpoint: ``discovery``), and checked: every PLE table the hasher names must
be served, with the checkpoint's fingerprint. A missing server, a server that
serves another checkpoint, or a checkpoint whose hashing the hasher cannot
read turns prompt-ahead off for a while (``RETRY_S``) or for good, said once
in the log; lookups never depend on it. A server that went away (stopped,
restarted) is connected to again at the next prompt.

What each stage buys is measured by ``bench/evals/northstar.py`` (paths
``prompt-ahead-arrival`` and ``prompt-ahead``), and the server counts every
hinted row: received, read, already cached, dropped by reason, and the
lookups that hit a hinted row (``pleserver stats``, ``ple_hints_*``).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from pleclient import PleClient
from pleclient.engram import EngramConfigError, EngramHasher
from pleclient.errors import PleError
from pleclient.families import hasher_for
from pleclient.ngram import NgramConfigError, NgramHasher
from pleclient.vllm_plugin import discovery, identity
from pleclient.vllm_plugin.errors import IdentityMismatch, PleBackendError
from pleclient.vllm_plugin.settings import PROMPT_AHEAD_ARRIVAL as ARRIVAL
from pleclient.vllm_plugin.settings import PROMPT_AHEAD_SCHEDULED as SCHEDULED
from pleclient.vllm_plugin.settings import PROMPT_AHEAD_STAGES as STAGES
from pleclient.vllm_plugin.settings import ShmSettings

log = logging.getLogger("pleclient.vllm_plugin")

CHUNK_TOKENS = 2048
"""Tokens hashed and hinted at a time, over every PLE layer, in prompt order
(vLLM's default prefill chunk)."""
QUEUE_PROMPTS = 256
"""Prompts waiting for the thread, at most; more are dropped (counted)."""
HINT_DEPTH = 8
HINT_CAPACITY = 4096
"""The hint session's slots and ids a slot: 32 768 ids out at once. A hint's
slot comes back as soon as the server admitted it (before any read), so a few
small slots keep up; the segment stays small (8 × 4096 rows)."""
SLOT_WAIT_S = 0.05
"""How long the thread waits for a hint slot to come back before it skips the
rest of a piece (counted)."""
RETRY_S = 5.0
"""After a failed connect, prompts are not hinted for this long."""


@dataclass
class PromptAheadStats:
    """The thread's counts since the process started (rows are ids sent)."""

    prompts: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    prompts_dropped: int = 0  # the queue was full
    prompts_not_hinted: int = 0  # no session (server missing, or prompt-ahead off)
    tokens: int = 0
    ids_sent: int = 0
    ids_skipped: int = 0  # no hint slot came back in time, or the server reads no hints
    errors: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class _Prompt:
    stage: str
    request_id: str
    tokens: Sequence[int]  # the request's own list: read, never changed
    start: int  # hint tokens[start:]


class PromptAhead:
    """One engine-core process's prompt-ahead: a queue of prompts and the
    thread that hashes them and hints their rows."""

    def __init__(
        self,
        settings: ShmSettings,
        model_dir: str,
        stages: Sequence[str],
        *,
        queue_prompts: int = QUEUE_PROMPTS,
    ) -> None:
        self.settings = settings
        self.queue_prompts = queue_prompts
        self.model_dir = model_dir
        self.stages = frozenset(stages)
        self.stats = PromptAheadStats()
        self._queue: collections.deque[_Prompt] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self._client: PleClient | None = None
        self._hasher: NgramHasher | EngramHasher | None = None
        self._tables: dict[str, str] = {}  # a layer's table, as the server names it
        self._off_until = 0.0  # monotonic; float("inf"): off for good
        self._busy = False  # the thread holds a prompt
        self._thread = threading.Thread(target=self._run, name="ple-prompt-ahead", daemon=True)
        self._thread.start()

    # -------------------------------------------------- the scheduler's side
    def arrived(self, request_id: str, tokens: Sequence[int] | None) -> None:
        """A request entered the waiting queue: hint its whole prompt."""
        if ARRIVAL in self.stages and tokens:
            self._put(_Prompt(ARRIVAL, request_id, tokens, 0))

    def scheduled(self, request_id: str, tokens: Sequence[int] | None, start: int) -> None:
        """A request's first chunk was scheduled, up to token ``start``: hint
        the rest of its prompt."""
        if SCHEDULED in self.stages and tokens and start < len(tokens):
            self._put(_Prompt(SCHEDULED, request_id, tokens, start))

    def _put(self, prompt: _Prompt) -> None:
        with self._wake:
            if len(self._queue) >= self.queue_prompts:
                self.stats.prompts_dropped += 1
                dropped = self.stats.prompts_dropped
                if dropped & (dropped - 1) == 0:  # the 1st, 2nd, 4th, 8th…: bounded
                    log.warning(
                        "PLE prompt-ahead: %d prompt(s) not hinted so far: %d wait already "
                        "(the hint thread is behind; lookups do not depend on it)",
                        dropped,
                        self.queue_prompts,
                    )
                return
            self._queue.append(prompt)
            self._wake.notify()

    def idle(self, timeout: float) -> bool:
        """Wait until every queued prompt was hinted; returns whether it was
        (tests, and a clean shutdown)."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(min(left, 0.01))
        return True

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._queue.clear()
            self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        if self._client is not None:
            self._client.close()
            self._client = None

    # ---------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._busy = False
                    self._wake.notify_all()  # idle() waiters
                    self._wake.wait()
                if self._closed:
                    return
                prompt = self._queue.popleft()
                self._busy = True
            try:
                self._hint(prompt)
            except Exception as exc:  # a hint is never worth a failed engine
                self.stats.errors += 1
                log.warning(
                    "PLE prompt-ahead: request %s (%s) not hinted: %s",
                    prompt.request_id,
                    prompt.stage,
                    exc,
                )
                self._drop_session()

    def _hint(self, prompt: _Prompt) -> None:
        client = self._session()
        if client is None:
            self.stats.prompts_not_hinted += 1
            return
        assert self._hasher is not None  # set with the session
        tokens = np.asarray(prompt.tokens, dtype=np.int64)
        self.stats.prompts[prompt.stage] += 1
        self.stats.tokens += len(tokens) - prompt.start
        for begin in range(prompt.start, len(tokens), CHUNK_TOKENS):
            piece = tokens[begin : begin + CHUNK_TOKENS]
            context = tokens[:begin] if begin else None
            for layer in self._hasher.layers:
                ids = unique_in_order(layer.row_ids(piece, context).reshape(-1))
                self._send(client, self._tables[layer.table], ids)

    def _send(self, client: PleClient, table: str, ids: np.ndarray) -> None:
        """Every id; a slot not back within ``SLOT_WAIT_S`` skips the rest (the
        server is far behind: more hints would be dropped there anyway)."""
        skipped = client.hints_skipped
        client.hint(table, ids, wait=SLOT_WAIT_S)
        lost = client.hints_skipped - skipped
        self.stats.ids_sent += len(ids) - lost
        self.stats.ids_skipped += lost

    # --------------------------------------------------------- the session
    def _session(self) -> PleClient | None:
        if self._client is not None:
            gone = self._client.poll_gone()
            if gone is None:
                return self._client
            log.info("PLE prompt-ahead: %s; connecting again", gone)
            self._client.close()
            self._client = None
        if time.monotonic() < self._off_until:
            return None
        if self._hasher is None:
            try:
                self._hasher = hasher_for(self.model_dir)
            except Exception as exc:  # the checkpoint's hashing: no retry mends it
                self._off_until = float("inf")
                log.warning(
                    "PLE prompt-ahead is off: cannot hash this checkpoint's prompts (%s: %s)",
                    type(exc).__name__,
                    exc,
                )
                return None
        try:
            self._client = self._connect(self._hasher)
        except (NgramConfigError, EngramConfigError, IdentityMismatch, ValueError) as exc:
            self._off_until = float("inf")  # this checkpoint, or its server: for good
            log.warning("PLE prompt-ahead is off: %s", exc)
            return None
        except (OSError, PleError, PleBackendError) as exc:  # no server (found) now
            self._off_until = time.monotonic() + RETRY_S
            log.warning(
                "PLE prompt-ahead: no hint session (%s); prompts are not hinted for %.0f s "
                "(lookups do not depend on it)",
                exc,
                RETRY_S,
            )
            return None
        return self._client

    def _connect(self, hasher: NgramHasher | EngramHasher) -> PleClient:
        self.settings = s = discovery.with_socket(self.settings, self.model_dir)
        client = PleClient.connect(
            s.socket,
            timeout=s.connect_timeout,
            name=f"vllm-prompt-ahead-pid{os.getpid()}",
            capacity=HINT_CAPACITY,
            depth=HINT_DEPTH,
        )
        try:
            self._tables = check_tables(client, hasher, self.model_dir)
        except BaseException:
            client.close()
            raise
        log.info(
            "PLE prompt-ahead: prompts' rows of %d table(s) are hinted to ple-server at %s (%s)",
            len(hasher.layers),
            s.socket,
            ", ".join(sorted(self.stages)),
        )
        return client

    def _drop_session(self) -> None:
        """After an error: no hints for ``RETRY_S`` (so a lasting fault costs
        one warning per ``RETRY_S``), then a new session."""
        if self._client is not None:
            self._client.close()
            self._client = None
        self._off_until = max(self._off_until, time.monotonic() + RETRY_S)


def check_tables(
    client: PleClient, hasher: NgramHasher | EngramHasher, model_dir: str
) -> dict[str, str]:
    """Every table the hasher hints must be served, from this checkpoint:
    hints of another checkpoint's rows would fill the cache with rows no
    lookup asks for. Returns each layer's table as the server names it (an
    Engram layer knows how the name ends)."""
    specs = identity.checkpoint_tables(model_dir)
    names = {}
    for layer in hasher.layers:
        try:
            spec = identity.select(specs, layer.table, model_dir)
            info = identity.select(
                client.tables, layer.table, f"ple-server at {client.socket_path}"
            )
        except IdentityMismatch as exc:
            raise IdentityMismatch(
                f"{exc}; check that the server and vLLM use the same checkpoint"
            ) from None
        if info.fingerprint != spec.fingerprint or info.rows < layer.rows:
            raise IdentityMismatch(
                f"ple-server at {client.socket_path} serves {info.name} with fingerprint "
                f"{info.fingerprint} ({info.rows} rows), the checkpoint {model_dir} has "
                f"{spec.fingerprint} ({layer.rows} rows): another checkpoint"
            )
        names[layer.table] = info.name
    return names


def unique_in_order(ids: np.ndarray) -> np.ndarray:
    """``ids`` without repeats, each at its first place (the order is the
    order the prompt needs them in)."""
    _, first = np.unique(ids, return_index=True)
    return ids[np.sort(first)]


# -------------------------------------------------------------- the patch
_instances: dict[str, PromptAhead] = {}
_instances_lock = threading.Lock()
_UNSET = object()  # a scheduler not asked yet (None: prompt-ahead is off for it)


def for_scheduler(scheduler: Any) -> PromptAhead | None:
    """The process's prompt-ahead for the model ``scheduler`` serves, made at
    its first prompt; None when it is off (``VLLM_PLE_SHM_PROMPT_AHEAD=off``,
    or no local checkpoint to hash with, said once)."""
    cached = scheduler.__dict__.get("_ple_prompt_ahead", _UNSET)
    if cached is not _UNSET:
        return cached
    settings = ShmSettings.from_env()
    found: PromptAhead | None = None
    if settings.prompt_ahead:
        model_config = getattr(scheduler.vllm_config, "model_config", None)
        try:
            model_dir = identity.checkpoint_dir(
                settings.checkpoint,
                model=getattr(model_config, "model", None),
                revision=getattr(model_config, "revision", None),
            )
        except PleBackendError as exc:
            log.warning("PLE prompt-ahead is off: %s", exc)
        else:
            key = f"{model_dir}|{','.join(settings.prompt_ahead)}"
            with _instances_lock:
                found = _instances.get(key)
                if found is None:
                    found = PromptAhead(settings, model_dir, settings.prompt_ahead)
                    _instances[key] = found
    scheduler.__dict__["_ple_prompt_ahead"] = found
    return found


def patch_scheduler_module(module: ModuleType) -> None:
    """``vllm.v1.core.sched.scheduler``: ``Scheduler.add_request`` and
    ``Scheduler.schedule`` (and so every subclass that keeps them) tell
    prompt-ahead of arrivals and first chunks. Idempotent."""
    cls = module.Scheduler
    if cls.__dict__.get("_ple_prompt_ahead_patched"):
        return
    original_add = cls.add_request
    original_schedule = cls.schedule

    @functools.wraps(original_add)
    def add_request(self, request, *args, **kwargs):
        new = request.request_id not in self.requests  # not a streaming update
        result = original_add(self, request, *args, **kwargs)
        if new:
            ahead = for_scheduler(self)
            if ahead is not None:
                ahead.arrived(request.request_id, request.prompt_token_ids)
        return result

    @functools.wraps(original_schedule)
    def schedule(self, *args, **kwargs):
        output = original_schedule(self, *args, **kwargs)
        if output.scheduled_new_reqs:
            ahead = for_scheduler(self)
            if ahead is not None:
                counts = output.num_scheduled_tokens
                for new in output.scheduled_new_reqs:
                    start = new.num_computed_tokens + counts.get(new.req_id, 0)
                    ahead.scheduled(new.req_id, new.prompt_token_ids, start)
        return output

    cls.add_request = add_request
    cls.schedule = schedule
    cls._ple_prompt_ahead_patched = True
    cls._ple_prompt_ahead_original = {"add_request": original_add, "schedule": original_schedule}
    log.info("PLE backend shm: prompts are hinted to ple-server by %s", cls.__qualname__)


@atexit.register
def _close_all() -> None:
    with _instances_lock:
        for ahead in _instances.values():
            ahead.close()
        _instances.clear()
