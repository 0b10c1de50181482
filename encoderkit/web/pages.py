"""The frame of encoderkit's browser pages (``audit review --web``, ``serve --index``'s ``/search``): plain HTML, no
build step, nothing fetched from elsewhere. Each page's script fetches its data with ``api()``, which sends the
bearer token the user typed (kept in sessionStorage): ``serve``'s token rule, with no cookie to steal or forge.
"""

from __future__ import annotations

import html

_STYLE = """
body{font:16px/1.45 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{background:#1d2330;color:#fff;padding:.6em 1.2em;display:flex;gap:1em;align-items:center}
header h1{font-size:1.05em;margin:0;font-weight:600}
main{max-width:52em;margin:1.2em auto;padding:0 1em}
.card{background:#fff;border:1px solid #d8dce3;border-radius:8px;padding:1.1em 1.3em;margin:.8em 0}
.text{font-size:1.2em;white-space:pre-wrap;overflow-wrap:anywhere}
.meta{color:#4a5263;margin:.6em 0}
.meta b{color:#1d2330}
.keys{display:flex;flex-wrap:wrap;gap:.4em;margin-top:.6em}
.keys span{border:1px solid #c5cad3;border-radius:5px;padding:.1em .5em;background:#fafbfc}
kbd{font:600 .9em ui-monospace,monospace}
#msg{min-height:1.4em;margin:.4em 0}
#msg.err{color:#b3261e;font-weight:600}
#msg.ok{color:#1e6b34}
#tokenbox{display:none;margin:.8em 0}
input[type=text],input[type=password],input[type=search]{
  font:inherit;padding:.35em .5em;border:1px solid #b9bfc9;border-radius:5px}
mark{background:#ffe38a;padding:0 .1em}
.hit{margin:.6em 0}
.score{font:600 .9em ui-monospace,monospace;color:#1e4e8c}
.doc{color:#4a5263;font-size:.9em}
.bar{height:6px;background:#e3e6eb;border-radius:3px;overflow:hidden;margin-top:.3em}
.bar div{height:100%;background:#2f7d4a}
"""

_API = """
const box = document.getElementById('tokenbox'), tokenIn = document.getElementById('token');
function say(text, kind) { const m = document.getElementById('msg'); m.textContent = text; m.className = kind || ''; }
function askToken(why) { box.style.display = 'block'; say(why, 'err'); tokenIn.focus(); }
tokenIn.addEventListener('keydown', e => {
  if (e.key !== 'Enter') return;
  e.preventDefault(); e.stopPropagation();
  sessionStorage.setItem('encoderkit-token', tokenIn.value); tokenIn.value = ''; box.style.display = 'none'; say('');
  window.onToken();
});
async function api(path, body) {
  const headers = {};
  const token = sessionStorage.getItem('encoderkit-token');
  if (token) headers['Authorization'] = 'Bearer ' + token;
  const opts = {headers};
  if (body !== undefined) {
    opts.method = 'POST'; headers['Content-Type'] = 'application/json'; opts.body = JSON.stringify(body);
  }
  let r;
  try { r = await fetch(path, opts); } catch (e) { say('the server did not answer: ' + e, 'err'); return null; }
  if (r.status === 401) { askToken('this page needs the token (401): type it and press Enter'); return null; }
  const type = r.headers.get('content-type') || '';
  const data = type.includes('json') ? await r.json() : await r.text();
  if (!r.ok) {
    say((data.error && data.error.message) || ('HTTP ' + r.status), 'err'); return {error: data, status: r.status};
  }
  return data;
}
"""


def page(title: str, body: str, script: str, token_required: bool) -> str:
    """A whole page: ``body`` (trusted HTML built by the caller, every value escaped) and ``script`` (run after
    the shared ``say``/``askToken``/``api`` helpers; it must define ``window.onToken`` and start the page)."""
    start = ("askToken('type the token (the server was started with --token) and press Enter');"
             if token_required else "")
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><meta name=viewport "
            f"content='width=device-width,initial-scale=1'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><header><h1>{html.escape(title)}</h1></header><main>"
            "<div id=tokenbox>Token: <input id=token type=password autocomplete=off></div><div id=msg></div>"
            f"{body}</main><script>{_API}{script}\n"
            f"if (sessionStorage.getItem('encoderkit-token') || !{str(token_required).lower()}) window.onToken(); "
            f"else {{ {start} }}</script></body></html>")
