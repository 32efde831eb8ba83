# The image of docker-compose.yml: the coordinator daemon and a job process, with the etcd extra.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY proto proto
COPY ifrt ifrt
COPY coordinator coordinator
COPY plugins plugins
COPY examples examples
RUN pip install --no-cache-dir '.[etcd]'
EXPOSE 8476
CMD ["ifrt-coordinator", "--help"]
