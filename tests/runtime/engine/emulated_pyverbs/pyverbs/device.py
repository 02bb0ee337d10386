import os
from types import SimpleNamespace

from pyverbs.addr import GID


def get_device_list():
    return [SimpleNamespace(name=b"emu0")]


def _text(raw):
    return ":".join(raw.hex()[i:i + 4] for i in range(0, 32, 4))


class Context:
    def __init__(self, name):
        assert name == "emu0", name
        self.name = name

    def query_device(self):
        return SimpleNamespace(phys_port_cnt=1, max_qp_rd_atom=16, max_qp_init_rd_atom=16)

    def query_port(self, port):
        assert port == 1, port
        return SimpleNamespace(state=4, link_layer=2, lid=0, active_mtu=5, max_msg_sz=1 << 20, gid_tbl_len=3)

    def query_gid(self, port, index):
        """0: unset; 1: a RoCE v1 link-local GID; 2: the RoCE v2 IPv4-mapped one, carrying this pid."""
        pid = os.getpid().to_bytes(4, "big")
        return GID(_text([bytes(16), b"\xfe\x80" + bytes(10) + pid, bytes(10) + b"\xff\xff" + pid][index]))

    def query_gid_type(self, port, index):
        return 1 if index == 2 else 0

    def close(self):
        pass
