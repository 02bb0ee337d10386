import ctypes
import os
import secrets

from pyverbs.enums import IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_WRITE


def region_file(pid, rkey):
    return os.path.join(os.environ["EMULATED_VERBS_DIR"], f"mr-{pid}-{rkey}")


class MR:
    def __init__(self, pd, length=0, access=0, address=None):
        self._own = None if address else ctypes.create_string_buffer(length)
        self.buf = address or ctypes.addressof(self._own)
        self.lkey = self.rkey = secrets.randbits(32) | 1
        self.length, self.file = length, None
        if access & (IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE):
            self.file = region_file(os.getpid(), self.rkey)
            with open(self.file, "w") as f:
                f.write(f"{self.buf} {length} {access}")

    def close(self):
        if self.file:
            os.unlink(self.file)
        self.file = self._own = None
