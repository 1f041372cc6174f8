"""Command-agent boot: confine this process, then exec the agent's command (started by
`grpo_agent.rollout.command_sandbox`).

Runs as `python -I -S _agent_boot.py LIMITS_JSON COMMAND...` in a fresh session, stdlib only.
With `network == "gateway"` it enters a new network namespace (and, as root, a new PID
namespace), brings its loopback up and forks: this process stays outside as a relay that
accepts on 127.0.0.1:PORT inside the namespace and forwards each connection to the gateway's
Unix socket (a path in the file system, reachable from any network namespace), so the agent
can reach the gateway and nothing else. The child (PID 1 of the new PID namespace: when it
exits, the kernel kills whatever it left behind) drops to `user` when one is given, sets the
rlimits and execs the command.
"""
import asyncio
import ctypes
import fcntl
import json
import os
import pwd
import resource
import signal
import socket
import struct
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PR_SET_PDEATHSIG = 1
ISOLATION_FAILED_EXIT = 97


def unshare(flags):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def loopback_up():
    """A new network namespace has `lo` down; the relay listens on it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


async def _pump(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        try:
            writer.write_eof()
        except OSError:
            pass


async def _relay(listener, unix_path, child):
    """Forward each connection to the gateway's socket until the child exits; its status."""
    async def connect(reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(unix_path)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        writer.close()
        up_writer.close()

    if unix_path:
        await asyncio.start_server(connect, sock=listener)
    while True:  # single-threaded: a process that unshared its PID namespace cannot start threads
        pid, status = os.waitpid(child, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG never blocks
        if pid:
            return status
        await asyncio.sleep(0.05)


def relay_then_wait(limits):
    """Listen on the gateway's port inside the namespace, fork the agent, relay until it exits."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", limits["gateway_port"]))
    listener.listen(64)
    child = os.fork()
    if child == 0:
        listener.close()
        return
    status = asyncio.run(_relay(listener, limits.get("gateway_socket"), child))
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def drop_to(user, home):
    entry = pwd.getpwnam(user)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)


def set_limits(limits):
    memory = limits["memory_mb"] * 1024 * 1024
    values = [("RLIMIT_AS", memory), ("RLIMIT_FSIZE", limits["max_file_bytes"]),
              ("RLIMIT_NOFILE", limits["max_open_files"]), ("RLIMIT_CORE", 0),
              ("RLIMIT_CPU", limits["cpu_s"])]
    if limits.get("user"):  # RLIMIT_NPROC counts every process of the user: only a dedicated one
        values.append(("RLIMIT_NPROC", limits["max_processes"]))
    for name, value in values:
        resource.setrlimit(getattr(resource, name), (value, value))


def die_with_parent():
    """SIGKILL when the parent dies (a killed rollout worker must not leave agents running).
    Cleared by fork and by a change of user, so each process that needs it sets it."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def main():
    limits, command = json.loads(sys.argv[1]), sys.argv[2:]
    die_with_parent()
    if limits["network"] == "gateway":
        root = os.getuid() == 0
        try:
            unshare(CLONE_NEWNET | (CLONE_NEWPID if root else CLONE_NEWUSER))
            loopback_up()
        except OSError as exc:
            print(f"agent sandbox: cannot create a network namespace ({exc}); run as root or "
                  "allow unprivileged user namespaces, or set network='any' in the command's "
                  "limits", file=sys.stderr)
            os._exit(ISOLATION_FAILED_EXIT)
        relay_then_wait(limits)
    if limits.get("user"):
        drop_to(limits["user"], limits["home"])
    die_with_parent()  # the relay's child, or after the user change
    set_limits(limits)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"agent sandbox: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        os._exit(127)


if __name__ == "__main__":
    main()
