"""HTML of the web review (``label/web.py``): the page's frame and script, and the fragments the server renders.

Every value from the sheet goes through ``html.escape``: a text holding ``<script>`` shows as text.
"""

from __future__ import annotations

import html
from typing import Any

from encoderkit.web.pages import page

_BODY = """
<div class=meta>Reviewer: <input id=who type=text placeholder="your name (for messages)" size=22 maxlength=64></div>
<div id=view class=card>loading...</div>
"""

_SCRIPT = """
let tab = sessionStorage.getItem('encoderkit-tab');
if (!tab) {
  tab = Array.from(crypto.getRandomValues(new Uint8Array(12)), b => b.toString(16).padStart(2, '0')).join('');
  sessionStorage.setItem('encoderkit-tab', tab);
}
const whoIn = document.getElementById('who');
whoIn.value = localStorage.getItem('encoderkit-who') || '';
whoIn.addEventListener('change', () => localStorage.setItem('encoderkit-who', whoIn.value));
let cur = null, queue = Promise.resolve();
function base() { return {tab: tab, who: whoIn.value || null}; }
function show(v) {
  cur = v;
  document.getElementById('view').innerHTML = v.html;
  if (v.message) say(v.message, 'ok');
}
async function send(path, body) {
  const v = await api(path, body);
  if (v && v.error) {
    if (v.status === 409) { const again = await api('/api/next', base()); if (again && !again.error) show(again); }
  }
  else if (v) show(v);
}
window.onToken = () => { queue = queue.then(() => send('/api/next', base())); };
document.addEventListener('keydown', e => {
  if (e.target.tagName === 'INPUT' || e.ctrlKey || e.metaKey || e.altKey) return;
  const k = e.key;
  if (!['Enter', 'a', 's', 'u', 'r'].includes(k) && !/^[1-9]$/.test(k)) return;
  e.preventDefault();
  // keys are handled one after another, each on the row the previous one left on screen
  queue = queue.then(() => {
    if (!cur) return;
    const body = base();
    if (cur.done) {
      if (k === 'u') return send('/api/undo', body);
      if (k === 'r') return send('/api/revisit', body);
      return;
    }
    const shown = {row: cur.row, text_sha: cur.text_sha, label: cur.label};
    if (k === 'Enter' || k === 'a') return send('/api/answer', Object.assign(body, shown, {gold: cur.label}));
    if (/^[1-9]$/.test(k)) {
      if (+k > cur.labels.length) { say('no label ' + k + ' (there are ' + cur.labels.length + ')', 'err'); return; }
      return send('/api/answer', Object.assign(body, shown, {gold: cur.labels[+k - 1]}));
    }
    if (k === 's') return send('/api/skip', Object.assign(body, {row: cur.row}));
    if (k === 'u') return send('/api/undo', body);
  });
});
// renew this tab's hold on its row while the page is open (the server lets a hold lapse after lease_s)
setInterval(() => { if (cur && !cur.done) queue = queue.then(() => api('/api/next', base())); }, 60000);
"""


def review_page(token_required: bool) -> str:
    return page("encoderkit audit review", _BODY, _SCRIPT, token_required)


def progress_html(progress: dict[str, Any]) -> str:
    filled, total, agree = progress["filled"], progress["total"], progress["agree"]
    acc = (f"accuracy so far {progress['accuracy']:.3f} ({agree}/{filled} accepted)" if filled
           else "accuracy so far: no answer yet")
    width = 100 * filled / total if total else 100
    return (f"<div class=meta id=progress>answered <b>{filled}</b> of <b>{total}</b> &middot; {acc}</div>"
            f"<div class=bar><div style='width:{width:.1f}%'></div></div>")


def _number(value: str) -> str:
    try:
        return f"{float(value):.3f}"
    except ValueError:
        return html.escape(value)


def card_html(r: dict[str, str], labels: list[str], progress: dict[str, Any], sheet: str) -> str:
    """One row: its text, the labeller's label, confidence and suspicion, the keys, the progress."""
    e = html.escape
    facts = [f"labeller: <b id=label>{e(r['label'])}</b>"]
    facts += [f"{k} <b>{_number(r[k])}</b>" for k in ("confidence", "suspicion") if r.get(k)]
    if r.get("suspect", "").lower() in ("true", "1"):
        facts.append("<b>suspect</b>")
    keys = [f"<span><kbd>Enter</kbd>/<kbd>a</kbd> accept {e(r['label'])}</span>"]
    keys += [f"<span><kbd>{n}</kbd> {e(name)}</span>" for n, name in enumerate(labels[:9], 1)]
    keys += ["<span><kbd>s</kbd> skip</span>", "<span><kbd>u</kbd> undo</span>"]
    return (f"<div class=meta>{e(sheet)} &middot; row {e(r['row'])} of the labelled file</div>"
            f"<div class=text id=text>{e(r['text'])}</div>"
            f"<div class=meta>{' &middot; '.join(facts)}</div><div class=keys>{''.join(keys)}</div>"
            f"{progress_html(progress)}")


def done_html(progress: dict[str, Any], skipped: int, others: int) -> str:
    """No row left for this tab: what remains (skipped here, held by other tabs) and the keys that still work."""
    left = []
    if skipped:
        left.append(f"{skipped} skipped here (<kbd>r</kbd> shows them again)")
    if others:
        left.append(f"{others} held by other reviewers")
    rest = f" Left: {', '.join(left)}." if left else ""
    return (f"<div class=text id=text>Nothing left to review here.{rest}</div>"
            f"<div class=keys><span><kbd>u</kbd> undo your last answer</span></div>{progress_html(progress)}")
