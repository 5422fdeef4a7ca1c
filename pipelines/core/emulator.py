"""Beam's GCS client against the storage emulator (tests, local development).

With STORAGE_EMULATOR_HOST set, Beam's FileSystems must talk to the emulator
anonymously: Beam otherwise looks for Google credentials first and retries
with back-off for about 25 s per process before giving up. google-cloud-storage
(formats.storage.files) honours the variable on its own.
"""

from __future__ import annotations

import os


def use_anonymous_credentials() -> None:
  """Tells Beam's GCS client to use no credentials when STORAGE_EMULATOR_HOST is set."""
  if not os.environ.get("STORAGE_EMULATOR_HOST"):
    return
  from apache_beam.internal.gcp import auth  # Beam keeps its credentials in this private class

  with auth._Credentials._credentials_lock:
    auth._Credentials._credentials = None
    auth._Credentials._credentials_init = True
