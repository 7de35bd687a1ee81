"""Every script under deploy/ parses (`bash -n`), passes shellcheck where it is installed, and prints its usage."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.flower.procs import REPO, base_env

DEPLOY = REPO / "deploy"
SCRIPTS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".sh", ".sbatch", ".env"))


def test_there_are_scripts():
    names = {p.relative_to(DEPLOY).as_posix() for p in SCRIPTS}
    assert {"env.sh", "slurm/superlink.sbatch", "slurm/group.sbatch", "slurm/all-in-one.sbatch",
            "tls/make-certs.sh", "auth/make-supernode-keys.sh", "firewall/make-rules.sh"} <= names
    assert any(n.startswith("slurm/cross-facility/") for n in names)


@pytest.mark.dist
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_bash_syntax(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


@pytest.mark.dist
@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)")
def test_shellcheck():
    out = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stdout[-6000:]


@pytest.mark.dist
@pytest.mark.parametrize("script", ["tls/make-certs.sh", "auth/make-supernode-keys.sh",
                                    "slurm/cross-facility/submit-groups.sh", "firewall/make-rules.sh",
                                    "local/run_deployment.sh"])
def test_usage(script):
    out = subprocess.run(["bash", str(DEPLOY / script), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "deploy/" in out.stdout


def _between(lines: list[str], start: str, end: str) -> list[str]:
    """The lines after the first one starting with `start`, up to the next one starting with `end`."""
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    last = next(i for i in range(first + 1, len(lines)) if lines[i].startswith(end))
    return lines[first + 1:last]


def test_the_docs_show_the_local_deployment_recipe_as_the_script_runs_it():
    """docs/flower.md's deployment recipe is the one `deploy/local/run_deployment.sh` runs (and the tests run it)."""
    script = _between((DEPLOY / "local" / "run_deployment.sh").read_text().splitlines(), "# >>> recipe",
                      "# <<< recipe")
    docs = _between((REPO / "docs" / "flower.md").read_text().splitlines(),
                    "<!-- copied from deploy/local/run_deployment.sh", "<!-- end of the copied recipe")
    assert docs[0] == "```bash" and docs[-1] == "```", docs[:1] + docs[-1:]
    assert docs[1:-1] == script, "docs/flower.md's recipe drifted from deploy/local/run_deployment.sh: copy it"
    recipe = "\n".join(script)
    assert "--host 127.0.0.1" in recipe and "0.0.0.0" not in recipe
    assert "stop-groups=true" in recipe and "run-dir=" in recipe and "allowed-save-root=" in recipe


@pytest.mark.dist
def test_the_local_deployment_refuses_bad_options_before_starting_anything():
    script = str(DEPLOY / "local" / "run_deployment.sh")
    for args, message in ((["--groups", "0"], "--groups must be a positive integer"),
                          (["--supernode-ports", "1,2,3"], "--supernode-ports needs 2 ports, got 3"),
                          (["--superlink-port", "x"], "a port must be a number, got 'x'"),
                          (["--no-such-option"], "unknown option --no-such-option")):
        out = subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=60, env=base_env())
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
        assert "started" not in out.stdout


@pytest.mark.parametrize("script", sorted(p.name for p in (DEPLOY / "slurm").glob("*.sbatch")))
def test_sbatch_headers(script):
    text = (DEPLOY / "slurm" / script).read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "#SBATCH --job-name=" in text and "set -euo pipefail" in text
    assert 'source "$FLWR_SHARDED_REPO/deploy/env.sh"' in text


def _rules(fmt: str, shards: int, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
    return subprocess.run(["bash", str(DEPLOY / "firewall" / "make-rules.sh"), fmt, str(shards)], capture_output=True,
                          text=True, timeout=30, env={**clean, "FLWR_SHARDED_SITE_ENV": "", **env})


@pytest.mark.dist
def test_firewall_rules_name_every_port_env_sh_defines():
    """Each `FLWR_*_PORT*` default of env.sh (a port base: S ports from it) is in the rendered rules, so a port
    added to the deployment cannot be left out of the firewall."""
    defaults = dict(re.findall(r'^: "\$\{(FLWR_\w*PORT\w*):=(\d+)\}"', (DEPLOY / "env.sh").read_text(), re.M))
    assert {"FLWR_SUPERLINK_PORT", "FLWR_SUPERNODE_PORT", "FLWR_GROUP_PORT", "FLWR_TORCHRUN_PORT",
            "FLWR_RENDEZVOUS_PORT_BASE"} <= defaults.keys(), defaults
    ports = {int(p) + s for name, p in defaults.items() for s in (range(3) if name.endswith("_BASE") else [0])}
    nft = _rules("nft", 3, FLWR_FEDERATION_NODES="10.0.0.0/24", FLWR_EPHEMERAL_PORTS="40000-50000")
    assert nft.returncode == 0, nft.stderr
    named = {int(p) for line in nft.stdout.splitlines() if "dport" in line for p in re.findall(r"\b(\d{2,5})\b", line)}
    assert ports <= named, ports - named
    assert "40000-50000" in nft.stdout


@pytest.mark.dist
def test_firewall_rules_restrict_the_unauthenticated_ports_to_the_federation(tmp_path):
    """The rules name env.sh's ports: the torchrun and S rendezvous ports and the ephemeral range only from the
    federation's nodes, the SuperLink only from its clients, the local ports never from outside; nft and
    iptables-restore accept them where installed."""
    env = dict(FLWR_FEDERATION_NODES="10.0.0.0/24, 10.1.0.7 fd00::/64", FLWR_SUPERLINK_CLIENTS="10.0.0.0/24 10.9.9.9",
               FLWR_RENDEZVOUS_PORT_BASE="31000", FLWR_TORCHRUN_PORT="31500", FLWR_SUPERLINK_PORT="31093",
               FLWR_EPHEMERAL_PORTS="40000-50000")
    nft = _rules("nft", 12, **env)
    assert nft.returncode == 0, nft.stderr
    federation = "{ 31500, " + ", ".join(str(31000 + s) for s in range(12)) + ", 40000-50000 }"
    assert f"tcp dport {federation} ip saddr @federation4 accept" in nft.stdout
    assert f"tcp dport {federation} counter drop" in nft.stdout
    assert "elements = { 10.0.0.0/24, 10.1.0.7 }" in nft.stdout and "elements = { fd00::/64 }" in nft.stdout
    assert "elements = { 10.0.0.0/24, 10.9.9.9 }" in nft.stdout and "tcp dport 31093 counter drop" in nft.stdout
    ipt = _rules("iptables", 12, **env)
    assert ipt.returncode == 0, ipt.stderr
    lines = ipt.stdout.splitlines()
    assert "-A FLWR_SHARDED -p tcp --dport 31093 -s 10.9.9.9 -j RETURN" in lines
    assert all(line.count(",") <= 6 for line in lines if "multiport" in line)  # at most 15 ports per rule
    opened = {p for line in lines if "-s 10.1.0.7 " in line for p in line.split("--dports ")[1].split()[0].split(",")}
    assert opened == {"31500", *(str(31000 + s) for s in range(12)), "40000:50000"}
    assert _rules("nft", 2, FLWR_FEDERATION_NODES="").returncode == 2
    for fmt, check in (("nft", ["nft", "-c", "-f"]), ("iptables", ["iptables-restore", "--test", "--noflush"]),
                       ("ip6tables", ["ip6tables-restore", "--test", "--noflush"])):
        if shutil.which(check[0]) is None:
            continue
        path = tmp_path / f"rules.{fmt}"
        path.write_text(_rules(fmt, 12, **env).stdout)
        out = subprocess.run([*check, str(path)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, (fmt, out.stderr)


LOOPBACK = ["127.0.0.1", "127.0.0.1:9093", "127.4.5.6:1", "localhost", "localhost:9093", "::1", "[::1]:9093"]
ELSEWHERE = ["0.0.0.0", "0.0.0.0:9093", "10.0.0.7:9093", "192.168.1.2", "login1.cluster.org:9093",
             "127.0.0.1.nip.io:9093", "[fe80::1]:9093", "::", ""]


@pytest.mark.dist
def test_only_loopback_addresses_count_as_loopback():
    checks = " ".join(f'is_loopback "{a}" && echo "yes {a}" || echo "no {a}";' for a in LOOPBACK + ELSEWHERE)
    out = subprocess.run(["bash", "-c", f'source "{DEPLOY / "env.sh"}"; {checks}'], capture_output=True, text=True,
                         timeout=30, env=base_env())
    assert out.stdout.splitlines() == [f"yes {a}" for a in LOOPBACK] + [f"no {a}" for a in ELSEWHERE], out.stderr


def _sbatch(script: str, tmp_path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """deploy/slurm/SCRIPT run by bash (no Slurm), with the commands it would start replaced by stubs that record
    their command line and fail: (its outcome, the commands it started)."""
    stubs, started = tmp_path / "bin", tmp_path / "started"
    stubs.mkdir(exist_ok=True)
    for name in ("flower-superlink", "flower-supernode", "srun", "torchrun"):
        (stubs / name).write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> "{started}"\nexit 3\n')
        (stubs / name).chmod(0o755)
    clean = {k: v for k, v in base_env().items() if not k.startswith(("FLWR_", "SLURM_"))}
    out = subprocess.run(["bash", str(DEPLOY / "slurm" / script)], capture_output=True, text=True, timeout=60,
                         cwd=REPO, env={**clean, "PATH": f"{stubs}:{clean['PATH']}", "FLWR_SHARDED_REPO": str(REPO),
                                        "FLWR_SHARDED_SHARED": str(tmp_path / "shared"),
                                        "FLWR_SHARDED_VENV": str(tmp_path / "no-venv"), **env})
    return out, started.read_text().splitlines() if started.exists() else []


@pytest.mark.dist
@pytest.mark.parametrize("bind", ["0.0.0.0", "10.0.0.7", None], ids=["any", "fabric", "default"])
def test_a_plaintext_superlink_off_loopback_is_refused_before_anything_starts(tmp_path, bind):
    out, started = _sbatch("superlink.sbatch", tmp_path, FLWR_SHARDED_INSECURE="1",
                           **({"FLWR_SUPERLINK_BIND": bind} if bind else {}))
    assert out.returncode == 2 and not started, (out.stderr, started)
    assert "FLWR_SHARDED_INSECURE=1" in out.stderr and "loopback" in out.stderr
    assert "deploy/tls/make-certs.sh" in out.stderr and f"is {bind or '0.0.0.0'}:" in out.stderr
    assert not (tmp_path / "shared").exists()  # not even its state directory


@pytest.mark.dist
def test_a_plaintext_superlink_on_loopback_starts(tmp_path):
    out, started = _sbatch("superlink.sbatch", tmp_path, FLWR_SHARDED_INSECURE="1", FLWR_SUPERLINK_BIND="127.0.0.1",
                           FLWR_SUPERLINK_ADDRESS="127.0.0.1:9093")
    assert len(started) == 1 and started[0].startswith("flower-superlink --insecure --host 127.0.0.1 "), started


@pytest.mark.dist
@pytest.mark.parametrize("superlink", ["10.0.0.7:9093", "login1.cluster.org:9093"])
def test_a_plaintext_supernode_to_a_superlink_off_loopback_is_refused_before_anything_starts(tmp_path, superlink):
    out, started = _sbatch("group.sbatch", tmp_path, FLWR_SHARDED_INSECURE="1", FLWR_SUPERLINK=superlink,
                           FLWR_NPROC_PER_NODE="1", FLWR_METHOD="fl-fsdp")
    assert out.returncode == 2 and not started, (out.stderr, started)
    assert f"the SuperLink's address is {superlink}:" in out.stderr and "docs/security.md" in out.stderr
    assert not (tmp_path / "shared").exists()  # no run directory, no group key


@pytest.mark.dist
def test_a_plaintext_supernode_to_a_loopback_superlink_goes_on_to_start_its_group(tmp_path):
    out, started = _sbatch("group.sbatch", tmp_path, FLWR_SHARDED_INSECURE="1", FLWR_SUPERLINK="127.0.0.1:9093",
                           FLWR_NPROC_PER_NODE="1", FLWR_METHOD="fl-fsdp")
    assert "loopback" not in out.stderr and started and started[0].startswith("srun "), (out.stderr, started)
