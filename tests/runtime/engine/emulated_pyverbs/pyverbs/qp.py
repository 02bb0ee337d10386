import ctypes
import itertools
import os
import secrets

from pyverbs.enums import (IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE, IBV_WC_REM_ACCESS_ERR, IBV_WC_SUCCESS,
                           IBV_WR_RDMA_READ)
from pyverbs.mr import region_file
from pyverbs.pyverbs_error import PyverbsRDMAError

_numbers = itertools.count(secrets.randbelow(1 << 23))  # queue pair numbers differ between processes


class _iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
for _move in (_libc.process_vm_readv, _libc.process_vm_writev):
    _move.restype = ctypes.c_ssize_t


def _qp_file(pid, qpn):
    return os.path.join(os.environ["EMULATED_VERBS_DIR"], f"qp-{pid}-{qpn}")


class QPCap:
    def __init__(self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1, max_inline_data=0):
        pass


class QPInitAttr:
    def __init__(self, qp_type=0, qp_context=None, scq=None, rcq=None, srq=None, cap=None, sq_sig_all=1):
        self.scq = scq


class QPAttr:
    def __init__(self, qp_state=1, cur_qp_state=0, port_num=1, path_mtu=3):
        self.port_num, self.path_mtu = port_num, path_mtu


class QP:
    def __init__(self, pd, init_attr):
        self.qp_num, self.cq, self.file = next(_numbers), init_attr.scq, None

    def to_rts(self, attr):
        gid = bytes.fromhex(attr.ah_attr.gr.dgid.gid.replace(":", ""))
        self.peer, self.peer_qpn, self.access = int.from_bytes(gid[12:], "big"), attr.dest_qp_num, attr.qp_access_flags
        self.file = _qp_file(os.getpid(), self.qp_num)
        with open(self.file, "w") as f:
            f.write(f"{self.peer} {self.peer_qpn} {self.access}")

    def post_send(self, wr):
        if self.file is None:
            raise PyverbsRDMAError("Failed to post send: the queue pair is not connected")
        self.cq.complete(IBV_WC_SUCCESS if self._move(wr) else IBV_WC_REM_ACCESS_ERR)

    def _move(self, wr):
        reading = wr.opcode == IBV_WR_RDMA_READ
        try:
            with open(_qp_file(self.peer, self.peer_qpn)) as f:
                back, back_qpn, access = map(int, f.read().split())
            with open(region_file(self.peer, wr.rkey)) as f:
                start, length, allowed = map(int, f.read().split())
        except FileNotFoundError:
            return False
        need = IBV_ACCESS_REMOTE_READ if reading else IBV_ACCESS_REMOTE_WRITE
        if (back, back_qpn) != (os.getpid(), self.qp_num) or not access & allowed & need:
            return False
        if not start <= wr.remote and wr.remote + wr.sg.length <= start + length:
            return False
        local, remote = _iovec(wr.sg.addr, wr.sg.length), _iovec(wr.remote, wr.sg.length)
        move = _libc.process_vm_readv if reading else _libc.process_vm_writev
        return move(self.peer, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == wr.sg.length

    def close(self):
        if self.file:
            os.unlink(self.file)
        self.file = None
