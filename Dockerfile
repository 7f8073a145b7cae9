# genqueue's image for docker-compose.yml: the consumer, the producer and `consumer dashboard`.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY producer ./producer
COPY consumer ./consumer
COPY genqueue ./genqueue
# the dashboard extra: rq-dashboard and six, which rq-dashboard imports without declaring it;
# the import check fails the build rather than the dashboard at its first page
RUN pip install --no-cache-dir '.[dashboard]' \
 && python -c "import rq_dashboard.web, genqueue.consumer.dashboard.command" \
 && consumer --help >/dev/null && producer --help >/dev/null
# 9100: a consumer's --metrics-port in docker-compose.yml; 9181: the dashboard
EXPOSE 9100 9181
ENTRYPOINT []
