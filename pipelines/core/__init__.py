"""The machinery every converter shares: the converter protocol, flags, inputs, the sink, launching.

A converter author imports from here (docs/architecture.md):

- `Converter`, `OutputPlan`, `Records`, `Files`: the protocol (converter.py);
- `UnitConverter`, `ConvertUnits`: per-unit conversion on the workers;
- `CommonConfig`, `ConverterOptions` and the flag helpers (flags.py);
- `ListFiles`, `InputFile`, `ReadPolicy`, `Unreadable` (inputs.py);
- `Record`, `Reject`, `InputSummary`, `OutputSpec`, `WriteOutput` (sink.py);
- `UsageError`, `InputDataError` (errors.py); `launch.run` / `launch.main`.
"""

from pipelines.core import emulator
from pipelines.core.converter import (
    ConvertUnits, Converter, Event, Files, OutputPlan, Records, UnitConverter, summary_of)
from pipelines.core.errors import InputDataError, UsageError
from pipelines.core.flags import CommonConfig, ConverterOptions, bool_flag, int_flag, seconds_flag
from pipelines.core.inputs import InputFile, ListFiles, ReadPolicy, TransientInputError, Unreadable, printable
from pipelines.core.sink import CommitFiles, InputSummary, OutputSpec, Record, Reject, WriteOutput

# Runs wherever the pipelines' code is loaded: the launcher and every worker
# process that unpickles one of the converters' DoFns.
emulator.use_anonymous_credentials()

__all__ = [
    "CommitFiles", "CommonConfig", "ConvertUnits", "Converter", "ConverterOptions", "Event", "Files", "InputDataError",
    "InputFile", "InputSummary", "ListFiles", "OutputPlan", "OutputSpec", "ReadPolicy", "Record", "Records",
    "Reject", "TransientInputError", "UnitConverter", "Unreadable", "UsageError", "WriteOutput", "bool_flag",
    "int_flag", "printable", "seconds_flag", "summary_of",
]
