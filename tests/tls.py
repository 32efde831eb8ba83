"""Test certificates made with openssl at run time: a CA, a server certificate for 127.0.0.1 / localhost, and a
client certificate, all signed by the CA (what the README shows operators)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(directory: Path, ips: tuple[str, ...] = ()) -> Path:
    """Writes ca.pem, server.pem / server-key.pem and client.pem / client-key.pem into ``directory``; the server's
    certificate is also for ``ips`` (addresses of test hosts)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca-key.pem", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=ifrt test CA", cwd=directory)
    names = ",".join([*(f"IP:{ip}" for ip in ips), "IP:127.0.0.1", "DNS:localhost"])
    (directory / "san.cnf").write_text(f"subjectAltName={names}\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}-key.pem", "-out", f"{name}.csr",
                 "-subj", f"/CN=ifrt {name}", cwd=directory)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf", cwd=directory)
    return directory
