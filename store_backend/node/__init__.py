"""The node service: one store per machine that every local engine process shares.

:mod:`.protocol` holds the control frames and their codec, :mod:`.fdpass` the Unix-socket fd passing
and peer credentials the service and its clients use to share the arena segment.
"""
