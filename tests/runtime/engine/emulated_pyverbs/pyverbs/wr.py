class SGE:
    def __init__(self, addr, length, lkey):
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    def __init__(self, wr_id=0, opcode=0, num_sge=0, sg=None, send_flags=0):
        assert num_sge == 1 and len(sg) == 1, (num_sge, sg)
        self.opcode, self.sg = opcode, sg[0]

    def set_wr_rdma(self, rkey, addr):
        self.rkey, self.remote = rkey, addr
