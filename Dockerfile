# keel: the web process by default; `python -m app.worker` for a worker (see compose.yaml).
# Build: docker build -t keel .   Your agent: FROM keel, add your package, set KEEL_AGENT.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin keel
WORKDIR /srv/keel
COPY pyproject.toml README.md ./
COPY app ./app
COPY channels ./channels
COPY harness ./harness
RUN pip install . && rm -rf /srv/keel/build

USER keel
WORKDIR /home/keel
# Listening beyond loopback needs KEEL_API_KEYS: without them keel refuses to start, saying so.
ENV KEEL_HOST=0.0.0.0 \
    KEEL_PORT=8000 \
    KEEL_DATA_DIR=/home/keel/data
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; url = f\"http://127.0.0.1:{os.environ.get('KEEL_PORT', '8000')}/readyz\"; sys.exit(0 if urllib.request.urlopen(url, timeout=2).status == 200 else 1)"]
CMD ["python", "-m", "app"]
