"""Plain HTTP answers: JSON, Prometheus text and the files of `web/`."""

from __future__ import annotations

import http
import mimetypes
from pathlib import Path

from starlette.responses import JSONResponse, PlainTextResponse, Response

STATIC_SUFFIXES = {".html", ".js", ".css", ".svg", ".png", ".ico", ".txt"}
# Everything a page loads comes from chatd itself: no CDN, no inline script.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; "
                               "style-src 'self'; script-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def json_response(status: http.HTTPStatus, body: dict, headers: dict[str, str] | None = None) -> Response:
    """A JSON answer that no cache keeps."""
    return JSONResponse(body, status.value, {"Cache-Control": "no-store", "Access-Control-Allow-Origin": "*",
                                             **(headers or {})})


def text_response(status: http.HTTPStatus, text: str) -> Response:
    """A plain-text answer."""
    return PlainTextResponse(text, status.value)


def static_response(web_dir: Path, name: str) -> Response:
    """A file directly inside `web_dir`, or 404; never anything outside it."""
    path = (web_dir / name).resolve()
    if path.parent != web_dir.resolve() or path.suffix not in STATIC_SUFFIXES or not path.is_file():
        return text_response(http.HTTPStatus.NOT_FOUND, f"not found: {name}\n")
    content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    if content_type.startswith("text/") or content_type == "application/javascript":
        content_type += "; charset=utf-8"
    return Response(path.read_bytes(), http.HTTPStatus.OK.value, PAGE_HEADERS, media_type=content_type)
