"""The search page of ``encoderkit serve --index``: ``GET /search`` (a box) and ``GET /search/results``.

``/search`` is the page's frame (no data, public like ``/docs``); its script asks
``/search/results?q=...&k=...&bm25=...&index=...`` for the hits, rendered here as HTML (doc id,
score, the passage with the query's terms marked; every piece of text escaped). The results route
sits behind ``serve``'s token check, limits and error bodies, as ``/v1/search`` does.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from encoderkit.errors import EncoderkitError
from encoderkit.retrieval.search import Result, Searcher, SearchSettings
from encoderkit.web.pages import page

MAX_TERMS = 32

_BODY = """
<form id=form class=card onsubmit="return false">
<input id=q type=search size=48 maxlength=2000 placeholder="search..." autofocus>
<label>k <input id=k type=text size=3 value=10></label>
<label><input id=bm25 type=checkbox> BM25</label>
<input id=index type=hidden>
</form>
<div id=results></div>
"""

_SCRIPT = """
const q = document.getElementById('q');
async function run() {
  if (!q.value.trim()) return;
  const p = new URLSearchParams({q: q.value, k: document.getElementById('k').value,
                                 bm25: document.getElementById('bm25').checked ? '1' : '0',
                                 index: document.getElementById('index').value});
  const v = await api('/search/results?' + p);
  if (typeof v === 'string') { document.getElementById('results').innerHTML = v; say(''); }
}
function useIndex(name) { document.getElementById('index').value = name; run(); }
q.addEventListener('keydown', e => { if (e.key === 'Enter') { e.preventDefault(); run(); } });
window.onToken = () => { q.focus(); run(); };
"""


def highlight(text: str, query: str) -> str:
    """``text`` as HTML with the query's words (two characters or more, any case; a plural ``s``/``es`` too)
    in ``<mark>``; everything else escaped."""
    terms = sorted({w.casefold() for w in re.findall(r"\w+", query) if len(w) > 1}, key=len, reverse=True)[:MAX_TERMS]
    if not terms:
        return html.escape(text)
    pattern = re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, terms)) + r")(?:e?s)?(?!\w)", re.IGNORECASE)
    out, last = [], 0
    for m in pattern.finditer(text):
        out += [html.escape(text[last:m.start()]), f"<mark>{html.escape(m.group())}</mark>"]
        last = m.end()
    return "".join(out) + html.escape(text[last:])


def results_html(name: str, others: list[str], query: str, result: Result) -> str:
    e = html.escape
    switch = "".join(f" <a href='#' data-index='{e(o)}' onclick='useIndex(this.dataset.index);return false'>{e(o)}</a>"
                     for o in others)
    cut = " &middot; query truncated to the model maximum" if result.truncated else ""
    head = (f"<div class=meta>index <b>{e(name)}</b>{' &middot; also:' + switch if others else ''} &middot; "
            f"{len(result.hits)} hits{cut}</div>")
    hits = "".join(f"<div class='card hit'><span class=score>{h.score:.4f}</span> <span class=doc>{e(h.doc_id)} "
                   f"&middot; {e(h.passage_id)}</span><div class=text>{highlight(h.text, query)}</div></div>"
                   for h in result.hits)
    return head + (hits or "<div class=card>no hits</div>")


def add_search_page(app: FastAPI, searchers: dict[str, Searcher], check_texts: Callable[..., None],
                    error: Callable[[int, str, str], HTTPException], max_k: int) -> None:
    """``GET /search`` and ``GET /search/results`` over ``searchers`` (see the module docstring); ``error`` builds
    the 4xx exceptions ``/v1/search`` raises, so both answer errors alike. The page does not know whether the
    service wants a token: it asks for one when a search is refused with 401."""
    @app.get("/search", response_class=HTMLResponse, include_in_schema=False)
    async def search_page() -> HTMLResponse:
        return HTMLResponse(page("encoderkit search", _BODY, _SCRIPT, token_required=False))

    @app.get("/search/results", response_class=HTMLResponse, include_in_schema=False)
    async def search_results(q: str, k: int = 10, bm25: bool = False, index: str = "") -> HTMLResponse:
        check_texts("query", [q])
        if not 1 <= k <= max_k:
            raise error(422, "invalid_request", f"k={k} is not between 1 and {max_k}")
        if index and index not in searchers:
            raise error(404, "unknown_index", f"no index named {index!r}; served: {', '.join(searchers)}")
        name = index or next(iter(searchers))
        try:
            result = (await run_in_threadpool(searchers[name].search, [q], SearchSettings(k, bm25=bm25)))[0]
        except EncoderkitError as e:
            raise error(422, "invalid_request", str(e)) from e
        return HTMLResponse(results_html(name, [n for n in searchers if n != name], q, result))
