"""Pure scheduling core and the async pipeline, written only against protocols.

Nothing here reads wall time or imports torch: the same objects run in the engine (real
clock, real device) and in the simulator (virtual clock, virtual device).
"""
