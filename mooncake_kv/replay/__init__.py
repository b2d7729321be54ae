"""Trace replay: request traces through the real store, with offline reference hit ratios.

``trace`` loads traces, ``reference`` computes the maximum and Belady's optimum, ``driver`` replays
through a ``TieredStore``, ``simulate`` is a fast in-memory stand-in for policy exploration,
``experiment`` runs the matrix, ``report`` turns it into JSON, a table and a plot, ``cli`` is
``mooncake-kv replay``.
"""
