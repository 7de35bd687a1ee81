"""TLS + SuperNode authentication for real: certificates and keys from deploy/'s scripts, a real
`flower-superlink --ssl-* --enable-supernode-auth`, a registered SuperNode that connects and an unregistered one
that is refused. Needs only openssl and ssh-keygen (or the venv's `cryptography`)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.flower.procs import REPO, Procs, base_env, free_port, launch_superlink, strip_ansi, wait_listening, \
    wait_until, write_flwr_home

DEPLOY = REPO / "deploy"

pytestmark = [pytest.mark.dist, pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")]


def _nodes(env: dict[str, str]) -> list[dict]:
    out = subprocess.run(["flwr", "supernode", "list", "tls", "--format", "json"], env=env, capture_output=True,
                         text=True, timeout=60)
    text = strip_ansi(out.stdout)
    try:
        return json.loads(text[text.index("{"):]).get("nodes", [])
    except ValueError:
        return []


@pytest.mark.timeout(240)
def test_tls_superlink_admits_only_registered_supernodes(tmp_path: Path):
    certs, keys = tmp_path / "certs", tmp_path / "keys"
    subprocess.run(["bash", str(DEPLOY / "tls" / "make-certs.sh"), str(certs), "localhost", "127.0.0.1"],
                   check=True, timeout=120, capture_output=True)
    subprocess.run(["bash", str(DEPLOY / "auth" / "make-supernode-keys.sh"), str(keys), "node0", "intruder"],
                   check=True, timeout=60, capture_output=True)
    for name in ("ca.crt", "server.pem", "server.key"):
        assert (certs / name).is_file()
    assert oct((certs / "server.key").stat().st_mode & 0o777) == "0o600"
    assert oct((keys / "node0").stat().st_mode & 0o777) == "0o600"
    san = subprocess.run(["openssl", "x509", "-in", str(certs / "server.pem"), "-noout", "-ext", "subjectAltName"],
                         capture_output=True, text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in san and "DNS:localhost" in san

    port = free_port()
    home = write_flwr_home(tmp_path / "flwr_home", "tls", f"127.0.0.1:{port}",
                           **{"root-certificates": str(certs / "ca.crt")})
    env = base_env(FLWR_HOME=str(home))
    procs = Procs(tmp_path)
    try:
        wait_listening(launch_superlink(
            procs, port, env, "--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.pem"),
            "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth"), port, timeout=60)

        reg = subprocess.run(["flwr", "supernode", "register", str(keys / "node0.pub"), "tls"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert reg.returncode == 0 and "registered" in strip_ansi(reg.stdout), reg.stdout + reg.stderr

        def supernode(name: str, key: str, *extra: str):
            return procs.start(name, ["flower-supernode", "--root-certificates", str(certs / "ca.crt"),
                                      "--superlink", f"127.0.0.1:{port}", "--host", "127.0.0.1",
                                      "--port", str(free_port()), "--auth-supernode-private-key", str(keys / key),
                                      *extra], env=env)

        good = supernode("supernode-registered", "node0")
        bad = supernode("supernode-unregistered", "intruder", "--max-retries", "1")
        wait_until(lambda: any(n.get("status") == "online" for n in _nodes(env)), 90, interval=1,
                   what="the registered SuperNode online")
        bad.popen.wait(timeout=90)  # refused: exits instead of connecting
        assert bad.popen.returncode != 0
        assert "Failed to activate SuperNode" in strip_ansi(bad.text()), bad.text()[-3000:]
        nodes = _nodes(env)
        assert len(nodes) == 1 and nodes[0]["status"] == "online", nodes
        assert good.popen.poll() is None, good.text()[-3000:]

        # and a plaintext client gets nowhere near the TLS port
        plain = procs.start("supernode-insecure", ["flower-supernode", "--insecure", "--superlink",
                                                   f"127.0.0.1:{port}", "--host", "127.0.0.1", "--port",
                                                   str(free_port()), "--max-retries", "1"], env=env)
        plain.popen.wait(timeout=90)
        assert plain.popen.returncode != 0
        assert len(_nodes(env)) == 1
    finally:
        procs.close()
