class PD:
    def __init__(self, ctx):
        self.ctx = ctx
