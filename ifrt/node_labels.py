"""Writes the labels of the Kubernetes node a pod runs on to a file, ``key=value`` a line: what
``IFRT_NODE_LABELS_FILE`` reads for the host's network position (``ifrt.network_sources``).

A pod cannot read its node's labels through the downward API, so an init container whose service account may ``get``
nodes runs ``python -m ifrt.node_labels /etc/ifrt/node/labels`` (``NODE_NAME`` from ``spec.nodeName``) before the job's
container starts: see deploy/kubernetes/workers/. Standard library only; the API is asked once, with the pod's own
service account token and CA.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where Kubernetes mounts a pod's service account token and the cluster's CA."""
NODE_NAME_ENV = "NODE_NAME"


def label_lines(node: Mapping) -> str:
    """A Node object's labels as ``key=value`` lines, sorted by key (labels hold no newline: Kubernetes checks)."""
    labels = node.get("metadata", {}).get("labels") or {}
    return "".join(f"{key}={value}\n" for key, value in sorted(labels.items()))


def api_base(environ: Mapping[str, str]) -> str:
    """The API server as a pod reaches it (``KUBERNETES_SERVICE_HOST``/``_PORT``)."""
    host = environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
    port = environ.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def fetch_node(base: str, name: str, token: str, ca_file: str | None) -> dict:
    """GET /api/v1/nodes/<name> with a bearer token; the API's answer as a dict."""
    url = f"{base}/api/v1/nodes/{urllib.parse.quote(name, safe='')}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
    context = ssl.create_default_context(cafile=ca_file) if url.startswith("https:") else None
    # Directly, whatever proxy the pod's environment names (as ifrt's channels): the API server is in the cluster.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    with opener.open(request, timeout=30) as answer:
        return json.load(answer)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
         account: str = SERVICE_ACCOUNT) -> int:
    """``python -m ifrt.node_labels OUT [API]``: writes the node's labels to OUT (atomically), asking API (default:
    the cluster's, as the pod reaches it) with the service account in ``account``; exit status 1 with the reason on
    stderr when the node cannot be read."""
    args = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if environ is None else environ
    if len(args) not in (1, 2) or not env.get(NODE_NAME_ENV):
        print("usage: NODE_NAME=<node> python -m ifrt.node_labels OUT [API]: writes the node's labels to OUT, "
              "key=value a line (NODE_NAME from the downward API's spec.nodeName)", file=sys.stderr)
        return 2
    out, base = args[0], args[1] if len(args) == 2 else api_base(env)
    try:
        with open(os.path.join(account, "token"), encoding="utf-8") as f:
            token = f.read().strip()
        ca = os.path.join(account, "ca.crt")
        node = fetch_node(base, env[NODE_NAME_ENV], token, ca if os.path.exists(ca) else None)
        temporary = f"{out}.tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(label_lines(node))
        os.replace(temporary, out)
    except (OSError, ValueError) as e:  # urllib's errors are OSErrors; a bad answer a ValueError
        print(f"ifrt.node_labels: cannot read node {env[NODE_NAME_ENV]!r} from {base} into {out}: {e} (the pod's "
              "service account needs `get` on nodes: see deploy/kubernetes/workers/node-labels.yaml)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
