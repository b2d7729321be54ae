"""The pool across nodes: a directory of where every object lives (embedded or Redis), a transport
between node services (TCP), and the pool tier that a node's store reads through on a local miss."""
