"""The machinery every converter shares: the converter protocol, flags, inputs, the record path, launching.

A converter author imports from here (docs/architecture.md):

- `Converter`, `OutputPlan`, `Sources`, `ListedFile`, `Units`, `Found`, `Files`: the protocol and its
  hooks (converter.py);
- `UnitConverter`: one unit → records, rejects, events, on the workers; `PlanUnit` (shards.py);
- `Record`, `Reject`, `Event`, `InputSummary`: what units become (records.py);
- `CommonConfig`, `ConverterOptions` (flags.py);
- `InputFile`, `ReadPolicy`, `Unreadable`, `TransientInputError`, `printable` (inputs.py);
- `UsageError`, `InputDataError` (errors.py); `launch.run` / `launch.main`.
"""

from pipelines.core import emulator
from pipelines.core.converter import Converter, Files, Found, ListedFile, OutputPlan, Sources, UnitConverter, Units
from pipelines.core.errors import InputDataError, UsageError
from pipelines.core.flags import CommonConfig, ConverterOptions
from pipelines.core.inputs import InputFile, ReadPolicy, TransientInputError, Unreadable, printable
from pipelines.core.records import Event, InputSummary, Record, Reject
from pipelines.core.shards import PlanUnit

# Runs wherever the pipelines' code is loaded: the launcher and every worker
# process that unpickles one of the converters' DoFns.
emulator.use_anonymous_credentials()

__all__ = [
    "CommonConfig", "Converter", "ConverterOptions", "Event", "Files", "Found", "InputDataError", "InputFile",
    "InputSummary", "ListedFile", "OutputPlan", "PlanUnit", "ReadPolicy", "Record", "Reject", "Sources",
    "TransientInputError", "UnitConverter", "Units", "Unreadable", "UsageError", "printable",
]
