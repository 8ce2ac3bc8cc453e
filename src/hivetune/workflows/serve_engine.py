"""The engines behind `hivetune serve`: one loaded model each, generating one request at a time.

- ``LlamaBackend``: a .gguf model in llama.cpp (llama-cpp-python), a version's LoRA applied with
  llama.cpp's own LoRA support (``Llama(lora_path=...)``). The conversation is rendered with the
  GGUF's chat template by llama-cpp-python's ``Jinja2ChatFormatter`` (the one its own chat
  completion uses), tokenized, and decoded token by token with ``Llama.generate``, so the counts
  of prompt and answer tokens are exact and a stream stops within one token of a cancel.
- ``HFBackend``: an HF folder (+ adapter) in hivetune's own decoder: ``load_for_generation`` and
  the greedy decoding of `hivetune chat` (``fit_conversation`` + ``greedy_ids``). It answers in one
  piece (a stream gets the whole answer as one chunk) and ignores the sampling parameters.

``Engine`` owns one backend and a worker thread that takes jobs from a queue: llama.cpp's
``Llama`` is not thread-safe, so generation on one engine is serialized, while the HTTP server
serves any number of clients. A job's events (text pieces, the end, an error) go to the asyncio
queue of the request that waits for them.
"""

from __future__ import annotations

import asyncio
import codecs
import os
import queue
import random
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from hivetune.core.errors import UserError
from hivetune.core.versions import LLAMA_CPP_INSTALL

MAX_WAITING = 64  # jobs queued on one engine before new requests get 503


class RequestError(Exception):
    """A request the engine cannot answer as asked: becomes an HTTP error with this status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Params:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 0.95
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Counts:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""  # stop | length | disconnected


class LlamaBackend:
    def __init__(self, model: Path, lora: Path | None, n_ctx: int, threads: int):
        try:
            import llama_cpp  # optional dependency (extra "serve"), loaded only to serve a .gguf
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter
        except ImportError:
            raise UserError(f"{model}: a .gguf is served by llama.cpp: {LLAMA_CPP_INSTALL}") from None

        self.llama_cpp = llama_cpp
        if lora is not None:
            check_lora_gguf(lora)
        # The same threads for the prompt and the decoding: llama.cpp's threads spin while they wait for each
        # other, and more of them than free cores is many times slower (docs/log.md).
        threads = threads or max(1, (os.cpu_count() or 2) // 2)
        try:
            self.llm = llama_cpp.Llama(model_path=str(model), lora_path=str(lora) if lora else None, n_ctx=n_ctx,
                                       n_threads=threads, n_threads_batch=threads, verbose=False)
        except (ValueError, RuntimeError) as e:
            raise UserError(f"{lora or model}: llama.cpp cannot load it ({e})") from None
        # llama-cpp-python 0.3 tests the adapter it got against None, which a NULL ctypes pointer is not: a LoRA
        # that llama.cpp refused (say, made for another base) leaves a NULL adapter that crashes the process at
        # the first token. Refuse it here instead.
        if lora is not None and not getattr(self.llm, "_lora_adapter", None):
            self.llm.close()
            raise UserError(f"{lora}: llama.cpp refused this LoRA for the base {model.name} (another base's?)")
        self.n_ctx = self.llm.n_ctx()
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        template = self.llm.metadata.get("tokenizer.chat_template")
        if template:
            def text_of(token: int) -> str:
                return self.llm.detokenize([token], special=True).decode("utf-8", "replace") if token >= 0 else ""

            self.formatter = Jinja2ChatFormatter(template=template, eos_token=text_of(self.llm.token_eos()),
                                                 bos_token=text_of(self.llm.token_bos()))
        else:
            self.formatter = None

    def prompt_ids(self, messages: list[dict]) -> tuple[list[int], list[str]]:
        """The conversation as prompt tokens, and the template's stop strings."""
        from hivetune.data.formats import render_chat

        if self.formatter is None:  # no chat template in the GGUF: hivetune's plain format
            text = render_chat(SimpleNamespace(chat_template=None), messages, add_generation_prompt=True)
            return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False), []
        try:
            rendered = self.formatter(messages=messages)
        except Exception as e:  # the template's raise_exception (say, roles out of order) or a render error
            raise RequestError(400, f"the model's chat template refused the messages ({e})") from None
        ids = self.llm.tokenize(rendered.prompt.encode("utf-8"), add_bos=not rendered.added_special, special=True)
        stop = rendered.stop if isinstance(rendered.stop, list) else [rendered.stop] if rendered.stop else []
        return ids, stop

    def stream(self, messages: list[dict], params: Params, cancelled: threading.Event, counts: Counts):
        """Yield the answer's text pieces; `counts` holds the token counts and finish reason at the end."""
        prompt, template_stop = self.prompt_ids(messages)
        if len(prompt) >= self.n_ctx:
            raise RequestError(400, f"the conversation is {len(prompt)} tokens; the context holds {self.n_ctx}")
        counts.prompt_tokens = len(prompt)
        limit = min(params.max_tokens, self.n_ctx - len(prompt))
        stops = [s for s in params.stop + template_stop if s]
        self.llm.set_seed(params.seed if params.seed is not None else random.randrange(2**31))
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text, sent = "", 0
        counts.finish_reason = "length"
        # Each request evaluates its whole prompt: reusing the KV cache of the previous request's common prefix
        # evaluates the rest in another split, which can change a greedy answer (llama.cpp's numerics), so an
        # answer would depend on what other clients asked before.
        self.llm.reset()
        tokens = self.llm.generate(prompt, top_k=40, top_p=params.top_p, min_p=0.05, temp=params.temperature,
                                   repeat_penalty=1.0)
        try:
            for token in tokens:
                if self.llama_cpp.llama_vocab_is_eog(self.vocab, token):
                    counts.finish_reason = "stop"
                    break
                counts.completion_tokens += 1
                text += decoder.decode(self.llm.detokenize([token]))
                cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    text = text[:cut]
                    counts.finish_reason = "stop"
                    break
                ready = len(text) - held_back(text, stops)  # a possible start of a stop string waits
                if ready > sent:
                    yield text[sent:ready]
                    sent = ready
                if cancelled.is_set():
                    counts.finish_reason = "disconnected"
                    return
                if counts.completion_tokens >= limit:
                    break
        finally:
            tokens.close()
        text += decoder.decode(b"", final=True)
        if len(text) > sent:
            yield text[sent:]

    def close(self) -> None:
        self.llm.close()


def check_lora_gguf(path: Path) -> None:
    """A LoRA GGUF by its header (general.type adapter, adapter.type lora), read without llama.cpp."""
    import gguf  # the GGUF reader of llama.cpp's project (a dependency of hivetune)

    try:
        fields = gguf.GGUFReader(str(path)).fields
        kind = [fields[k].contents() if k in fields else None for k in ("general.type", "adapter.type")]
    except Exception as e:  # not a GGUF at all: the reader's ValueError, a short file's IndexError, ...
        raise UserError(f"{path}: not a GGUF file ({type(e).__name__}: {e})") from None
    if kind != ["adapter", "lora"]:
        raise UserError(f"{path}: not a LoRA adapter GGUF (general.type {kind[0]!r}, adapter.type {kind[1]!r})")


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that begins one of the stop strings."""
    return max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
               default=0)


class HFBackend:
    def __init__(self, model: Path, adapter: Path | None, device: str, precision: str):
        from hivetune.workflows.generate import load_for_generation

        self.net, self.tokenizer = load_for_generation(str(model), str(adapter) if adapter else "", device, precision)

    def stream(self, messages: list[dict], params: Params, cancelled: threading.Event, counts: Counts):
        from hivetune.model.tokenizer import eos_ids
        from hivetune.workflows.chat import fit_conversation
        from hivetune.workflows.generate import greedy_ids

        try:
            ids = fit_conversation(self.net, self.tokenizer, messages, params.max_tokens)
        except UserError as e:
            raise RequestError(400, str(e)) from None
        out = greedy_ids(self.net, [ids], params.max_tokens, eos_ids(self.tokenizer, self.net.args))[0]
        counts.prompt_tokens, counts.completion_tokens = len(ids), len(out)
        counts.finish_reason = "length" if len(out) >= params.max_tokens else "stop"
        yield self.tokenizer.decode(out, skip_special_tokens=True).strip()

    def close(self) -> None:
        self.net = None


class Job:
    """One chat request on its way through an engine's queue."""

    def __init__(self, messages: list[dict], params: Params, loop: asyncio.AbstractEventLoop):
        self.messages, self.params, self.loop = messages, params, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.counts = Counts()
        self.started = time.perf_counter()
        self.first_piece_s: float | None = None
        self.model = ""  # the id of the engine that ran it

    def emit(self, kind: str, value=None) -> None:
        if kind == "text" and self.first_piece_s is None:
            self.first_piece_s = time.perf_counter() - self.started
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop closed: the server is shutting down
            self.cancelled.set()


class Engine:
    """A backend behind a queue and one worker thread; ``retire`` lets it finish its queue and unload."""

    def __init__(self, model_id: str, backend, load_s: float = 0.0):
        self.model_id, self.backend, self.load_s = model_id, backend, load_s
        self.jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._retired = False
        self.worker = threading.Thread(target=self._work, name=f"engine-{model_id}", daemon=True)
        self.worker.start()

    def submit(self, job: Job) -> bool:
        """Queue the job; False when this engine was retired (the caller takes the current one)."""
        with self._lock:
            if self._retired:
                return False
            if self.jobs.qsize() >= MAX_WAITING:
                raise RequestError(503, f"the server is busy: {MAX_WAITING} requests are waiting; retry later")
            job.model = self.model_id
            self.jobs.put(job)
            return True

    def retire(self) -> None:
        with self._lock:
            if not self._retired:
                self._retired = True
                self.jobs.put(None)

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():  # its client left while it waited
                job.counts.finish_reason = "disconnected"
                job.emit("end")
                continue
            try:
                for piece in self.backend.stream(job.messages, job.params, job.cancelled, job.counts):
                    job.emit("text", piece)
                job.emit("end")
            except RequestError as e:
                job.emit("error", e)
            except Exception as e:  # a bug or a failing engine: this request fails, the server keeps serving
                traceback.print_exc(file=sys.stderr)
                job.emit("error", RequestError(500, f"generation failed ({type(e).__name__}: {e})"))
        self.backend.close()
