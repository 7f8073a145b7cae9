FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY producer ./producer
COPY consumer ./consumer
COPY genqueue ./genqueue
RUN pip install --no-cache-dir '.[dashboard]'
ENTRYPOINT []
