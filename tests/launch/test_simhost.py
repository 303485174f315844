"""A simulated host's init and its pids seen from the machine (``simhost``, ``pidns``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_harness.simcluster import pidns, simhost

pytestmark = pytest.mark.timeout(60)


def test_the_private_hosts_file_names_this_host_at_its_address():
    text = simhost.hosts_text("eh1-node3", "10.213.7.13")
    assert "10.213.7.13 eh1-node3\n" in text and text.startswith("127.0.0.1 localhost\n")


def test_exit_codes_read_as_a_shell_reports_them():
    assert simhost.exit_code(3 << 8) == 3
    assert simhost.exit_code(signal.SIGKILL) == 128 + 9


def test_the_command_makes_new_namespaces_around_the_agent(tmp_path):
    cmd = simhost.command("h", "10.0.0.1", tmp_path, ["agent", "--x"])
    assert cmd[:6] == ["unshare", "--pid", "--uts", "--fork", "--mount-proc", "--kill-child"]
    assert cmd[-5:] == ["h", "10.0.0.1", str(tmp_path), "--", "agent", "--x"][-5:]


def test_usage_is_one_line_and_exit_2(capsys):
    assert simhost.main(["h", "10.0.0.1"]) == 2
    assert "usage" in capsys.readouterr().err


@pytest.mark.parametrize(("status", "inner"), [({"NSpid": "1234\t2"}, 2), ({"NSpid": "77"}, 77),
                                               ({}, None)])
def test_a_process_pid_in_its_own_namespace(status, inner):
    assert pidns.inner_pid(status) == inner


@pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root (CI runs as root)")
def test_a_hosts_processes_are_found_and_translated(tmp_path):
    """A real simulated host (no network namespace needed here): its init forks the command,
    which sees itself as pid 2 under its own host name; the machine finds both."""
    cmd = simhost.command("eh-test-host", "10.0.0.1", tmp_path,
                          [sys.executable, "-c", "import os, socket, sys; print(os.getpid(), socket.gethostname(), "
                           "socket.gethostbyname(socket.gethostname()), flush=True); sys.stdin.read()"])
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().split() == ["2", "eh-test-host", "10.0.0.1"]
        init = pidns.init_of(proc.pid)
        assert init is not None and pidns.namespace(init) != pidns.namespace(os.getpid())
        members = pidns.members(pidns.namespace(init))
        assert set(members) == {1, 2} and members[1] == init
        assert os.listdir(tmp_path) == [], "the private hosts file is unlinked once mounted"
    finally:
        proc.communicate("")
    assert proc.returncode == 0
    assert "eh-test-host" not in Path("/etc/hosts").read_text(), "the machine's own hosts file is untouched"
