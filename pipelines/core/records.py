"""The values every record converter makes and core counts: records, rejects, events, the input summary.

A `UnitConverter` turns one unit of input into `Record`s, `Reject`s and
`Event`s; core writes the records into shards, lists the rejects in the
output's errors/rejected.jsonl and checks, at the end, that records and
rejects account for every input unit the `InputSummary` counted.
"""

from __future__ import annotations

from typing import NamedTuple

METRICS_NAMESPACE = "toolkit"  # Beam counters core keeps for every converter (shards written, records, bytes)


class Record(NamedTuple):
  """One output record: `key` is unique within the split (for example the input path).

  `num_inputs` is how many input units (files, or frames of multi-frame files)
  it was made from, for the accounting Finalize checks.
  """

  split: str
  key: str
  payload: bytes
  num_inputs: int = 1


class Reject(NamedTuple):
  """An input that did not become a record, and why; `units` as in `Record.num_inputs`."""

  input: str
  reason: str
  split: str = ""
  units: int = 1

  def to_json(self) -> dict:
    """The reject's line in errors/rejected.jsonl.

    Returns:
      {"input", "reason", "split"} (`units` is accounting only, not written).
    """
    return {"input": self.input, "reason": self.reason, "split": self.split}


class Event(NamedTuple):
  """Something a unit's conversion noticed that the converter counts for its summary
  (for example "multi_frame"); it is neither a record nor a reject."""

  name: str


class InputSummary(NamedTuple):
  """What a pipeline found in its input, checked against what was written.

  `num_inputs` (input units: files, or frames) must equal the units of the
  records written plus those of the rejects, or Finalize fails the job: an
  input was lost. `warnings` go to the manifest.
  """

  num_inputs: int
  warnings: tuple[str, ...] = ()
