"""What the UCX tests share: whether libucp can be loaded here (else the reason to skip), and the settings
that force rvod's links between hosts onto UCX restricted to its TCP and loopback transports (UCX_TLS),
which is how UCX is tested on machines without InfiniBand or RoCE. Not its shared memory: the simulated
hosts share one kernel, so UCX takes their ranks for one machine's and, without its peer error handling
(which rvod leaves off where UCX has no RDMA, see transport/ucx/library.rs), would pick shared memory
between network namespaces, whose wake-ups do not cross them; ranks on real machines never share memory."""

from __future__ import annotations


def skip_reason() -> str | None:
    """Why the UCX tests cannot run here, or None. scripts/setup-system.sh installs libucx0."""
    try:
        from rvod._rvod import ucx_library
    except ImportError as error:
        return f"the native extension is not built: {error}"
    found = ucx_library()
    if found["version"] is None:
        return f"UCX cannot be loaded here: {found['error']} (scripts/setup-system.sh installs libucx0)"
    return None


SETTINGS = {"RVOD_TRANSPORT": "ucx", "UCX_TLS": "tcp,self"}
