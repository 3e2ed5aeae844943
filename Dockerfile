# The mergepipe operator image: kopf + the core library's planner/catalog (numpy), no torch.
# Build from the repository root:  docker build -t ghcr.io/mergepipe/operator:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

WORKDIR /src
COPY pyproject.toml README.md ./
COPY constraints/operator.txt ./constraints/operator.txt
COPY mergepipe ./mergepipe
COPY operator ./operator

# Plain pip: the one distribution (core + operator packages) with its operator extra (kopf,
# kubernetes, boto3, prometheus-client; no torch). A local path, so the name `mergepipe`
# resolves to this checkout, never to an index. Every dependency is pinned to the version the
# tests ran against (constraints/operator.txt, written by constraints/lock.py).
RUN pip install --constraint constraints/operator.txt "./[operator]" \
    && python -c "import mergepipe_operator.main, mergepipe.pipeline, mergepipe.parts, kopf" \
    && ! python -c "import torch" 2>/dev/null \
    && rm -rf /src

# Non-root, numeric (runAsNonRoot can verify it); the chart also sets runAsUser 10001.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin mergepipe
USER 10001:10001
WORKDIR /tmp

EXPOSE 8080 9090
ENTRYPOINT ["kopf", "run", "--standalone", "--module=mergepipe_operator.main", "--liveness=http://0.0.0.0:8080/healthz"]
CMD ["--all-namespaces"]
