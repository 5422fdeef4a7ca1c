"""`pipelines.core.converter.ConvertUnits`: a unit converter's Records, Rejects and Events reach
their own outputs (a TestPipeline, no files)."""

from __future__ import annotations

import apache_beam as beam
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from pipelines.core.converter import ConvertUnits, Event, UnitConverter
from pipelines.core.sink import Record, Reject


class _Numbers(UnitConverter):
  """Even numbers become records, odd ones rejects; multiples of 3 also raise an event."""

  def __init__(self):
    self.ready = False

  def setup(self):
    self.ready = True

  def convert(self, unit, offset=0):
    assert self.ready, "setup runs before the first unit"
    if unit % 3 == 0:
      yield Event("triple")
    if unit % 2:
      yield Reject(f"n{unit}", "odd", "train")
    else:
      yield Record("train", f"n{unit}", str(unit + offset).encode())


def test_records_rejects_and_events_go_to_their_outputs():
  with TestPipeline() as p:
    out = p | beam.Create(range(7)) | ConvertUnits(_Numbers(), "tests.numbers")
    assert_that(out.records, equal_to([Record("train", f"n{i}", str(i).encode()) for i in (0, 2, 4, 6)]),
                label="Records")
    assert_that(out.rejects, equal_to([Reject(f"n{i}", "odd", "train") for i in (1, 3, 5)]), label="Rejects")
    assert_that(out.events, equal_to([Event("triple")] * 3), label="Events")


def test_side_inputs_are_passed_to_convert_by_name():
  with TestPipeline() as p:
    offset = p | "Offset" >> beam.Create([100])
    out = p | beam.Create([2, 4]) | ConvertUnits(_Numbers(), "tests.numbers",
                                                 offset=beam.pvalue.AsSingleton(offset))
    assert_that(out.records, equal_to([Record("train", "n2", b"102"), Record("train", "n4", b"104")]))
