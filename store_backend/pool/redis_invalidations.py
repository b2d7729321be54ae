"""The Redis directory's invalidations: one pub/sub listener thread (started at the first subscriber)
that delivers the keys other nodes changed to every subscriber, and a gap (reconnect, missed
messages) as one call, so location caches drop what they may have missed.

A mixin of :class:`~store_backend.pool.directory_redis.RedisDirectory` over its one state (set in
``RedisDirectory.__init__``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis
import redis.exceptions

from store_backend.pool.directory import DirectoryUnavailable, Invalidation

logger = logging.getLogger(__name__)

_SEP = "\x00"  # joins keys in an invalidation message: the one character a key cannot hold


class RedisInvalidations:
    """The invalidation listener of :class:`~store_backend.pool.directory_redis.RedisDirectory` (see the module docstring)."""

    def subscribe(self, fn: Invalidation) -> Callable[[], None]:
        with self._sub_lock:
            self._subscribers.append(fn)
        self._start_listener()

        def unsubscribe() -> None:
            with self._sub_lock:
                try:
                    self._subscribers.remove(fn)
                except ValueError:
                    pass

        return unsubscribe

    def _start_listener(self) -> None:
        with self._sub_lock:
            if self._closed:
                raise DirectoryUnavailable(f"redis directory at {self.address} is closed")
            started = self._sub_thread is None
            if started:
                self._sub_thread = self._workers.start(self._listen, name="mkv-directory-inval")
        # So the first lookups after subscribing can be cached (invalidations_live), and an ACL
        # refusal is logged at start: wait for the first subscription's outcome, bounded.
        self._first_attempt.wait(self._op_timeout_s)

    def invalidations_live(self) -> bool:
        """True while the listener holds the invalidation channel. A cache must not keep entries
        while it is False (nothing would tell it of a remove): CachedDirectory checks it. Additive
        to the Directory Protocol."""
        return self._subscribed

    def _listen(self) -> None:
        channel = f"{self._ns}:inval"
        backoff_s = 0.05
        denied = False  # the ACL refused the channel: logged once as an ERROR, retried quietly
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = self._r.pubsub()
                pubsub.subscribe(channel)
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.2)
                    if msg is None:
                        continue
                    if msg.get("type") == "message":
                        self._deliver(msg["data"].split(_SEP))
                    elif msg.get("type") == "subscribe":
                        # Subscribed (again): what was published before this is unknown.
                        backoff_s = 0.05
                        if denied:
                            logger.warning("redis directory at %s: invalidation channel %r now allowed",
                                           self.address, channel)
                            denied = False
                        self._subscribed = True
                        self._first_attempt.set()
                        self._deliver_gap()
            except Exception as e:  # noqa: BLE001 - any failure: reconnect, never die
                self._subscribed = False
                self._first_attempt.set()
                if self._stop.is_set():
                    break
                if isinstance(e, redis.exceptions.NoPermissionError) or "NOPERM" in str(e):
                    # A configuration error, not an outage: say what is missing, once.
                    if not denied:
                        logger.error("redis directory at %s: user %r may not subscribe to the invalidation "
                                     "channel %r (grant it with the ACL rule '&%s'): location caches of this "
                                     "node cache nothing until it may (%s)", self.address, self._username,
                                     channel, channel, e)
                    denied = True
                    backoff_s = 2.0
                else:
                    # Warn once per outage; the retries of one outage go to debug.
                    logger.log(logging.WARNING if backoff_s <= 0.05 else logging.DEBUG,
                               "redis directory at %s: invalidation channel lost (%s: %s); reconnecting; "
                               "location caches cache nothing meanwhile", self.address, type(e).__name__, e)
                self._stop.wait(backoff_s)
                backoff_s = min(2.0, backoff_s * 2)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:  # noqa: BLE001 - closing a broken connection
                        pass

    def on_gap(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn()`` each time the invalidation channel is (re)subscribed: invalidations
        published before it may have been missed, so a cache should forget everything. Additive to
        the Directory Protocol (CachedDirectory uses it where the inner directory has it); returns
        the unsubscribe function. Starts the subscriber thread like :meth:`subscribe`."""
        with self._sub_lock:
            self._gap_listeners.append(fn)

        def unsubscribe() -> None:
            with self._sub_lock:
                try:
                    self._gap_listeners.remove(fn)
                except ValueError:
                    pass

        self._start_listener()
        return unsubscribe

    def _deliver_gap(self) -> None:
        with self._sub_lock:
            listeners = list(self._gap_listeners)
        for fn in listeners:
            try:
                fn()
            except Exception:
                logger.exception("directory gap listener %r failed", fn)

    def _deliver(self, keys: list[str]) -> None:
        with self._sub_lock:
            subscribers = list(self._subscribers)
        for fn in subscribers:
            try:
                fn(keys)
            except Exception:
                logger.exception("directory invalidation subscriber %r failed", fn)
