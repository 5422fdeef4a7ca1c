"""Progress a person can plan by: records/s, bytes/s and an ETA per stage.

    progress = Progress("pipelines.image_folder", "convert_shards", total_units=6000, processes=2)
    progress.add(units=1)
    progress.add(records=250, bytes_out=12_000_000)

Each stage's figures go two ways:

- **Beam metrics**, in the converter's namespace: counters `<stage>_units`,
  `<stage>_records`, `<stage>_bytes` and gauges `<stage>_planned_units`,
  `<stage>_planned_bytes`. The Dataflow console shows them while the job runs
  (done / planned is the stage's progress) and the launcher's summary line
  reads them back when it ends (`rates_line`).
- **A log line** every `TOOLKIT_PROGRESS_SECONDS` (default 10) seconds from
  each worker process: units done of the plan, records/s, MB/s written, and an
  ETA. The counts are shared by every thread of the process and kept per run
  (the output's generation). The DirectRunner runs a whole job in one process
  unless `--direct_running_mode=multi_processing`, so there the figures are the
  job's. Elsewhere a process sees only its share (Dataflow runs one process per
  vCPU of each worker); its ETA assumes the job's `processes` go at its rate,
  so it is an estimate, labelled as one.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from apache_beam.metrics import Metrics

_log = logging.getLogger(__name__)
_DEFAULT_EVERY_S = 10.0


def _every_s() -> float:
  """`TOOLKIT_PROGRESS_SECONDS`, read when a stage starts (a bad value: the default, with a warning)."""
  text = os.environ.get("TOOLKIT_PROGRESS_SECONDS")
  if text is None:
    return _DEFAULT_EVERY_S
  try:
    value = float(text)
    if value >= 0:
      return value
  except ValueError:
    pass
  _log.warning("TOOLKIT_PROGRESS_SECONDS must be a number of seconds >= 0, got %r: using %g",
               text, _DEFAULT_EVERY_S)
  return _DEFAULT_EVERY_S


class _Shared:
  """One stage's counts in this process, across its threads."""

  def __init__(self):
    self.lock = threading.Lock()
    self.t0 = time.monotonic()
    self.last_log = self.t0
    self.units = self.records = self.bytes = 0


_STAGES: dict[tuple[str, str, str], _Shared] = {}
_STAGES_LOCK = threading.Lock()


def _shared(namespace: str, stage: str, run: str) -> _Shared:
  with _STAGES_LOCK:
    return _STAGES.setdefault((namespace, stage, run), _Shared())


def eta_text(done: int, total: int, rate: float, processes: int) -> str:
  """'ETA 3m20s' from units done in this process, the plan's total and this process's rate (units/s).

  Args:
    done: units done by this process (by all its threads).
    total: units planned for the whole stage (0: unknown).
    rate: this process's units per second.
    processes: how many processes share the stage (1: this process does the whole stage).

  Returns:
    The ETA phrase, or '' when the total or the rate is unknown.
  """
  if total <= 0 or rate <= 0:
    return ""
  processes = max(1, processes)
  remaining = max(0, total - done * processes)
  return f"ETA {_duration(remaining / (rate * processes))}" + (
      f" (if {processes} processes go at this one's rate)" if processes > 1 else "")


def _duration(seconds: float) -> str:
  s = int(round(seconds))
  if s >= 3600:
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
  return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
  """Counts one stage's work in this process; Beam metrics plus a periodic log line with an ETA."""

  def __init__(self, namespace: str, stage: str, total_units: int = 0, total_bytes: int = 0, processes: int = 1,
               run: str = ""):
    self._stage = stage
    self._total_units = total_units
    self._total_bytes = total_bytes
    self._processes = max(1, processes)
    self._every_s = _every_s()
    self._shared = _shared(namespace, stage, run)
    self._units = Metrics.counter(namespace, f"{stage}_units")
    self._records = Metrics.counter(namespace, f"{stage}_records")
    self._bytes = Metrics.counter(namespace, f"{stage}_bytes")
    self._gauge_units = Metrics.gauge(namespace, f"{stage}_planned_units")
    self._gauge_bytes = Metrics.gauge(namespace, f"{stage}_planned_bytes")
    self.set_totals(total_units, total_bytes)

  def has_totals(self) -> bool:
    """Whether the stage's planned totals are known (an ETA can be given)."""
    return bool(self._total_units)

  def set_totals(self, total_units: int, total_bytes: int) -> None:
    """The planned totals, when they become known after the stage started (a plan made on the workers)."""
    self._total_units, self._total_bytes = total_units, total_bytes
    if total_units:
      self._gauge_units.set(total_units)
    if total_bytes:
      self._gauge_bytes.set(total_bytes)

  def add(self, units: int = 0, records: int = 0, bytes_out: int = 0) -> None:
    """Counts work done; logs the stage's rates every `TOOLKIT_PROGRESS_SECONDS`."""
    if units:
      self._units.inc(units)
    if records:
      self._records.inc(records)
    if bytes_out:
      self._bytes.inc(bytes_out)
    s = self._shared
    with s.lock:
      s.units += units
      s.records += records
      s.bytes += bytes_out
      now = time.monotonic()
      if now - s.last_log < self._every_s:
        return
      s.last_log = now
      line = self.line_locked(now)
    _log.info("%s", line)

  def line_locked(self, now: float) -> str:
    """The progress line (the caller holds the shared lock)."""
    s = self._shared
    elapsed = max(now - s.t0, 1e-9)
    rate = s.units / elapsed
    of = f"/{self._total_units}" if self._total_units else ""
    eta = eta_text(s.units, self._total_units, rate, self._processes)
    return (f"{self._stage}: {s.units}{of} units on this worker, {s.records / elapsed:.0f} records/s, "
            f"{s.bytes / elapsed / 1e6:.1f} MB/s written" + (f"; {eta}" if eta else ""))


def rates_line(prog: str, metrics: dict[str, int], seconds: float) -> str:
  """The summary's rates: records/s and MB/s of each stage whose counters the run reported.

  Args:
    prog: the converter's module.
    metrics: {counter name: committed value} (names like `convert_shards_records`).
    seconds: the run's wall time.

  Returns:
    One line, or '' when no stage reported.
  """
  stages = sorted({n.rsplit("_", 1)[0] for n in metrics if n.endswith(("_units", "_records", "_bytes"))
                   and not n.endswith("_planned_units")})
  parts = []
  seconds = max(seconds, 1e-9)
  for stage in stages:
    units, records, nbytes = (metrics.get(f"{stage}_{k}", 0) for k in ("units", "records", "bytes"))
    if not (units or records or nbytes):
      continue
    parts.append(f"{stage} {units} units, {records / seconds:.0f} records/s, {nbytes / seconds / 1e6:.1f} MB/s")
  return f"{prog}: rates over {seconds:.1f}s: " + "; ".join(parts) if parts else ""
