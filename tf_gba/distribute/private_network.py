"""A private network namespace for a local run: its servers unreachable from other hosts.

TF's gRPC servers bind "0.0.0.0:<port>" (tensorflow/core/distributed_runtime/rpc/
grpc_server_lib.cc; ServerDef has no bind address, and no environment variable or gRPC option
changes it), are unauthenticated, and run whatever ops they are sent. A local cluster needs no
other host, so the whole local job (coordinator and servers) moves into a network namespace of its
own with only a loopback interface: the servers still listen on all of its interfaces, but the
namespace has no interface but `lo`. Linux only; the namespace needs CAP_SYS_ADMIN (root) or
unprivileged user namespaces (then the process maps its own uid to root in a new user namespace).

Call `enter()` before any thread starts and before any server or connection exists: the
namespace holds for this process and every process it starts.
"""

import ctypes
import ctypes.util
import errno
import fcntl
import os
import socket
import struct
from typing import Optional

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def _unshare(flags: int) -> Optional[str]:
  libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
  if libc.unshare(flags) != 0:
    return os.strerror(ctypes.get_errno() or errno.EPERM)
  return None


def _loopback_up() -> None:
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = struct.pack("16sH", b"lo", 0)
    flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, request)[:18])[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


def _map_user(uid: int, gid: int) -> None:
  # In a new user namespace the process is "nobody" until its ids are mapped; it keeps its own
  # uid outside (files it writes belong to the user).
  with open("/proc/self/setgroups", "w") as f:
    f.write("deny")
  with open("/proc/self/uid_map", "w") as f:
    f.write(f"0 {uid} 1")
  with open("/proc/self/gid_map", "w") as f:
    f.write(f"0 {gid} 1")


def enter() -> Optional[str]:
  """Moves this process into a new network namespace with loopback up.

  Returns:
    None on success, else why it could not be done (the process's network is unchanged).
  """
  if not hasattr(os, "getuid") or not os.path.exists("/proc/self/ns/net"):
    return "not Linux"
  uid, gid = os.getuid(), os.getgid()
  why = _unshare(_CLONE_NEWNET)
  if why is not None:
    why_user = _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    if why_user is not None:
      return f"creating a network namespace: {why}; with a user namespace: {why_user}"
    try:
      _map_user(uid, gid)
    except OSError as e:
      return f"mapping the user into a user namespace: {e}"
  try:
    _loopback_up()
  except OSError as e:
    # A namespace without a working loopback cannot run the cluster either; nothing to undo, but
    # the caller must know.
    raise RuntimeError(f"bringing loopback up in the private network namespace: {e}") from e
  return None
