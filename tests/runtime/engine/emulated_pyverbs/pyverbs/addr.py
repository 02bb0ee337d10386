class GID:
    def __init__(self, val):
        assert len(val.split(":")) == 8, val
        self.gid = val


class GlobalRoute:
    def __init__(self, dgid=None, flow_label=0, sgid_index=0, hop_limit=1, traffic_class=0):
        self.dgid, self.sgid_index = dgid, sgid_index


class AHAttr:
    def __init__(self, dlid=0, sl=0, src_path_bits=0, static_rate=0, is_global=0, port_num=1, gr=None):
        assert is_global and gr is not None and gr.sgid_index == 2, "RoCE needs the v2 GID's route"
        self.gr = gr
