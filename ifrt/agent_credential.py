"""An ``ifrt run`` agent's host credential: what binds the host an agent acts for to a secret it cannot make up.

The operator holds an agent key (the coordinator's ``--agent-key-file``). A host's credential is the HMAC-SHA256 of
its name under that key, so the coordinator checks it without keeping a list, and a credential names one host only:
an agent that holds ``node3``'s credential may act for ``node3`` and nothing else, as a kubelet's certificate names
its node. Hand each host its own credential (``ifrt agent-credential --host node3``) for that binding to hold between
hosts; a host given the key itself can make every host's credential (convenient where the key sits on a shared file
system, but then any host's agent can act for any host). Workers never get either: the agent keeps them out of
their environment.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from ifrt.errors import InvalidArgument
from ifrt.protocol import read_secret_file

AGENT_CREDENTIAL_METADATA = "ifrt-agent-credential"
"""Call metadata carrying an agent's host credential (JobAgents calls only)."""
AGENT_KEY_FILE_ENV = "IFRT_AGENT_KEY_FILE"
"""The agent key's file: the coordinator's ``--agent-key-file``, or an agent's, which derives its own host's
credential from it."""
AGENT_CREDENTIAL_FILE_ENV = "IFRT_AGENT_CREDENTIAL_FILE"
"""A file holding this host's credential (``ifrt agent-credential --host H`` printed it)."""
AGENT_ENV = (AGENT_KEY_FILE_ENV, AGENT_CREDENTIAL_FILE_ENV)
"""What an agent removes from its workers' environment."""
MIN_KEY_CHARS = 16
"""The shortest agent key accepted: a key is random text (``openssl rand -hex 32``)."""
_CONTEXT = b"ifrt agent host\x00"


def read_agent_key(path: str, origin: str) -> str:
    """The agent key in ``path``; InvalidArgument naming the file (never its content) when it is too short."""
    key = read_secret_file(path, origin)
    if len(key) < MIN_KEY_CHARS:
        raise InvalidArgument(f"the agent key in {path!r} ({origin}) is {len(key)} characters long: expected at least "
                              f"{MIN_KEY_CHARS} random characters (openssl rand -hex 32)")
    return key


def host_credential(key: str, host: str) -> str:
    """``host``'s credential under the agent key ``key`` (hex)."""
    return hmac.new(key.encode(), _CONTEXT + host.encode(), hashlib.sha256).hexdigest()


def credential_holds(key: str, host: str, given: str | None) -> bool:
    """Whether ``given`` is ``host``'s credential under ``key`` (constant-time)."""
    return given is not None and hmac.compare_digest(host_credential(key, host).encode(), given.encode())


def agent_credential(host: str, *, credential_file: str | None = None, key_file: str | None = None,
                     env: Mapping[str, str] = os.environ) -> str | None:
    """The credential an agent on ``host`` presents: from ``credential_file`` (else IFRT_AGENT_CREDENTIAL_FILE), or
    derived from the key in ``key_file`` (else IFRT_AGENT_KEY_FILE); None when neither is given."""
    credential_file = credential_file or env.get(AGENT_CREDENTIAL_FILE_ENV, "").strip() or None
    if credential_file:
        return read_secret_file(credential_file, "the agent's credential file")
    key_file = key_file or env.get(AGENT_KEY_FILE_ENV, "").strip() or None
    if key_file:
        return host_credential(read_agent_key(key_file, "the agent key file"), host)
    return None
