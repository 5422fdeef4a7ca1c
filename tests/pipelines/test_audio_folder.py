"""`pipelines.audio_folder`: folders of WAV clips → fixed-length audio records (the fifth converter, added
without a change in pipelines/core)."""

from __future__ import annotations

import io
import json
import os
import wave

import numpy as np
import pytest

from formats import arrayrecord
from formats.manifest import MANIFEST_FILENAME, Manifest
from pipelines import audio_folder
from pipelines.audio_folder import AudioFolderConfig, read_clip
from pipelines.core import UsageError, launch

RATE = 8000
CLIP = AudioFolderConfig(sample_rate=RATE, clip_samples=800)  # 0.1 s


def wav(samples: np.ndarray, rate: int = RATE, width: int = 2) -> bytes:
  """A PCM WAV file of `samples` ([n] or [n, channels] integers of the width's range)."""
  samples = samples.reshape(len(samples), 1) if samples.ndim == 1 else samples
  buf = io.BytesIO()
  with wave.open(buf, "wb") as w:
    w.setnchannels(samples.shape[1])
    w.setsampwidth(width)
    w.setframerate(rate)
    if width == 1:
      frames = (samples + 128).astype(np.uint8).tobytes()
    elif width == 3:
      v = samples.astype(np.int32).reshape(-1)
      frames = np.stack([v & 255, (v >> 8) & 255, (v >> 16) & 255], axis=1).astype(np.uint8).tobytes()
    else:
      frames = samples.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    w.writeframes(frames)
  return buf.getvalue()


def _write(path: str, data: bytes) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(data)


def sample_input(base: str) -> tuple[str, list[str]]:
  """A small input for registry-driven tests (tests/pipelines/test_registry.py): (folder, own flags)."""
  root = os.path.join(base, "speech")
  rng = np.random.default_rng(0)
  for split, n in (("train", 4), ("validation", 2)):
    for cls in ("no", "yes"):
      for i in range(n):
        length = int(rng.integers(600, 1000))  # shorter and longer than the 800-sample clip
        _write(os.path.join(root, split, cls, f"c{i}.wav"), wav(rng.integers(-3000, 3000, length)))
  _write(os.path.join(root, "train", "yes", "loud.wav"), wav(rng.integers(-3000, 3000, 800), rate=16000))
  _write(os.path.join(root, "train", "no", "notes.txt"), b"not audio")
  _write(os.path.join(root, "train", "stray.wav"), wav(np.zeros(800, np.int64)))
  return root, [f"--sample_rate={RATE}", "--clip_seconds=0.1"]


def test_a_clip_is_padded_or_cut_to_the_static_length_and_keeps_its_own_length():
  short = np.arange(500) - 250
  samples, num = read_clip(wav(short), CLIP)
  assert samples.shape == (800, 1)
  assert samples.dtype == np.int16
  assert num == 500
  np.testing.assert_array_equal(samples[:500, 0], short)
  assert not samples[500:].any()
  long = np.arange(1200) - 600
  samples, num = read_clip(wav(long), CLIP)
  assert num == 1200
  np.testing.assert_array_equal(samples[:, 0], long[:800])


@pytest.mark.parametrize("width,scale", [(1, 128), (2, 32768), (3, 1 << 23), (4, 1 << 31)])
def test_float32_scales_every_pcm_width_to_minus_one_one(width, scale):
  values = np.array([-scale, -scale // 2, 0, scale // 2, scale - 1])
  samples, _ = read_clip(wav(values, width=width), AudioFolderConfig(RATE, 5, dtype="float32"))
  np.testing.assert_allclose(samples[:, 0], values / scale)
  assert samples.min() == -1.0 and samples.max() == (1.0 if width == 4 else 1 - 1 / scale)  # 32-bit: [-1, 1]


def _lying_fmt_size(data: bytes) -> bytes:
  """The WAV with its fmt chunk claiming 16 MiB: Python's wave raises RuntimeError, not wave.Error."""
  i = data.index(b"fmt ")
  return data[:i + 4] + (0xFFFFFF).to_bytes(4, "little") + data[i + 8:]


@pytest.mark.parametrize("data,config,reason", [
    (b"RIFF....WAVEjunk", CLIP, "not a PCM WAV file"),
    (b"not audio at all", CLIP, "not a PCM WAV file"),
    (_lying_fmt_size(wav(np.zeros(800, np.int64))), CLIP, "not a PCM WAV file"),  # was a RuntimeError
    (wav(np.zeros(800, np.int64), rate=16000), CLIP, "sample rate 16000 Hz is not --sample_rate 8000"),
    (wav(np.zeros((800, 2), np.int64)), CLIP, "2 channels, not --channels 1"),
    (wav(np.zeros(800, np.int64), width=3), CLIP, "24-bit samples: --audio_dtype=int16 keeps 16-bit clips only"),
    (wav(np.zeros(0, np.int64)), CLIP, "no samples"),
    (wav(np.zeros(700, np.int64)), AudioFolderConfig(RATE, 800, fit="exact"), "700 samples, not 800"),
])
def test_a_clip_that_does_not_fit_is_a_reject_with_its_reason(data, config, reason):
  with pytest.raises(ValueError, match="^" + reason.replace("(", r"\(")):
    read_clip(data, config)


def test_a_truncated_clip_keeps_the_frames_it_holds():
  data = wav(np.arange(800) - 400)
  samples, num = read_clip(data[:-200], CLIP)  # 100 frames short of what its header says
  assert num == 700
  np.testing.assert_array_equal(samples[:700, 0], (np.arange(800) - 400)[:700])


@pytest.mark.parametrize("args,message", [
    ([], "--sample_rate and --clip_seconds are required"),
    ([f"--sample_rate={RATE}", "--clip_seconds=0.00001"], "holds no sample"),
    (["--sample_rate=0", "--clip_seconds=1"], "--sample_rate"),
    ([f"--sample_rate={RATE}", "--clip_seconds=1", "--audio_dtype=int8"], "--audio_dtype"),
    ([f"--sample_rate={RATE}", "--clip_seconds=1", "--fit=stretch"], "--fit"),
])
def test_bad_flags_are_usage_errors(args, message, tmp_path):
  root, _ = sample_input(str(tmp_path))
  with pytest.raises(UsageError, match=message):
    launch.parse(audio_folder.CONVERTER, [f"--input={root}", f"--output={tmp_path}/out", *args])


@pytest.mark.slow
def test_the_output_holds_every_clip_once_and_rejects_the_rest(tmp_path):
  root, own = sample_input(str(tmp_path))
  out = str(tmp_path / "out")
  audio_folder.run([f"--input={root}", f"--output={out}", "--num_shards=2", *own])
  m = Manifest.loads(open(os.path.join(out, MANIFEST_FILENAME), "rb").read())
  assert m.kind == "tensors"
  assert m.features["label"].names == ("no", "yes")
  records = {split: [m.features.decode(r) for s in m.splits[split].shards
                     for r in arrayrecord.read_file(os.path.join(out, s.path))] for split in m.splits}
  assert {s: len(r) for s, r in records.items()} == {"train": 8, "validation": 4}
  for split, recs in records.items():
    for r in recs:
      assert r["audio"].shape == (800, 1)
      raw, _ = read_clip(open(os.path.join(root, r["file_name"]), "rb").read(), CLIP)
      np.testing.assert_array_equal(r["audio"], raw)
      assert r["file_name"].startswith(f"{split}/{m.features['label'].names[int(r['label'])]}/")
  rejected = sorted((json.loads(line)["input"].rsplit("/", 1)[1], json.loads(line)["reason"])
                    for line in open(os.path.join(out, m.rejected.path)))
  assert rejected == [("loud.wav", "sample rate 16000 Hz is not --sample_rate 8000"),
                      ("notes.txt", "not a PCM WAV file"), ("stray.wav", "not inside a class folder")]
  assert m.rejected.count == 3
