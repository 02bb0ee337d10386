class PyverbsError(Exception):
    pass


class PyverbsRDMAError(PyverbsError):
    pass
