# The image of docker-compose.yml: the coordinator daemon and a job process, with the etcd extra.
#
# With registry access this builds on python:3.11-slim and installs from the package index. Without one,
# scripts/compose-demo.sh builds a local Debian base (debootstrap + docker import, with python3 and etcd-server)
# and passes it as BASE_IMAGE, and puts the dependencies' wheels, made on the host, into wheelhouse/ in the
# build context: the build then needs no network at all.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title=ifrt-topology
# A virtualenv: Debian's own python3 (the local base) refuses pip installs into the system.
RUN python3 -m venv /opt/ifrt
ENV PATH=/opt/ifrt/bin:$PATH PYTHONUNBUFFERED=1
WORKDIR /app
# pyproject.toml is there so that the COPY has a source when the context has no wheelhouse/.
COPY pyproject.toml wheelhouse* /tmp/wheelhouse/
RUN if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then \
      pip install --no-cache-dir --no-index /tmp/wheelhouse/*.whl; \
    fi
COPY pyproject.toml README.md ./
COPY proto proto
COPY ifrt ifrt
COPY coordinator coordinator
COPY plugins plugins
COPY examples examples
RUN if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then \
      pip install --no-cache-dir --no-index --find-links /tmp/wheelhouse '.[etcd]'; \
    else \
      pip install --no-cache-dir '.[etcd]'; \
    fi
EXPOSE 8476
CMD ["ifrt-coordinator", "--help"]
