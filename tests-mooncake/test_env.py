"""The Mooncake test environment (./dev's .venv-mooncake): the pinned client and master on the CPU
torch, a master that starts and answers on loopback, a raw round trip through registered memory, and
uring_kv from the installed package without pulling Mooncake in."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys

import torch

from uring_kv.integrations.mooncake.local import LocalMaster


def test_mooncake_client_is_the_pinned_one() -> None:
    from importlib.metadata import version

    from mooncake.store import MooncakeDistributedStore

    assert version("mooncake-transfer-engine-non-cuda") == "0.3.13.post1"
    for name in ("setup", "register_buffer", "unregister_buffer", "batch_put_from", "batch_is_exist",
                 "batch_get_into", "batch_remove", "close"):
        assert callable(getattr(MooncakeDistributedStore, name)), name


def test_torch_is_the_cpu_build() -> None:
    assert torch.__version__ == "2.13.0+cpu"
    assert torch.version.cuda is None


def test_uring_kv_does_not_import_mooncake() -> None:
    code = (
        "import sys, uring_kv, uring_kv.integrations\n"
        "assert 'site-packages' in uring_kv.__file__, uring_kv.__file__\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'mooncake'], 'import uring_kv imported mooncake'\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)


def test_master_round_trip_through_registered_memory(master: LocalMaster) -> None:
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", master.metadata_server, 16 << 20, 4 << 20, "tcp", "",
                        master.master_address) == 0
    size = 3 * 4096
    buf = mmap.mmap(-1, size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    try:
        assert client.register_buffer(addr, size) == 0
        payload = os.urandom(4096 - 7)  # an odd size
        buf[:len(payload)] = payload
        assert client.batch_put_from(["rt/a"], [addr], [len(payload)]) == [0]
        assert client.batch_is_exist(["rt/a", "rt/missing"]) == [1, 0]
        got = client.batch_get_into(["rt/a", "rt/missing"], [addr + 4096, addr + 8192], [4096, 4096])
        assert got[0] == len(payload) and got[1] < 0
        assert buf[4096:4096 + len(payload)] == payload
        assert client.unregister_buffer(addr) == 0
    finally:
        client.close()
        del addr
        buf.close()


def test_master_listens_on_loopback_only(master: LocalMaster) -> None:
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.read().splitlines()[1:]]
    ports = {master.rpc_port, master.metadata.port, master.metrics_port}
    listening = [(row[1], int(row[1].split(":")[1], 16)) for row in rows if row[3] == "0A"]  # 0A: LISTEN
    ours = [local for local, port in listening if port in ports]
    assert len(ours) == 3, ours
    assert all(local.startswith("0100007F:") for local in ours), ours  # 127.0.0.1
