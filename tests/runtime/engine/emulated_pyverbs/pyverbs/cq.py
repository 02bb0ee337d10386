from collections import deque
from types import SimpleNamespace


def cqe_status_to_str(status):
    return {10: "remote access error"}.get(status, f"status {status}")


class CQ:
    def __init__(self, ctx, cqe):
        self.done = deque()

    def poll(self, num_entries=1):
        return (1, [self.done.popleft()]) if self.done else (0, [])

    def complete(self, status):
        self.done.append(SimpleNamespace(status=status, vendor_err=0))

    def close(self):
        pass
