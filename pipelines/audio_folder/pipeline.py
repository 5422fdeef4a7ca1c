"""Folders of WAV clips → ArrayRecord or TFRecord shards, one fixed-length clip per record.

    python -m pipelines.audio_folder --input=DIR_OR_GS --output=DIR_OR_GS --sample_rate=16000 \
        --clip_seconds=1 [--channels=1] [--audio_dtype=int16|float32] [--fit=pad_or_crop|exact] [any shared flag]

The input is `<input>/<split>/<class>/.../*.wav` (Speech Commands, ESC-50 and
most keyword-spotting sets sorted by folder). Class names, sorted, give the label
ids. Every clip becomes `--clip_seconds` × `--sample_rate` samples of
`--channels` channels (static shapes: XLA compiles once): shorter clips are
zero-padded at the end and longer ones cut (`--fit=pad_or_crop`), or rejected
(`--fit=exact`). A clip at another sample rate or channel count, a file that is
not a PCM WAV, a 24- or 32-bit clip with `--audio_dtype=int16` (it would lose bits) and
files outside a class folder are rejects with the reason. Each record holds
`audio` ([samples, channels]), `num_samples` (the samples of the clip before
padding or cutting, so a model can mask the padding), `label` and `file_name`.
The record kind is `tensors` (formats.kinds). docs/audio_folder.md.
"""

from __future__ import annotations

import dataclasses
import io
import os
import wave

from apache_beam.options.pipeline_options import PipelineOptions
import numpy as np

from formats.features import ClassLabel, Features, Tensor, Text
from formats.storage import files as fs
from pipelines.core import flags, inputs
from pipelines.core.converter import Converter, FileUnits, OutputPlan, Sources, UnitConverter
from pipelines.core.errors import UsageError
from pipelines.core.flags import CommonConfig
from pipelines.core.records import Reject

NAME = "audio_folder"
PIPELINE = f"pipelines.{NAME}"
DTYPES = ("int16", "float32")
FITS = ("pad_or_crop", "exact")


class AudioFolderOptions(PipelineOptions):
  """Flags of `pipelines.audio_folder` beyond the shared ones (`core.flags.ConverterOptions`)."""

  @classmethod
  def _add_argparse_args(cls, parser):
    parser.add_argument("--sample_rate", type=flags.integer(minimum=1), default=None,
                        help="Hz every clip must have (required); clips at another rate are rejects.")
    parser.add_argument("--clip_seconds", type=flags.fraction(0, 3600), default=None,
                        help="Seconds of audio per record (required): sample_rate x clip_seconds samples.")
    parser.add_argument("--channels", type=flags.integer(minimum=1, maximum=64), default=1,
                        help="Channels every clip must have.")
    parser.add_argument("--audio_dtype", choices=DTYPES, default="int16",
                        help="int16 (16-bit PCM kept as is) or float32 (any PCM width, scaled to [-1, 1]).")
    parser.add_argument("--fit", choices=FITS, default="pad_or_crop",
                        help="pad_or_crop: zero-pad short clips, cut long ones; exact: reject clips of another length.")


@dataclasses.dataclass(frozen=True)
class AudioFolderConfig:
  """The audio converter's own flags, checked."""

  sample_rate: int
  clip_samples: int
  channels: int = 1
  dtype: str = "int16"
  fit: str = "pad_or_crop"


def read_clip(data: bytes, config: AudioFolderConfig) -> tuple[np.ndarray, int]:
  """The clip in WAV bytes as [clip_samples, channels] of `config.dtype`, and its length before fitting.

  Args:
    data: the bytes of one file.
    config: the sample rate, length, channels, dtype and fit every clip must have.

  Returns:
    (the samples, the clip's own sample count).

  Raises:
    ValueError: the reason the file is a reject (never a value from the file but its format's numbers).
  """
  try:
    with wave.open(io.BytesIO(data)) as w:
      rate, channels, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
      frames = w.readframes(n)
  except (wave.Error, EOFError, RuntimeError) as e:  # RuntimeError: a chunk whose size runs past the file
    reason = str(e)
    raise ValueError("not a PCM WAV file" + (" (compressed or extensible format)" if "unknown format" in reason else "")
                     ) from None
  if rate != config.sample_rate:
    raise ValueError(f"sample rate {rate} Hz is not --sample_rate {config.sample_rate}")
  if channels != config.channels:
    raise ValueError(f"{channels} channels, not --channels {config.channels}")
  if width not in (1, 2, 3, 4):
    raise ValueError(f"sample width {8 * width} bits is not PCM")
  if config.dtype == "int16" and width != 2:
    raise ValueError(f"{8 * width}-bit samples: --audio_dtype=int16 keeps 16-bit clips only "
                     "(use --audio_dtype=float32)")
  num = len(frames) // (width * channels)  # a truncated file holds fewer frames than its header says
  if num == 0:
    raise ValueError("no samples")
  if config.fit == "exact" and num != config.clip_samples:
    raise ValueError(f"{num} samples, not {config.clip_samples} (--fit=exact)")
  samples = _pcm(frames[:num * width * channels], width).reshape(num, channels)
  if config.dtype == "float32":
    samples = samples.astype(np.float32) / float(1 << (8 * width - 1))
  out = np.zeros((config.clip_samples, channels), dtype=config.dtype)
  keep = min(num, config.clip_samples)
  out[:keep] = samples[:keep]
  return out, num


def _pcm(frames: bytes, width: int) -> np.ndarray:
  """Little-endian PCM → signed integers (8-bit WAV is unsigned, offset by 128; 24-bit widened to int32)."""
  if width == 1:
    return np.frombuffer(frames, np.uint8).astype(np.int16) - 128
  if width == 3:
    b = np.frombuffer(frames, np.uint8).reshape(-1, 3).astype(np.int32)
    v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    return np.where(v & 0x800000, v - (1 << 24), v)
  return np.frombuffer(frames, {2: "<i2", 4: "<i4"}[width])


class _ClipUnits(FileUnits):
  """((split, class name), InputFile) → a Record of the clip, or a Reject naming the file and the reason."""

  def __init__(self, root: str, class_names, features: Features, config: AudioFolderConfig,
               read_policy: inputs.ReadPolicy):
    super().__init__(root, read_policy)
    self._labels = {c: i for i, c in enumerate(class_names)}
    self._features = features
    self._config = config

  def payload(self, key, rel: str, data: bytes) -> bytes:
    samples, num = read_clip(data, self._config)
    return self._features.encode({"audio": samples, "num_samples": num, "label": self._labels[key[1]],
                                  "file_name": rel})


@dataclasses.dataclass(frozen=True)
class _Layout:
  """The split folders and their class folders, found at launch (small: shipped to the workers)."""

  classes: dict  # split -> class folder names
  class_names: tuple[str, ...]


class AudioFolder(Converter, name=NAME, kind="tensors", options=AudioFolderOptions,
                  input_kind="a folder of split folders holding class folders of WAV clips"):
  """Folders of WAV clips → shards of (audio, num_samples, label, file_name) records of one static shape."""

  def configure(self, o: AudioFolderOptions, common: CommonConfig) -> AudioFolderConfig:
    """See Converter.configure: --sample_rate and --clip_seconds are required, and the clip they make must
    hold a sample."""
    del common
    if o.sample_rate is None or o.clip_seconds is None:
      raise UsageError("--sample_rate and --clip_seconds are required (for example --sample_rate=16000 "
                       "--clip_seconds=1)")
    clip_samples = round(o.sample_rate * o.clip_seconds)
    if clip_samples < 1:
      raise UsageError(f"--clip_seconds {o.clip_seconds} at --sample_rate {o.sample_rate} holds no sample")
    return AudioFolderConfig(o.sample_rate, clip_samples, o.channels, o.audio_dtype, o.fit)

  def plan(self, common: CommonConfig, config: AudioFolderConfig) -> OutputPlan:
    """See Converter.plan: the split folders and their class folders (two levels listed here).

    Args:
      common: its `input` is listed.
      config: the clip's shape and dtype.

    Raises:
      UsageError: no split folder holds a class folder, or a split folder's name is not a valid split name.
    """
    root = common.input
    dirs, files, others = inputs.scan_input(root)
    strays = [fs.join(root, n) for n in [*files, *(d for d in dirs if inputs.printable(d) != d)]]
    odd = [(fs.join(root, n), reason) for n, reason in others]
    classes = {}
    splits = [d for d in dirs if inputs.printable(d) == d]
    for split in splits:
      inputs.split_folder(split)
      try:  # no two class folders of the whole input may overlap
        sub_dirs, sub_files, sub_others = inputs.scan_level(
            fs.join(root, split), root, [os.path.realpath(fs.join(root, d)) for d in dirs if d != split])
      except OSError as e:
        odd.append((fs.join(root, split), inputs.unreadable_folder(e)))
        continue
      strays += [fs.join(root, split, n) for n in sub_files]
      odd += [(fs.join(root, split, n), reason) for n, reason in sub_others]
      classes[split] = sub_dirs
    names = tuple(sorted({inputs.printable(c) for cs in classes.values() for c in cs}))
    if not names:
      raise UsageError(f"--input {common.input!r} holds no <split>/<class> folders")
    features = Features({
        "audio": Tensor(shape=(config.clip_samples, config.channels), dtype=config.dtype),
        "num_samples": Tensor(shape=(), dtype="int64", encoding="none"),
        "label": ClassLabel(names), "file_name": Text()})
    return OutputPlan(
        features=features, splits=tuple(s for s in classes if classes[s]),
        description=f"Audio clips from {inputs.printable(common.input)}, converted by {PIPELINE}.",
        source={"pipeline": PIPELINE, "input": inputs.printable(common.input), "sample_rate": config.sample_rate,
                "clip_samples": config.clip_samples, "channels": config.channels, "dtype": config.dtype,
                "fit": config.fit, "seed": common.seed, "num_shards": common.num_shards},
        launcher_rejects=(*(Reject(inputs.printable(s), "not inside a class folder") for s in sorted(strays)),
                          *(Reject(inputs.printable(p), reason) for p, reason in sorted(odd))),
        state=_Layout(classes, names))

  def sources(self, common: CommonConfig, config: AudioFolderConfig, plan: OutputPlan) -> Sources:
    """See Converter.sources: every class folder, keyed (split, class name); each file is a unit."""
    return Sources(folders=[((s, inputs.printable(c)), fs.join(common.input, s, c))
                            for s, cs in plan.state.classes.items() for c in cs], root=common.input)

  def unit_converter(self, common: CommonConfig, config: AudioFolderConfig, plan: OutputPlan) -> UnitConverter:
    """See Converter.unit_converter: one WAV file → its record, or a reject."""
    return _ClipUnits(common.input, plan.state.class_names, plan.features, config, common.read_policy)
