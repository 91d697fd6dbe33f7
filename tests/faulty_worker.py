"""A ModelWorker whose device ops fail for rows whose prompt holds a poison token (tests)."""
from specsched.runtime.worker import ModelWorker

POISON = 3


class FaultyWorker(ModelWorker):
    def execute(self, op, batch):
        for reg in getattr(batch, "register", ()):
            if POISON in reg.token_ids:
                self._poisoned = True
        if op == "forward" and getattr(self, "_poisoned", False):
            self._poisoned = False
            raise RuntimeError("injected device failure")
        return super().execute(op, batch)


class BrokenWorker(ModelWorker):
    """Every target forward fails (a device that starts but cannot serve)."""

    def execute(self, op, batch):
        if op == "forward":
            raise RuntimeError("injected device failure")
        return super().execute(op, batch)
