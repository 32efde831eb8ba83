"""The coordinator on a secured etcd: TLS with client certificates and a user with a password (a real etcd
started here with Debian's etcd-server, certificates made with openssl at run time)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import pytest

from coordinator.local import LocalCoordinator
from tests.etcd_cluster import etcd_binary, skip_without_etcd
from tests.helpers import discover_process, finish, free_ports
from tests.tls import make_certs

PASSWORD = "etcd-pass-7c2e"


class SecureEtcd:
    """One etcd member serving clients over TLS (client certificates required), with user ``root`` and auth on."""

    def __init__(self, directory: Path, certs: Path) -> None:
        self.certs = certs
        client_port, peer_port = free_ports(2)
        self.endpoint = f"127.0.0.1:{client_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        self._log = (directory / "etcd.log").open("wb")
        self.process = subprocess.Popen([
            etcd_binary(), "--name", "m0", "--data-dir", str(directory / "data"),
            "--listen-client-urls", f"https://{self.endpoint}", "--advertise-client-urls", f"https://{self.endpoint}",
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"m0={peer}",
            "--cert-file", str(certs / "server.pem"), "--key-file", str(certs / "server-key.pem"),
            "--trusted-ca-file", str(certs / "ca.pem"), "--client-cert-auth"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        asyncio.run(self._enable_auth())

    def _client(self):
        from etcd3aio import Etcd3Client

        read = lambda name: (self.certs / name).read_bytes()  # noqa: E731
        return Etcd3Client(endpoints=[self.endpoint], ca_cert=read("ca.pem"), cert_key=read("client-key.pem"),
                           cert_chain=read("client.pem"), tls_server_name="127.0.0.1")

    async def _enable_auth(self, timeout: float = 30) -> None:
        client = self._client()
        await client.connect()
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    await client.auth.user_add("root", PASSWORD, timeout=2)
                    break
                except Exception:
                    assert self.process.poll() is None, "etcd exited"
                    assert time.monotonic() < deadline, f"etcd did not serve TLS within {timeout}s"
                    await asyncio.sleep(0.1)
            await client.auth.user_grant_role("root", "root", timeout=5)
            await client.auth.auth_enable(timeout=5)
        finally:
            await client.close()

    def close(self) -> None:
        self.process.kill()  # by its pid
        self.process.wait(30)
        self._log.close()


@pytest.fixture
def secure_etcd(tmp_path):
    skip_without_etcd()
    etcd = SecureEtcd(tmp_path, make_certs(tmp_path))
    yield etcd
    etcd.close()


def coordinator_on(etcd: SecureEtcd, tmp_path: Path, password: str, *tls: str) -> LocalCoordinator:
    password_file = tmp_path / f"password-{len(password)}"
    password_file.write_text(password + "\n")
    return LocalCoordinator("--store", f"etcd://{etcd.endpoint}", "--cluster-id", "secured", *tls,
                            "--etcd-user", "root", "--etcd-password-file", str(password_file), num_processes=1)


def tls_flags(certs: Path) -> tuple[str, ...]:
    return ("--etcd-ca", str(certs / "ca.pem"), "--etcd-cert", str(certs / "client.pem"),
            "--etcd-key", str(certs / "client-key.pem"))


def test_the_coordinator_leads_on_an_etcd_with_tls_and_a_user(secure_etcd, tmp_path):
    with coordinator_on(secure_etcd, tmp_path, PASSWORD, *tls_flags(secure_etcd.certs)) as coordinator:
        coordinator.wait_for_log("serving: replayed 0 journal entries")
        code, out, err = finish(discover_process(coordinator.address, "--process-id", "0", timeout=60))
        assert code == 0, err
        assert json.loads(out)["generation"] == 1
        assert PASSWORD not in coordinator.log


def test_a_wrong_password_or_no_tls_is_named_and_never_served(secure_etcd, tmp_path):
    with coordinator_on(secure_etcd, tmp_path, "not-the-password", *tls_flags(secure_etcd.certs)) as wrong:
        wrong.wait_for_log("etcd refused user 'root'")
        assert "not-the-password" not in wrong.log and "serving:" not in wrong.log
    with coordinator_on(secure_etcd, tmp_path, PASSWORD) as plain:
        plain.wait_for_log("etcd is unreachable")
        assert "serving:" not in plain.log
