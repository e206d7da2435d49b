"""Tests for tagc/train/netem.sh: namespace setup/teardown, shaping, refusals.

Needs root and iproute2 (ip, tc); skipped otherwise. Every subprocess has a timeout;
the whole module takes a few seconds. Namespaces use a per-process prefix so the
tests never touch a benchmark network that may be up at the same time.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NETEM = ROOT / "tagc" / "train" / "netem.sh"
PREFIX = f"tt{os.getpid() % 100000}"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="netem needs root (network namespaces, tc)"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None,
                       reason="iproute2 (ip, tc) not installed"),
    pytest.mark.skipif(shutil.which("python3") is None, reason="python3 not on PATH"),
]


def _netem(*args: str, timeout: float = 20, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run netem.sh with this module's prefix.

    Args:
        *args: options and command for netem.sh.
        timeout: seconds before the call is killed.
        env: environment (default: inherited without TAGC_NETEM_* variables).

    Returns:
        The completed process (stdout and stderr captured as text).
    """
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TAGC_NETEM_")}
    return subprocess.run(["bash", str(NETEM), "--prefix", PREFIX, *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _our_namespaces() -> list[str]:
    """Namespaces this module created and has not deleted yet."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith(PREFIX + "-")]


@pytest.fixture(autouse=True)
def _cleanup():
    yield
    _netem("down")
    assert _our_namespaces() == []


def _measured(stdout: str) -> float:
    m = re.search(r"measured ([0-9.]+) Mbit/s", stdout)
    assert m, stdout
    return float(m.group(1))


def test_up_limits_link_and_down_removes_all():
    r = _netem("--rate", "40mbit", "--delay", "0", "up")
    assert r.returncode == 0, r.stderr
    assert sorted(_our_namespaces()) == [f"{PREFIX}-h0", f"{PREFIX}-h1"]
    # host addresses are only inside the namespaces
    r = _netem("exec", "1", "ip", "-br", "addr", "show", "dev", "tagc0")
    assert "10.77.0.2/24" in r.stdout, r.stdout + r.stderr
    # 2 MiB at 40 Mbit/s takes ~0.4 s; unshaped it is far faster
    shaped = _netem("--rate", "40mbit", "measure", "2")
    assert shaped.returncode == 0, shaped.stderr
    mbit = _measured(shaped.stdout)
    assert 0.6 * 40 < mbit < 1.1 * 40, shaped.stdout
    r = _netem("rate", "none")
    assert r.returncode == 0, r.stderr
    free = _netem("--rate", "none", "measure", "2")
    assert free.returncode == 0, free.stderr
    assert _measured(free.stdout) > 3 * 40, free.stdout
    assert _netem("down").returncode == 0
    assert _our_namespaces() == []


def test_bridge_for_three_hosts():
    r = _netem("-n", "3", "--rate", "100mbit", "--delay", "0", "up")
    assert r.returncode == 0, r.stderr
    assert sorted(_our_namespaces()) == sorted([f"{PREFIX}-br"] + [f"{PREFIX}-h{i}" for i in range(3)])
    # host2 reaches host0 through the bridge (Python: ping may not be installed)
    code = "import socket; s=socket.socket(); s.settimeout(3); s.bind(('10.77.0.3',0)); " \
           "s.connect_ex(('10.77.0.1', 9)); print('ok')"
    r = _netem("-n", "3", "exec", "2", "python3", "-c", code)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_run_tears_down_even_when_command_fails():
    r = _netem("--rate", "none", "run", "bash", "-c",
               f"ip netns list | grep -q '^{PREFIX}-h1' && exit 7")
    assert r.returncode == 7, r.stderr
    assert _our_namespaces() == []


def test_refuses_without_iproute2():
    with tempfile.TemporaryDirectory() as d:
        for tool in ("bash", "id", "awk", "sed", "grep", "seq"):
            path = shutil.which(tool)
            if path:
                os.symlink(path, os.path.join(d, tool))
        env = {"PATH": d}
        r = _netem("up", env=env)
    assert r.returncode != 0
    assert "iproute2" in r.stderr


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv not installed")
def test_refuses_without_root():
    # The unprivileged user gets its own readable copy of the script: the checkout
    # itself may sit in a directory only root can enter (a 0700 home).
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        script = os.path.join(d, "netem.sh")
        shutil.copyfile(NETEM, script)
        os.chmod(script, 0o755)
        r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                            "bash", script, "--prefix", PREFIX, "up"],
                           capture_output=True, text=True, timeout=20, cwd=d)
    assert r.returncode != 0
    assert "needs root" in r.stderr
    assert _our_namespaces() == []


def test_rejects_bad_rate():
    r = _netem("--rate", "fast", "up")
    assert r.returncode != 0 and "--rate" in r.stderr
    assert _our_namespaces() == []


def test_bench_collectives_times_every_group_and_op(tmp_path):
    """scripts/bench/bench_collectives.py on 2 hosts x 2 ranks: a rate per group, op and size,
    the shaped link slower than a host's loopback."""
    import json
    import sys

    out = tmp_path / "links.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_collectives.py"),
                        "--nodes", "2", "--per-node", "2", "--rate", "100mbit",
                        "--sizes", "0.05", "0.5", "--reps", "2", "--gap-ms", "0",
                        "--ops", "all_reduce", "p2p", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    tab = rep["collectives"]
    assert set(tab) == {"world", "node", "replica"}
    for g in tab.values():
        assert set(g) == {"all_reduce", "p2p"}
        for rows in g.values():
            assert [s for s, _ in rows] == [int(0.05 * 2 ** 20), int(0.5 * 2 ** 20)]
            assert all(rate > 0 for _, rate in rows)
    assert tab["node"]["all_reduce"][1][1] > 2 * tab["replica"]["all_reduce"][1][1]
    assert "| replica | p2p |" in r.stdout and "measured" in rep["link_measured"]
