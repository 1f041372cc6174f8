"""Sandbox boot: confine this process, then run the model's program (started by sandbox.py).

Runs as `python -I _sandbox_boot.py WORKDIR LIMITS_JSON` in a fresh session. It must not
import grpo_agent: it is the first code in the child and runs with the stdlib only. Order
matters: namespaces need root, so they come first; then privileges are dropped; then the
resource limits (which root could raise again) and the audit hook are set.
"""
import ctypes
import errno
import json
import os
import resource
import runpy
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
NOBODY = 65534
ISOLATION_FAILED_EXIT = 97


def _unshare(flags):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def enter_namespaces():
    """New network namespace (no interfaces up: no network) and, as root, a PID namespace.

    Returns True when the caller must fork so that its child becomes PID 1 of the new PID
    namespace: when PID 1 dies, the kernel kills everything else inside it.
    """
    if os.getuid() == 0:
        _unshare(CLONE_NEWNET | CLONE_NEWPID)
        return True
    _unshare(CLONE_NEWUSER | CLONE_NEWNET)
    return False


def drop_privileges(workdir):
    if os.getuid() == 0:
        for folder, _, files in os.walk(workdir):
            os.chown(folder, NOBODY, NOBODY)
            for name in files:
                os.chown(os.path.join(folder, name), NOBODY, NOBODY)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def set_limits(limits):
    cpu = limits["cpu_s"]
    memory = limits["memory_mb"] * 1024 * 1024
    for name, value in (
        ("RLIMIT_CPU", (cpu, cpu)),  # as PID 1 the program ignores SIGXCPU: the hard limit kills
        ("RLIMIT_AS", (memory, memory)),
        ("RLIMIT_NPROC", (limits["max_processes"],) * 2),
        ("RLIMIT_FSIZE", (limits["max_file_bytes"],) * 2),
        ("RLIMIT_NOFILE", (limits["max_open_files"],) * 2),
        ("RLIMIT_CORE", (0, 0)),
    ):
        resource.setrlimit(getattr(resource, name), value)


def install_audit_hook(workdir):
    """Second layer: refuse sockets and any write/delete/rename outside the work folder."""
    root = os.path.realpath(workdir)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    path_events = {"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown",
                   "os.symlink", "os.link", "os.truncate", "shutil.rmtree", "os.utime"}

    def inside(path):
        if isinstance(path, int):
            return True
        path = os.fsdecode(path)
        full = os.path.realpath(os.path.join(root, path))
        return full == root or full.startswith(root + os.sep) or path in ("/dev/null",)

    def hook(event, args):
        if event.startswith("socket.") and event != "socket.gethostname":
            raise PermissionError(f"sandbox: network access is blocked ({event})")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags & write_flags)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing outside the work folder is blocked ({path})")
        elif event in path_events:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"sandbox: {event} outside the work folder is blocked ({path})")

    sys.addaudithook(hook)


def run_as_namespace_init():
    """Fork: the child goes on as PID 1 of the new namespace; this process relays its status."""
    child = os.fork()
    if child:
        _, status = os.waitpid(child, 0)
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def main():
    workdir, limits = sys.argv[1], json.loads(sys.argv[2])
    try:
        must_fork = enter_namespaces()
    except OSError as exc:
        if limits["require_isolation"]:
            print(f"sandbox: cannot create namespaces ({exc}); refusing to run", file=sys.stderr)
            os._exit(ISOLATION_FAILED_EXIT)
        must_fork = False
    if must_fork:
        run_as_namespace_init()
    drop_privileges(workdir)
    set_limits(limits)
    os.chdir(workdir)
    os.environ["HOME"] = workdir
    sys.path[:0] = [workdir]
    install_audit_hook(workdir)
    sys.argv = ["main.py"]
    runpy.run_path("main.py", run_name="__main__")


if __name__ == "__main__":
    try:
        main()
    except OSError as exc:
        if exc.errno == errno.EAGAIN:
            print(f"sandbox: process limit reached ({exc})", file=sys.stderr)
        raise
