"""The endpoint labeller: any OpenAI-compatible chat-completions server through the ``openai`` client.

The label is the majority vote over ``samples`` requests per model, the confidence the share that agrees (no
logprobs needed). Every answer goes into the :class:`~encoderkit.label.cache.AnswerCache` before it is used, so a
killed run loses at most the requests in flight.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.label.cache import AnswerCache, request_key
from encoderkit.label.prompt import parse_answer


@dataclass
class Labelled:
    """One text's result: its label (None: no request named a label), confidence and every raw answer."""

    label: str | None
    confidence: float | None
    raw: list[str]


class EndpointLabeller:
    """Labels texts through ``url`` (the server's base URL, e.g. ``http://host:8080/v1``)."""

    def __init__(self, url: str, models: list[str], labels: list[str], cache: AnswerCache, *, samples: int = 1,
                 temperature: float = 0.0, concurrency: int = 4, retries: int = 5, parse_retries: int = 1,
                 timeout: float = 60.0, backoff: float = 1.0, api_key: str = "", max_tokens: int = 16,
                 parse: Callable[[str, str], str | None] | None = None) -> None:
        try:
            import openai
        except ImportError as e:
            raise EncoderkitError("the endpoint labeller needs the openai client: "
                                  "pip install 'encoderkit[label]'") from e
        self.openai = openai
        self.client = openai.OpenAI(base_url=url, api_key=api_key or "not-needed", max_retries=0, timeout=timeout)
        self.url, self.models, self.labels, self.cache = url, models, labels, cache
        self.samples, self.temperature, self.concurrency = samples, temperature, concurrency
        self.retries, self.parse_retries, self.backoff, self.max_tokens = retries, parse_retries, backoff, max_tokens
        self.sent = 0  # requests actually sent by this object (cache hits excluded)
        # parse(answer, text) -> the answer as one vote (a label; NER: its checked span set), None: asked again
        self.parse = parse or (lambda answer, text: parse_answer(answer, labels))
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set when the run fails: workers stop retrying at once

    def label(self, prompts: list[str], texts: list[str],
              done: Callable[[int, Labelled], None] | None = None) -> list[Labelled]:
        """Label every text (``prompts[i]`` is the rendered prompt of ``texts[i]``); ``done(i, result)``
        is called from the calling thread as each text completes."""
        return self._each(self._one, prompts, texts, done)

    def ask(self, prompts: list[str], texts: list[str], done: Callable[[int, str], None] | None = None) -> list[str]:
        """The first model's raw answer to each prompt (cached, retried and counted as labelling requests are),
        for a caller that parses answers itself (``adapt``'s generated queries); ``done`` as in :meth:`label`."""
        return self._each(lambda p, t: self._answer(p, t, self.models[0], 0, 0), prompts, texts, done)

    def _each(self, one: Callable[[str, str], Any], prompts: list[str], texts: list[str],
              done: Callable[[int, Any], None] | None) -> list[Any]:
        results: list[Any] = [None] * len(texts)
        pool = ThreadPoolExecutor(max_workers=self.concurrency)
        try:
            futures = {pool.submit(one, p, t): i for i, (p, t) in enumerate(zip(prompts, texts, strict=True))}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for f in finished:
                    results[futures[f]] = f.result()  # re-raises a fatal error at once
                    if done:
                        done(futures[f], results[futures[f]])
        except BaseException:
            self._stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return results

    def _one(self, prompt: str, text: str) -> Labelled:
        votes: list[str | None] = []
        raw: list[str] = []
        for model in self.models:
            for sample in range(self.samples):
                for attempt in range(self.parse_retries + 1):
                    answer = self._answer(prompt, text, model, sample, attempt)
                    label = self.parse(answer, text)
                    raw.append(answer)
                    if label is not None or attempt == self.parse_retries:
                        votes.append(label)
                        break
        counts = Counter(v for v in votes if v is not None)
        if not counts:
            return Labelled(None, None, raw)
        label, n = counts.most_common(1)[0]
        return Labelled(label, n / len(votes) if len(votes) > 1 else None, raw)

    def _answer(self, prompt: str, text: str, model: str, sample: int, attempt: int) -> str:
        key = request_key(prompt, text, model, sample, attempt)
        with self._lock:
            hit = self.cache.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        resp = self._request(prompt, model, sample)
        seconds = time.perf_counter() - t0
        answer, pt, ct = self._content(resp, model)
        with self._lock:
            self.cache.put(key, model, answer, pt, ct, seconds)
            self.sent += 1
        return answer

    def _request(self, prompt: str, model: str, sample: int) -> Any:
        o = self.openai
        kwargs: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                                  "temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.samples > 1:
            kwargs["seed"] = sample  # servers that honour it make each sample reproducible
        for attempt in range(self.retries + 1):
            try:
                return self.client.chat.completions.create(**kwargs)
            except (o.RateLimitError, o.InternalServerError, o.APITimeoutError, o.APIConnectionError) as e:
                if attempt == self.retries or self._stop.is_set():
                    refused = isinstance(e, o.APIConnectionError) and not isinstance(e, o.APITimeoutError)
                    what = "cannot reach" if refused else "kept failing at"
                    raise EncoderkitError(
                        f"{what} the endpoint {self.url} ({type(e).__name__}: {e}) after {self.retries + 1} tries; "
                        "every answer received so far is in the cache, rerun the same command to resume") from e
                self._stop.wait(min(self.backoff * 2 ** attempt, 30.0))
            except o.APIStatusError as e:
                raise EncoderkitError(
                    f"the endpoint {self.url} answered HTTP {e.status_code} to a chat-completions request for model "
                    f"{model!r} ({str(e)[:200]}); check --endpoint (the base URL, usually ending in /v1) and "
                    "--llm") from e
        raise AssertionError("unreachable")

    def _content(self, resp: Any, model: str) -> tuple[str, int, int]:
        try:
            content = resp.choices[0].message.content
            if content is not None and not isinstance(content, str):
                raise TypeError(f"content is {type(content).__name__}")
        except (AttributeError, IndexError, TypeError, KeyError) as e:
            shown = resp.model_dump_json()[:200] if hasattr(resp, "model_dump_json") else repr(resp)[:200]
            raise EncoderkitError(
                f"the endpoint {self.url} does not speak the chat-completions schema (no choices[0].message.content "
                f"in {shown}); point --endpoint at an OpenAI-compatible server") from e
        usage = getattr(resp, "usage", None)
        pt = int(getattr(usage, "prompt_tokens", 0) or 0)
        ct = int(getattr(usage, "completion_tokens", 0) or 0)
        return content or "", pt, ct
