"""One retry policy for every network path: what is transient, how long to wait, when to give up.

    policy = retry.Policy(timeout=300)                                # a deadline of 300 s
    data = policy.call(lambda t: fetch(t), what="reading gs://b/o")   # fn(attempt timeout), retried
    blob.upload_from_string(data, if_generation_match=g, retry=policy.named("gs://b/o"))

Transient (`is_transient`): HTTP 408, 429 and 5xx (gcs_media's TransientHTTPError,
google.api_core's errors of those codes, google-cloud-storage's InvalidResponse, requests' HTTPError),
requests' and urllib3's connection, protocol and timeout errors, google-auth's
TransportError, http.client's broken answers, ConnectionError, TimeoutError (socket
timeouts), name-resolution and TLS failures, and the network OSErrors (reset, aborted,
refused, unreachable, broken pipe, stale NFS handle). Never transient: 404, 412, 401
and 403 (gcs_media has already tried a 401 once with refreshed credentials), corrupt
data (CorruptRecordError, a checksum mismatch), a full disk (ENOSPC), and
RetryExhausted itself: a retry that gave up is final, so no level above retries it.

Backoff: the wait before retry n (n = 0, 1, ...) is uniform in [0, min(initial x
multiplier^n, maximum)] ("full jitter": the retries of many workers spread out),
drawn from `rng`. The deadline (`timeout`, seconds from the first attempt) is checked
before each wait: a wait that would end past it ends the retries instead (google.api_core's
rule), and each attempt of `call` gets at most the time left (`attempt_timeout`). With
`attempts`, at most that many attempts are made as well. A policy that gives up raises
`RetryExhausted` (or the subclass it names: pipelines raise TransientInputError) naming
what was tried, how many times, for how long and the last cause; that cause is chained.

Retries happen at one level only: the level that sends one idempotent request (a ranged
read, a page of a listing, an upload, a compose). Everything above it makes one attempt
and passes the error on; nothing catches a RetryExhausted to try again.

google-cloud-storage's own policy is replaced deliberately: every call the toolkit makes
passes `retry=<a Policy>` (a google.api_core Retry, which the client applies to each
request, media uploads and downloads included), so the client retries with this
classifier, backoff and deadline, and gives up with RetryExhausted. The library's
default would retry other errors for its own 120 s and, for writes, only when a
precondition is given. A retried write is idempotent because of what it writes: a
compare-and-swap carries its generation precondition (ifGenerationMatch; a 412 after
a retry is resolved by reading back what is there), and every other write puts the
same bytes under a name that only its writer writes (markers, leases, TFDS files,
composes of the same sources).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import errno
import functools
import http.client
import logging
import math
import random
import socket
import ssl
import sys
import time
from typing import TypeVar

from google.api_core import exceptions as api_exceptions
from google.api_core import retry as api_retry
from google.auth import exceptions as auth_exceptions
import requests
import urllib3

__all__ = ["DEFAULT_DEADLINE_S", "Policy", "RetryExhausted", "default", "is_transient", "named", "set_default",
           "using"]

logger = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 300.0  # how long a transient fault is retried unless a caller says otherwise
INITIAL_S = 0.5  # the first wait's upper bound
MAXIMUM_S = 30.0  # no wait's upper bound grows past this
MULTIPLIER = 2.0
ATTEMPT_TIMEOUT_S = 60.0  # one attempt of `call` waits at most this long (a stalled answer is retried)
_MIN_ATTEMPT_TIMEOUT_S = 1.0  # ... and at least this long, however little of the deadline is left
_CAUSE_CHARS = 300  # of the last cause's message quoted in a RetryExhausted

_NETWORK_ERRNOS = frozenset(
    getattr(errno, n) for n in ("ETIMEDOUT", "ECONNRESET", "ECONNABORTED", "ECONNREFUSED", "EHOSTUNREACH",
                                "ENETUNREACH", "ENETDOWN", "ENETRESET", "EPIPE", "ESTALE") if hasattr(errno, n))
_TRANSIENT_TYPES = (
    ConnectionError, TimeoutError, socket.gaierror, ssl.SSLError,
    http.client.BadStatusLine, http.client.IncompleteRead, http.client.ResponseNotReady,
    requests.exceptions.ConnectionError, requests.exceptions.Timeout, requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError, urllib3.exceptions.PoolError,
    urllib3.exceptions.SSLError, auth_exceptions.TransportError,
)
_T = TypeVar("_T")


class RetryExhausted(ConnectionError):
  """Transient errors lasted past the deadline (or the attempt limit): the operation gave up.

  Attributes:
    what: what was tried ("reading gs://b/o", "gs://b/o: bytes [0, 4096)").
    attempts: how many attempts were made.
    seconds: how long they took, the waits included.
  """

  def __init__(self, message: str, *, what: str = "", attempts: int = 0, seconds: float = 0.0):
    super().__init__(message)
    self.what, self.attempts, self.seconds = what, attempts, seconds


def _status(e: BaseException) -> int | None:
  """The HTTP status of a google-cloud-storage error (gcs_media's are ConnectionErrors or final) or of
  a `requests` answer that raised (the DICOM store's)."""
  if isinstance(e, api_exceptions.GoogleAPICallError):
    return e.code
  if isinstance(e, requests.HTTPError) and e.response is not None:
    return e.response.status_code
  storage = sys.modules.get("google.cloud.storage.exceptions")  # raised only once the client is imported
  if storage is not None and isinstance(e, storage.InvalidResponse):
    return getattr(e.response, "status_code", None)
  return None


def is_transient(e: BaseException) -> bool:
  """Whether a failed request is worth another try (the module docstring lists what is).

  Args:
    e: what the request raised.

  Returns:
    True for a fault of the network or the server that may pass; False for an answer about the object
    (404, 412, 401, 403), corrupt data, a full disk, and a retry that already gave up.
  """
  if isinstance(e, RetryExhausted):
    return False
  status = _status(e)
  if status is not None:
    return status in (408, 429) or 500 <= status < 600
  if isinstance(e, _TRANSIENT_TYPES):
    return True
  return isinstance(e, OSError) and e.errno in _NETWORK_ERRNOS


def _one_line(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:_CAUSE_CHARS]}{'...' if len(text) > _CAUSE_CHARS else ''}"


class Policy(api_retry.Retry):
  """A google.api_core Retry with the toolkit's classifier, full-jitter backoff, deadline and error.

  Pass it to google-cloud-storage calls as `retry=`, or run a call of the toolkit's own with `call`.

  Args:
    predicate: which errors are retried (`is_transient`).
    initial: the first wait's upper bound, seconds.
    maximum: the largest upper bound of a wait, seconds.
    multiplier: how much the bound grows per retry.
    timeout: the deadline, seconds from the first attempt (finite).
    on_error: called with each transient error (google.api_core's hook; see `call`).
    attempts: at most this many attempts (None: until the deadline).
    what: what is tried, for the error (`named` sets it).
    flag: the setting that sets the deadline, for the error (e.g. "--transient_retry_seconds").
    error: the RetryExhausted subclass raised when it gives up.
    rng: the random source of the waits (a seeded random.Random makes them reproducible).
  """

  def __init__(self, predicate: Callable[[BaseException], bool] = is_transient, initial: float = INITIAL_S,
               maximum: float = MAXIMUM_S, multiplier: float = MULTIPLIER, timeout: float = DEFAULT_DEADLINE_S,
               on_error: Callable[[BaseException], object] | None = None, *, attempts: int | None = None,
               what: str = "", flag: str = "", error: type[RetryExhausted] = RetryExhausted,
               rng: random.Random | None = None, **kwargs):
    super().__init__(predicate, initial, maximum, multiplier, timeout, on_error, **kwargs)
    if self._timeout is None or not 0 <= self._timeout < math.inf:
      raise ValueError(f"timeout must be a finite number of seconds >= 0, got {self._timeout!r}")
    if not 0 <= initial <= maximum or multiplier < 1:
      raise ValueError(f"need 0 <= initial <= maximum and multiplier >= 1, got initial={initial!r}, "
                       f"maximum={maximum!r}, multiplier={multiplier!r}")
    if attempts is not None and (not isinstance(attempts, int) or attempts < 1):
      raise ValueError(f"attempts must be an integer >= 1 or None, got {attempts!r}")
    if not issubclass(error, RetryExhausted):
      raise ValueError(f"error must be a RetryExhausted subclass, got {error!r}")
    self._attempts, self._what, self._flag, self._error, self._rng = attempts, what, flag, error, rng

  def replace(self, **changes) -> Policy:
    """A copy with `changes` (any of the constructor's arguments)."""
    settings = {"predicate": self._predicate, "initial": self._initial, "maximum": self._maximum,
                "multiplier": self._multiplier, "timeout": self._timeout, "on_error": self._on_error,
                "attempts": self._attempts, "what": self._what, "flag": self._flag, "error": self._error,
                "rng": self._rng}
    return type(self)(**{**settings, **changes})

  def with_timeout(self, timeout: float) -> Policy:
    """A copy with another deadline (google.api_core's interface)."""
    return self.replace(timeout=timeout)

  def with_predicate(self, predicate: Callable[[BaseException], bool]) -> Policy:
    """A copy that retries what `predicate` accepts (google.api_core's interface)."""
    return self.replace(predicate=predicate)

  def with_delay(self, initial: float | None = None, maximum: float | None = None,
                 multiplier: float | None = None) -> Policy:
    """A copy with other waits (google.api_core's interface)."""
    return self.replace(initial=self._initial if initial is None else initial,
                         maximum=self._maximum if maximum is None else maximum,
                         multiplier=self._multiplier if multiplier is None else multiplier)

  def named(self, what: str, error: type[RetryExhausted] | None = None) -> Policy:
    """A copy whose error names `what` (e.g. "listing gs://b/x/"), and is `error` when given."""
    return self.replace(what=what, error=error or self._error)

  @property
  def initial(self) -> float:
    """The first wait's upper bound, seconds."""
    return self._initial

  @property
  def maximum(self) -> float:
    """The largest upper bound of a wait, seconds."""
    return self._maximum

  @property
  def attempts(self) -> int | None:
    """The most attempts made (None: as many as the deadline allows)."""
    return self._attempts

  def delays(self) -> Iterator[float]:
    """The waits before retry 0, 1, ...: uniform in [0, min(initial x multiplier^n, maximum)]."""
    rng = self._rng or random  # the module's by default (a policy stays picklable)
    bound = min(self._initial, self._maximum)
    while True:
      yield rng.uniform(0.0, bound)
      bound = min(bound * self._multiplier, self._maximum)

  def attempt_timeout(self, remaining: float | None = None) -> float:
    """Seconds one attempt may wait for an answer: ATTEMPT_TIMEOUT_S, at most `remaining` (default the whole
    deadline), at least 1 s."""
    left = self._timeout if remaining is None else remaining
    return max(_MIN_ATTEMPT_TIMEOUT_S, min(ATTEMPT_TIMEOUT_S, left))

  def call(self, fn: Callable[[float], _T], what: str | None = None,
           on_error: Callable[[BaseException], object] | None = None) -> _T:
    """`fn(timeout)` until it returns or raises an error that is not transient.

    Args:
      fn: one attempt, given the seconds it may wait for an answer (`attempt_timeout` of the time left).
      what: what `fn` does, for the error (default: the policy's `what`).
      on_error: called with each transient error before its wait is drawn, the one after which the deadline
        ends the retries included (google.api_core's order); default: the policy's.

    Returns:
      What `fn` returned.

    Raises:
      RetryExhausted: (the policy's `error`) transient errors until the deadline or the attempt limit.
      Exception: an error that is not transient, from `fn` unchanged.
    """
    deadline = time.monotonic() + self._timeout
    return self._run(lambda: fn(self.attempt_timeout(deadline - time.monotonic())), what, on_error)

  def __call__(self, func: Callable[..., _T], on_error: Callable[[BaseException], object] | None = None
               ) -> Callable[..., _T]:
    """`func` wrapped to retry under this policy (what google-cloud-storage does with `retry=`)."""

    @functools.wraps(func)
    def retried(*args, **kwargs):
      return self._run(functools.partial(func, *args, **kwargs), None, on_error)

    return retried

  def _run(self, target: Callable[[], _T], what: str | None, on_error) -> _T:
    """google.api_core's retry loop, with this policy's waits, attempt limit and error."""
    what = what if what is not None else self._what
    on_error = self._on_error if self._on_error is not None else on_error
    started, tried = time.monotonic(), [0]

    def retryable(e: BaseException) -> bool:
      tried[0] += 1
      return self._predicate(e) and (self._attempts is None or tried[0] < self._attempts)

    def retrying(e: BaseException) -> None:
      logger.debug("%s: attempt %d: %s; retrying", what or "a request", tried[0], _one_line(e))
      if on_error is not None:
        on_error(e)

    def give_up(errors: list[BaseException], reason, timeout) -> tuple[BaseException, BaseException | None]:
      last = errors[-1]
      if reason != api_retry.RetryFailureReason.TIMEOUT and not self._predicate(last):
        return last, last.__cause__  # not transient: raised unchanged
      return self._exhausted(what, len(errors), time.monotonic() - started, last), last

    return api_retry.retry_target(target, retryable, self.delays(), timeout=self._timeout, on_error=retrying,
                                  exception_factory=give_up)

  def _exhausted(self, what: str, attempts: int, seconds: float, last: BaseException) -> RetryExhausted:
    limit = f"the {self._timeout:g} s deadline" + (f" ({self._flag})" if self._flag else "")
    if self._attempts is not None and attempts >= self._attempts:
      limit = f"the limit of {self._attempts} attempts"
    message = (f"{what or 'a request'}: failed {attempts} time{'s' if attempts != 1 else ''} in {seconds:.1f} s, "
               f"transient errors persisted past {limit}; last: {_one_line(last)}")
    return self._error(message, what=what, attempts=attempts, seconds=seconds)


_default = Policy()


def default() -> Policy:
  """The process's policy for calls that are given none (the formats layer's writes, listings and deletes)."""
  return _default


def named(what: str) -> Policy:
  """The process's policy, naming `what` in its error."""
  return _default.named(what)


def set_default(policy: Policy) -> Policy:
  """Makes `policy` the process's default (a launcher sets its deadline flag here); returns the previous one."""
  global _default
  if not isinstance(policy, Policy):
    raise TypeError(f"the default must be a retry.Policy, got {type(policy).__name__}")
  previous, _default = _default, policy
  return previous


@contextlib.contextmanager
def using(policy: Policy) -> Iterator[Policy]:
  """The process's default is `policy` inside the block (every thread's: it is the process's setting).

      with retry.using(retry.Policy(initial=0.001, maximum=0.01, timeout=0.5)):
        commit.commit(...)
  """
  previous = set_default(policy)
  try:
    yield policy
  finally:
    set_default(previous)
